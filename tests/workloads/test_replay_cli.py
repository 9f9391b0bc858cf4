"""`talaria replay` end to end on a few sessions: the table, the JSON file, the plots, the
sweeps with the best-quantum baseline, and clear errors for bad arguments."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from talaria.cli import main
from talaria.policies.config import TALARIA_SETTING
from workloads.traces.readers import load_any_trace, real_trace_path


def test_replay_writes_table_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main([
        "replay", "--policies", "baseline,talaria", "--max-sessions", "3", "--workers", "1",
        "--no-progress", "--json", str(out_json), "--plot", str(out_png), "--sweep",
        "--quanta", "10,30", "--load-fractions", "1",
    ])
    assert rc == 0
    text = capsys.readouterr().out
    assert "baseline" in text and "talaria" in text and "isolated" in text
    assert "Slot-quantum sweep" in text and "Load sweep" in text
    assert "closest to the reference" in text
    data = orjson.loads(out_json.read_bytes())
    assert set(data["policies"]) == {"baseline", "talaria"}
    for st in data["policies"].values():
        assert st["sessions"] == 3 and st["failed_calls"] == 0
        assert st["sct_p50_s"] <= st["sct_p95_s"]
        assert st["p50_over_isolated"] >= 1.0
        assert min(st["p50_over_bound"], st["p95_over_bound"], st["mean_over_bound"]) >= 1.0
    assert data["policies"]["baseline"]["speedup_p50"] == 1.0
    assert data["isolated"]["sessions"] == 3
    assert data["lower_bound"]["sct_p50_s"] <= data["isolated"]["sct_p50_s"] * (1 + 1e-6)
    best = data["baseline_best_quantum"]["p50"]
    assert best["slot_quantum_s"] in (10.0, 30.0)
    q_points = data["sweeps"]["quantum"]["points"]
    assert [p["slot_quantum_s"] for p in q_points] == [10.0, 30.0]
    assert best["sct_s"] == min(p["policies"]["baseline"]["sct_p50_s"] for p in q_points)
    assert len(data["sweeps"]["load"]["points"]) == 2
    for name in ("baseline", "talaria"):
        st = data["policies"][name]
        assert st["setting"] == TALARIA_SETTING  # untuned: PolicyConfig's defaults
        assert set(st["breakdown"]["mean"]) == {"own", "queue", "slot_wait", "switch",
                                                "recompute", "restore", "tool_gaps"}
        assert sum(st["breakdown"]["mean"].values()) == pytest.approx(st["sct_mean_s"])
        assert set(st["breakdown"]["per_model"]) <= {"qwen3-235b-a22b", "glm-4.5-air",
                                                     "mistral-large-2407"}
    assert data["oracle"]["sct_p50_s"] <= data["oracle"]["sct_p95_s"]
    assert "own" in text and "recomp" in text  # the time-split table
    assert out_png.stat().st_size > 0
    assert (tmp_path / "r_sweep.png").stat().st_size > 0
    assert (tmp_path / "r_split.png").stat().st_size > 0


def test_tune_writes_settings_that_the_next_replay_uses(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    settings = tmp_path / "tuned.json"
    args = ["replay", "--policies", "baseline", "--max-sessions", "2", "--workers", "1",
            "--no-progress", "--quanta", "10", "--settings", str(settings)]
    assert main([*args, "--tune"]) == 0
    tuned = orjson.loads(settings.read_bytes())
    row = tuned["rows"]["baseline"]
    assert [(p["slot_close"], p["slot_quantum_s"]) for p in row["grid"]] == [
        ("empty", 10.0), ("drained", 10.0), ("quantum", 10.0)]
    best = min(row["grid"], key=lambda p: (p["sct_p50_s"] * p["sct_p95_s"]))
    assert row["setting"] == {"slot_close": best["slot_close"], "slot_quantum_s": 10.0}
    assert set(tuned["ideal"]) == {"p50", "p95"}
    capsys.readouterr()
    out_json = tmp_path / "r.json"
    assert main([*args, "--json", str(out_json)]) == 0
    assert "tuned, from" in capsys.readouterr().out
    data = orjson.loads(out_json.read_bytes())
    assert data["policies"]["baseline"]["setting"] == row["setting"]
    assert data["policies"]["baseline"]["sct_p50_s"] == pytest.approx(row["sct_p50_s"])
    assert data["oracle"]["sct_p50_s"] == pytest.approx(tuned["ideal"]["p50"]["sct_s"])
    assert data["oracle"]["sct_p95_s"] == pytest.approx(tuned["ideal"]["p95"]["sct_s"])
    # tuning another row keeps the cached rows and the ideal bound's schedules
    other = [*args[:2], "vllm_sleep", *args[3:]]
    assert main([*other, "--tune"]) == 0
    again = orjson.loads(settings.read_bytes())
    assert set(again["rows"]) == {"baseline", "vllm_sleep"}
    assert again["rows"]["baseline"] == row and again["ideal"] == tuned["ideal"]
    # on another trace the cached settings apply only when asked for
    out_other = tmp_path / "other.json"
    capsys.readouterr()
    assert main([*args[:4], "3", *args[5:], "--json", str(out_other)]) == 0
    assert "each policy's own" in capsys.readouterr().out
    assert main([*args[:4], "3", *args[5:], "--fixed-settings", "--json", str(out_other)]) == 0
    assert "fixed: tuned on another trace" in capsys.readouterr().out
    data = orjson.loads(out_other.read_bytes())
    assert data["policies"]["baseline"]["setting"] == row["setting"]


def test_replay_scale_out_replicates_sessions(tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    rc = main(["replay", "--policies", "sglang_hicache", "--max-sessions", "2", "--servers", "2",
               "--workers", "1", "--no-progress", "--json", str(out_json)])
    assert rc == 0
    data = orjson.loads(out_json.read_bytes())
    assert data["setup"]["servers"] == 2
    assert data["policies"]["sglang_hicache"]["sessions"] == 4
    assert data["oracle"]["sessions"] == 4 and data["isolated"]["sessions"] == 4


def test_replay_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--policies", "nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # refused by argparse (see the int flags' test below)
        main(["replay", "--servers", "0"])
    assert "argument --servers" in capsys.readouterr().err
    assert main(["replay", "--trace", "/no/such/trace.jsonl"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # Two copies of Qwen3-235B's shard do not fit an H100: staging policies fail up front.
    assert main(["replay", "--server", "h100x8", "--policies", "talaria"]) == 2
    assert "--no-staging" in capsys.readouterr().err
    # the leave-one-out check runs the suite's scenarios, so it would silently not run
    assert main(["replay", "--leave-one-out", "2", "--policies", "talaria"]) == 2
    assert "takes no --trace, --policies" in capsys.readouterr().err
    # --loo-rows chooses among the leave-one-out rows, and only with --leave-one-out
    assert main(["replay", "--loo-rows=-sp"]) == 2
    assert "--loo-rows chooses rows of --leave-one-out" in capsys.readouterr().err
    assert main(["replay", "--leave-one-out", "1", "--loo-rows=-sp,-spx"]) == 2
    err = capsys.readouterr().err
    assert "not leave-one-out rows: -spx;" in err and "-priority_switch" in err
    assert main(["replay", "--leave-one-out", "1", "--loo-rows=-sp,placebo,-sp"]) == 2
    assert "names a row twice" in capsys.readouterr().err
    assert main(["replay", "--leave-one-out", "1", "--loo-rows=,"]) == 2
    assert "names no row" in capsys.readouterr().err
    # --suite-rows names rows of the suite's table, and not beside the other suite modes
    assert main(["replay", "--suite-rows=aegaeon,nope"]) == 2
    err = capsys.readouterr().err
    assert "not rows of the suite: nope;" in err and "vllm_sleep_lmcache" in err
    assert main(["replay", "--leave-one-out", "1", "--suite-rows=aegaeon"]) == 2
    assert "--suite-rows chooses rows of the suite's table" in capsys.readouterr().err
    # the suite runs only without --trace, --policies and --servers: not silently ignored
    assert main(["replay", "--policies", "talaria", "--suite-rows=aegaeon"]) == 2
    assert "--suite-rows chooses rows of the suite's table" in capsys.readouterr().err
    # refused before the default trace's table runs, not after it
    assert main(["replay", "--tune-new-points"]) == 2
    assert "--tune-new-points goes with --tune-suite" in capsys.readouterr().err


def test_loo_rows_runs_only_the_rows_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """``--loo-rows`` hands exactly its rows, in its order, to the leave-one-out run, and the
    summary counts only them."""
    import workloads.suite.cli as suite_cli
    from workloads.suite.leave_one_out import Comparison

    asked: dict[str, object] = {}

    def fake_run(config: object, baseline_setting: object, *, draws: int,
                 rows: tuple[str, ...], workers: int, progress: bool) -> list[Comparison]:
        asked.update(draws=draws, rows=rows)
        return [Comparison("miniswe/burst/1srv", row, f, 100.0, 90.0, (-0.2, -0.01))
                for row in rows for f in ("p50", "p95", "mean")]

    monkeypatch.setattr(suite_cli, "run_leave_one_out", fake_run)
    assert main(["replay", "--leave-one-out", "3", "--loo-rows=placebo, -lending",
                 "--max-sessions", "2", "--workers", "1", "--no-progress"]) == 0
    assert asked == {"draws": 3, "rows": ("placebo", "-lending")}
    out = capsys.readouterr().out
    summary = [line.split()[0] for line in out.splitlines() if " / " in line
               and line.strip().split()[0] in ("placebo", "-lending", "-sp")]
    assert summary == ["placebo", "-lending"]
    assert "miniswe/burst/1srv -lending p50 90 against 100" in out


def test_suite_rows_run_the_baseline_talaria_and_the_rows_named_in_the_suites_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import workloads.suite.cli as suite_cli

    assert suite_cli.parse_suite_rows("talaria, aegaeon") == ("baseline", "aegaeon", "talaria")
    assert suite_cli.parse_suite_rows("autellix,baseline") == ("baseline", "autellix", "talaria")
    # with --tune-suite: only the rows named are tuned, never Talaria; the baseline when none
    assert suite_cli.tune_rows("talaria, aegaeon,continuum_ttl") == ("continuum_ttl", "aegaeon")
    assert suite_cli.tune_rows("autellix,baseline") == ("baseline", "autellix")
    assert suite_cli.tune_rows("talaria") == ("baseline",)
    asked: dict[str, object] = {}

    class Ran(Exception):
        pass

    def fake_suite(config: object, settings: object, *, rows: tuple[str, ...], workers: int,
                   progress: bool) -> None:
        asked["rows"] = rows
        raise Ran

    monkeypatch.setattr(suite_cli, "run_suite", fake_suite)
    with pytest.raises(Ran):
        main(["replay", "--suite-rows=continuum_ttl", "--max-sessions", "2", "--workers", "1",
              "--no-progress"])
    assert asked == {"rows": ("baseline", "continuum_ttl", "talaria")}


@pytest.mark.skipif(not real_trace_path().exists(), reason="the shared real trace is absent")
def test_the_real_trace_format_is_recognised() -> None:
    sessions = load_any_trace(real_trace_path())
    assert len(sessions) == 179


def test_bench_sim_runs_each_server_count_on_the_replicated_trace(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--bench-sim`` replays the trace once per server count (copies of it, in a fresh
    process each) and prints a row per count: its sessions and calls scale with the count,
    and the simulated replay is the one ``--servers N`` runs (its makespan); then the control
    plane's floor, the same sessions on one server, with its ratio to the one-server row."""
    rc = main(["replay", "--bench-sim", "--bench-servers", "1,2", "--max-sessions", "2",
               "--no-progress"])
    assert rc == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("1", "2"), ("2", "4"), ("1", "2")]
    assert int(rows[1][2]) == 2 * int(rows[0][2])  # calls
    assert all(float(r[7]) > 0 and float(r[8]) > 0 for r in rows)  # peak RSS, simulated s
    floor = " ".join(rows[2])
    assert rows[2][9] == "floor" and rows[2][2] == rows[0][2]
    ratio = float(floor.split("; ")[1].split("x")[0])
    assert ratio == pytest.approx(float(rows[2][6]) / float(rows[0][6]), abs=0.1)


def test_bench_sim_with_cut_fused_steps_runs_the_default_first_for_a_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc = main(["replay", "--bench-sim", "--bench-servers", "1", "--max-sessions", "2",
               "--fused-steps", "32", "--cut-fused-steps", "--no-progress"])
    assert rc == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0].isdigit()]
    assert len(rows) == 3 and "floor" in rows[2]
    assert rows[0].rstrip().endswith("reference")
    ratio = float(rows[1].split("this: ")[1].split("x")[0])
    # the printed ratio is the two rows' calls per CPU-second
    assert ratio == pytest.approx(float(rows[1].split()[6]) / float(rows[0].split()[6]), rel=0.02)


@pytest.mark.parametrize(("argv", "code", "says"), [
    (["replay", "--suite", "off", "--trace", "."], 2, "is not a file"),
    (["replay", "--suite", "off", "--policies", "talaria", "--json", "{missing}/x.json"], 2,
     "its folder does not exist"),
    (["replay", "--suite", "off", "--tp", "3", "--policies", "talaria"], 2,
     "must divide"),
    (["replay", "--live", "http://127.0.0.1:9", "--max-sessions", "1"], 1, "Cannot connect"),
    (["make-models", "{file}"], 1, "Not a directory"),
    (["replay", "--live", "127.0.0.1:9", "--max-sessions", "1"], 2, "http:// or https://"),
    (["replay", "--bench-sim", "--bench-servers", "1,x", "--max-sessions", "1"], 2,
     "--bench-servers must be comma-separated integers >= 1, got '1,x'"),
    (["replay", "--bench-sim", "--bench-servers", "0", "--max-sessions", "1"], 2,
     "--bench-servers must be comma-separated integers >= 1, got '0'"),
    (["replay", "--tune", "--suite", "off", "--policies", "talaria", "--settings",
      "{missing}/t.json"], 2, "its folder does not exist"),
    # a folder as an output was refused only when the run wrote its results, at its end
    (["replay", "--suite", "off", "--policies", "talaria", "--json", "{folder}"], 2,
     "it is a folder"),
    (["replay", "--suite", "off", "--policies", "talaria", "--plot", "{folder}"], 2,
     "it is a folder"),
], ids=["trace-is-a-folder", "json-folder-missing", "tp-heads", "live-unreachable",
        "models-into-a-file", "live-not-a-url", "bench-servers-not-numbers",
        "bench-servers-zero", "tune-settings-folder-missing", "json-is-a-folder",
        "plot-is-a-folder"])
def test_a_users_mistake_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, says: str,
) -> None:
    """A wrong path, an address nothing answers at, a parallel size the models' heads do not
    divide: one line naming it and a non-zero exit, before any long run, no traceback."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    argv = [a.format(missing=tmp_path / "nope", file=afile, folder=tmp_path) for a in argv]
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"talaria {argv[0]}: error:") and says in err[0]
    assert "no-staging" not in err[0]  # that hint is for what staging's room cannot fit
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--block-size", "0", "an integer >= 1"), ("--tp", "0", "an integer >= 1"),
    ("--fused-steps", "0", "an integer >= 1"), ("--workers", "0", "an integer >= 1"),
    ("--servers", "0", "an integer >= 1"), ("--max-sessions", "-1", "an integer >= 1"),
    ("--tp", "two", "an integer >= 1"), ("--shared-prefix", "-1", "an integer >= 0"),
    ("--live-vocab", "1", "an integer >= 2"),
])
def test_an_int_flag_out_of_range_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, says: str,
) -> None:
    """Refused as the flag the user typed, when the arguments are parsed: ``--block-size 0``
    was refused as ``SimEngineConfig.block_size``, and ``--fused-steps 0`` only after the
    trace was loaded."""
    with pytest.raises(SystemExit) as exc:
        main(["replay", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"talaria replay: error: argument {flag}: must be {says}, got {value!r}", err
