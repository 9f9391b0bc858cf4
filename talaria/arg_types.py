"""Argument types for the command lines: a bad value is refused by argparse, naming the flag
the user typed (``argument --tp: must be an integer >= 1, got '0'``), before anything runs,
not later by whatever the value configures under its own name."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["int_at_least", "positive_int"]


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
