"""`talaria replay`'s number flags refuse what no run can use, naming the flag, when the
arguments are parsed: ``--day inf`` (and ``--day-load inf``, ``--day-rate inf``) drew
sessions for ever, ``--aegaeon-fixed-s inf`` never finished its first switch, ``--token-scale
inf`` ended in an OverflowError's traceback and ``--time-scale nan`` in "cannot convert float
NaN to integer", each only after the trace was loaded or the router answered."""

from __future__ import annotations

import math

import pytest

from engine.sim.config import SimEngineConfig
from talaria.cli import build_parser
from workloads.suite.day import DayConfig


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--day", "inf", "> 0"), ("--day", "nan", "> 0"), ("--day", "0", "> 0"),
    ("--day-load", "inf", "> 0"), ("--day-rate", "inf", "> 0"),
    ("--aegaeon-fixed-s", "inf", ">= 0"), ("--aegaeon-fixed-s", "-1", ">= 0"),
    ("--time-scale", "nan", ">= 0"), ("--time-scale", "inf", ">= 0"),
    ("--token-scale", "inf", "> 0"), ("--token-scale", "0", "> 0"),
    ("--skew", "nan", ">= 0"), ("--sleep-efficiency", "inf", "> 0"),
    ("--day", "soon", "> 0"),
])
def test_a_number_flag_no_run_can_use_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, says: str,
) -> None:
    with pytest.raises(SystemExit) as exc:  # parsed only: before the fix some ran for ever
        build_parser().parse_args(["replay", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"talaria replay: error: argument {flag}: must be a finite number {says}, " \
                  f"got {value!r}", err


def test_a_finite_number_in_range_is_taken_as_a_float() -> None:
    args = build_parser().parse_args(["replay", "--day", "0.5", "--aegaeon-fixed-s", "0",
                                      "--time-scale", "2", "--skew", "1e-3"])
    assert (args.day, args.aegaeon_fixed_s, args.time_scale, args.skew) == (0.5, 0.0, 2.0, 1e-3)
    assert args.day_load == 0.5 and args.sleep_efficiency is None  # defaults untouched


@pytest.mark.parametrize("field", ["hours", "load", "sessions_per_hour"])
def test_a_day_of_no_end_is_refused_by_its_config(field: str) -> None:
    with pytest.raises(ValueError, match="finite"):
        DayConfig(**{field: math.inf})


def test_an_endless_scale_up_cost_is_refused_by_the_simulated_engines_config() -> None:
    with pytest.raises(ValueError, match="scale_up_fixed_s must be a finite number >= 0"):
        SimEngineConfig(scale_up_fixed_s=math.inf)
