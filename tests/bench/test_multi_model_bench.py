"""The multi-model benchmark runs end to end on a short prefix and reports consistent counts
(speed itself is measured by running the benchmark, never asserted)."""

from __future__ import annotations

from talaria.bench.multi_model import bench_multi_model


def test_bench_multi_model_reports_switches_and_restores() -> None:
    result = bench_multi_model(device="cpu", prefix_lens=(32,), repeats=1, size="tiny")
    switch = result["switch"]
    assert isinstance(switch, dict)
    assert switch["bytes"] == result["weight_bytes"]
    assert switch["host_vs_plain"] > 0 and switch["staged_vs_plain"] > 0
    (restore,) = result["restore"]  # type: ignore[misc]
    assert restore["recompute_tokens"] == 32
    assert restore["restored_tokens"] == 32
    assert restore["continuation_prefilled_tokens"] == 16
    assert restore["restore_bytes"] == restore["offload_bytes"] == 32 * result["kv_bytes_per_token"]
