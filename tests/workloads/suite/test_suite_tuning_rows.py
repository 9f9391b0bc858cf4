"""Tuning some rows of the suite: the rows not tuned are the cache's as it is at the end."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from workloads.suite import tuning as suite_tuning
from workloads.suite.run import SuiteSettings
from workloads.suite.scenarios import SuiteConfig

_CONFIG = SuiteConfig(traces=("miniswe",), loads=(1.0,), servers=(1,), sessions_per_server=3,
                      pooled_sessions=3)
_FALLBACK = {"baseline": {"slot_close": "quantum", "slot_quantum_s": 60.0}}


def test_a_row_another_tuning_wrote_meanwhile_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tunings of different rows of the same scenarios at once (``--suite-rows``): the
    one that ends last keeps what the other wrote of its rows, as a tuning of other server
    counts keeps the other's scenarios; the cache is read again at the end for that."""
    monkeypatch.setattr(suite_tuning, "SUITE_QUANTA", (10.0, 200.0))
    monkeypatch.setattr(suite_tuning, "SUITE_RULES", ("quantum",))
    monkeypatch.setattr(suite_tuning, "TUNED_ROWS", ("baseline", "vllm_sleep"))
    path = tmp_path / "suite.json"
    suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=path)
    scenario = next(iter(orjson.loads(path.read_bytes())["values"]))
    real_run = suite_tuning.run_suite
    other: dict[str, object] = {}

    def meanwhile(cfg: SuiteConfig, settings: SuiteSettings, **kw: object) -> object:
        if not other:  # the baseline's own tuning ends while this one runs
            data = orjson.loads(path.read_bytes())
            data["values"][scenario]["baseline"]["p50"] = 0.5
            data["settings"][scenario]["baseline"]["p50"] = {"slot_close": "quantum",
                                                              "slot_quantum_s": 200.0}
            data["grids"][scenario]["baseline"].append(["drained", 7.0])
            path.write_bytes(orjson.dumps(data))
            other.update(data)
        return real_run(cfg, settings, **kw)

    monkeypatch.setattr(suite_tuning, "run_suite", meanwhile)
    tuned = suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=path, rows=("vllm_sleep",))
    data = orjson.loads(path.read_bytes())
    for key in ("values", "settings", "grids"):
        assert data[key][scenario]["baseline"] == other[key][scenario]["baseline"]  # type: ignore[index]
    assert tuned.tuned == data["settings"]
