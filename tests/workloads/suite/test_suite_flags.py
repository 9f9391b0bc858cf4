"""The suite's own flags are refused before anything runs where they cannot act: each one
was silently ignored (``--tune-suite --suite off`` exited 0 having tuned nothing;
``--tune-servers`` without ``--tune-suite``; ``--leave-one-out`` or ``--develop`` beside
``--live``, which replayed against the router instead) or refused only after the default
trace's table had run for minutes (``--leave-one-out -1``, ``--tune-servers abc`` or a server
count the suite has not, ``--tune-suite`` beside ``--leave-one-out``)."""

from __future__ import annotations

import pytest

from talaria.cli import main
from workloads import replay_cli
from workloads.suite import cli as suite_cli


@pytest.mark.parametrize(("argv", "says"), [
    (["--tune-suite", "--suite", "off"], "--tune-suite tunes the suite's scenarios"),
    (["--tune-suite", "--policies", "talaria"], "--tune-suite tunes the suite's scenarios"),
    (["--tune-suite", "--trace", "t.jsonl"], "--tune-suite tunes the suite's scenarios"),
    (["--tune-suite", "--servers", "2"], "--tune-suite tunes the suite's scenarios"),
    (["--tune-suite", "--live", "http://x"], "--tune-suite tunes the suite's scenarios"),
    (["--tune-suite", "--bench-sim"], "--tune-suite tunes the suite's scenarios"),
    (["--tune-suite", "--day", "1"], "--tune-suite tunes the suite's scenarios"),
    (["--tune-suite", "--leave-one-out", "1"], "--leave-one-out runs Talaria's one setting"),
    (["--tune-servers", "1"], "--tune-servers goes with --tune-suite"),
    (["--tune-suite", "--tune-servers", "abc"],
     "--tune-servers must be comma-separated server counts of the suite (1, 4), got 'abc'"),
    (["--tune-suite", "--tune-servers", "1,3"],
     "--tune-servers must be comma-separated server counts of the suite (1, 4), got '1,3'"),
    (["--tune-suite", "--tune-servers", ","],
     "--tune-servers must be comma-separated server counts of the suite (1, 4), got ','"),
    (["--leave-one-out", "1", "--live", "http://x"], "--leave-one-out runs the suite's own"),
    (["--leave-one-out", "1", "--bench-sim"], "--leave-one-out runs the suite's own"),
    (["--leave-one-out", "1", "--strip-session-ids"], "--leave-one-out runs the suite's own"),
    (["--develop", "talaria", "--live", "http://x"], "--develop runs the development"),
    (["--develop", "talaria", "--bench-sim"], "--develop runs the development"),
    (["--develop", "talaria", "--strip-session-ids"], "--develop runs the development"),
    # --suite-rows beside a mode that runs no suite was ignored without a word
    (["--suite-rows", "talaria", "--live", "http://x"], "--suite-rows chooses rows"),
    (["--suite-rows", "talaria", "--bench-sim"], "--suite-rows chooses rows"),
    (["--suite-rows", "talaria", "--strip-session-ids"], "--suite-rows chooses rows"),
    (["--suite-rows", "talaria", "--day", "1"], "--suite-rows chooses rows"),
])
def test_a_suite_flag_that_cannot_act_is_refused_up_front(
    nothing_runs: None, capsys: pytest.CaptureFixture[str], argv: list[str], says: str,
) -> None:
    assert main(["replay", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("talaria replay: error: ") and says in err[0], err


@pytest.mark.parametrize("draws", ["0", "-1", "two"])
def test_leave_one_out_takes_one_draw_or_more_as_parsed(
    nothing_runs: None, capsys: pytest.CaptureFixture[str], draws: str,
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--leave-one-out", draws])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("talaria replay: error: argument --leave-one-out: must be an integer >= 1, "
                   f"got {draws!r}")


def test_tune_servers_are_parsed_once_against_the_suites_server_counts() -> None:
    assert suite_cli.parse_tune_servers(" 4, 1", "quick") == (4, 1)
    assert suite_cli.parse_tune_servers("1", "full") == (1,)
    with pytest.raises(ValueError, match="server counts of the suite"):
        suite_cli.parse_tune_servers("1,1", "quick")


def test_the_suite_flags_still_reach_a_run_that_can_use_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[str] = []
    monkeypatch.setattr(replay_cli, "_simulate", lambda *args, **kwargs: ran.append("sim") or 0)
    assert main(["replay", "--tune-suite", "--tune-servers", "1", "--no-progress"]) == 0
    assert main(["replay", "--leave-one-out", "2", "--no-progress"]) == 0
    assert ran == ["sim", "sim"]


def test_a_settings_seed_with_no_cached_draw_is_refused_before_the_default_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """``--settings-seed 99`` (no suite settings tuned on that draw) was refused only once
    the default trace's table had run, minutes later."""
    import workloads.benchmark.sweep as sweep

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("ran the default trace's table before refusing")

    monkeypatch.setattr(sweep, "run_many", ran)
    assert main(["replay", "--settings-seed", "99", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--settings-seed 99:" in err[0] and "holds no settings" in err[0]
