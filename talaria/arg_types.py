"""Argument types for the command lines: a bad value is refused by argparse, naming the flag
the user typed (``argument --tp: must be an integer >= 1, got '0'``), before anything runs,
not later by whatever the value configures under its own name."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

__all__ = ["check_output_path", "float_above", "float_at_least", "int_at_least", "positive_int"]


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = lo - 1
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1)


def _finite_float(fits: Callable[[float], bool], bound: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and fits(value)):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value

    return parse


def float_above(lo: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number > ``lo`` (``inf`` and ``nan`` are refused: a
    duration, rate or scale of either never ends a run, or ends it in a conversion error)."""
    return _finite_float(lambda v: v > lo, f"> {lo:g}")


def float_at_least(lo: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number >= ``lo``."""
    return _finite_float(lambda v: v >= lo, f">= {lo:g}")


def check_output_path(out: str | Path) -> None:
    """A file a command will write at its end: refused now (``ValueError``) when its folder
    does not exist or it names a folder, not after the run."""
    if not Path(out).resolve().parent.is_dir():
        raise ValueError(f"cannot write {out}: its folder does not exist")
    if Path(out).is_dir():
        raise ValueError(f"cannot write {out}: it is a folder")
