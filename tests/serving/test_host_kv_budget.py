"""The rule for host KV budgets the machine cannot hold, vLLM's for its swap space: over 70% of
the memory an error, over 40% a warning (`talaria serve` applying it before any instance
starts: tests/e2e/test_serve_config.py)."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from talaria.serving.config import ConfigError, ServeConfig
from talaria.serving.preflight import check_host_kv

_GIB = 1 << 30


def _config(*per_instance: tuple[str, int]) -> ServeConfig:
    return ServeConfig.from_dict({"instances": [
        {"id": f"i{k}", "host_kv_bytes": size, "tensor_parallel_size": tp}
        for k, (size, tp) in enumerate(per_instance)]})


def test_a_budget_over_seventy_percent_is_refused_counting_every_rank() -> None:
    with pytest.raises(ConfigError, match=r"32\.0 GiB \(80% of this machine's 40\.0 GiB\)"):
        check_host_kv(_config(("8GiB", 2), ("16GiB", 1)), machine_bytes=40 * _GIB)


def test_a_budget_over_forty_percent_is_a_warning_and_below_it_nothing() -> None:
    with capture_logs() as logs:
        check_host_kv(_config(("20GiB", 1)), machine_bytes=40 * _GIB)
        check_host_kv(_config(("16GiB", 1)), machine_bytes=40 * _GIB)
    assert [e["event"] for e in logs] == ["serve.host_kv_large"]
