"""A flag that belongs to one mode of ``talaria replay`` (``--day``, ``--live``,
``--bench-sim``, ``--strip-session-ids``) is refused without it, before anything runs:
``--day-rate 10`` alone ran the default trace's table and the whole suite (most of an hour)
with the rate ignored, as ``--day-capacity`` alone is already refused."""

from __future__ import annotations

import pytest

from talaria.cli import main
from workloads import replay_cli
from workloads.suite import day_cli


@pytest.mark.parametrize(("argv", "says"), [
    (["--day-load", "0.3"], "--day-load, --day-rate and --day-setting go with --day"),
    (["--day-rate", "10"], "--day-load, --day-rate and --day-setting go with --day"),
    (["--day-setting", "drained/60"], "--day-load, --day-rate and --day-setting go with --day"),
    (["--day-capacity"], "--day-capacity searches a cluster's day: give --day HOURS"),
    (["--time-scale", "2"], "--time-scale, --token-scale, --live-vocab and --api-key go with --live"),
    (["--token-scale", "0.5"], "--time-scale, --token-scale, --live-vocab and --api-key go with --live"),
    (["--live-vocab", "100"], "--time-scale, --token-scale, --live-vocab and --api-key go with --live"),
    (["--api-key", "k"], "--time-scale, --token-scale, --live-vocab and --api-key go with --live"),
    (["--bench-servers", "1,2"], "--bench-servers goes with --bench-sim"),
    (["--shared-prefix", "100"], "--shared-prefix goes with --strip-session-ids"),
])
def test_a_modes_flag_without_its_mode_is_refused(
    nothing_runs: None, capsys: pytest.CaptureFixture[str], argv: list[str], says: str,
) -> None:
    assert main(["replay", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"talaria replay: error: {says}"], err


@pytest.mark.parametrize("argv", [
    ["--day", "1", "--day-rate", "10", "--day-setting", "drained/60"],
    ["--live", "http://x", "--time-scale", "2", "--token-scale", "0.5", "--api-key", "k"],
    ["--bench-sim", "--bench-servers", "1,2"],
    ["--strip-session-ids", "--shared-prefix", "100"],
    ["--day-load", "0.5", "--time-scale", "1", "--shared-prefix", "0"],  # the defaults, spelt out
])
def test_a_modes_flag_with_its_mode_reaches_the_run(
    monkeypatch: pytest.MonkeyPatch, argv: list[str],
) -> None:
    monkeypatch.setattr(replay_cli, "_simulate", lambda *args, **kwargs: 0)
    monkeypatch.setattr(replay_cli, "_live", lambda *args, **kwargs: 0)
    monkeypatch.setattr(day_cli, "run_day_command", lambda *args, **kwargs: 0)
    assert main(["replay", "--no-progress", *argv]) == 0
