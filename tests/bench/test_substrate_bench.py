"""bench_switch runs end to end on a small shard and reports every kind of copy."""

from __future__ import annotations

import pytest

from talaria.bench.substrate import bench_switch


def test_bench_switch_reports_each_copy() -> None:
    result = bench_switch(1 << 20, "cpu", repeats=1)
    assert result["bytes"] == 1 << 20 and result["device"] == "cpu"
    for kind in ("activate_h2d", "stage", "activate_d2d", "plain_copy"):
        entry = result[kind]
        assert isinstance(entry, dict) and entry["seconds"] > 0 and entry["gb_per_s"] > 0
    with pytest.raises(ValueError, match="nbytes > 0"):
        bench_switch(0)
