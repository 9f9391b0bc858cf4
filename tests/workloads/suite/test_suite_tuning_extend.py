"""Extending the suite's tuning grid: only the new points run, from the cached best values."""

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


def _grid(monkeypatch: pytest.MonkeyPatch, quanta: tuple[float, ...]) -> None:
    monkeypatch.setattr(suite_tuning, "SUITE_QUANTA", quanta)
    monkeypatch.setattr(suite_tuning, "SUITE_RULES", ("quantum",))
    monkeypatch.setattr(suite_tuning, "TUNED_ROWS", ("baseline", "vllm_sleep"))


def _record_passes(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, float]]:
    """Each pass's quantum per row, as ``tune_suite`` hands them to ``run_suite``."""
    passes: list[dict[str, float]] = []
    real_run = suite_tuning.run_suite

    def recording(cfg: SuiteConfig, settings: SuiteSettings, **kw: object) -> object:
        first = next(iter(settings.tuned.values()))
        passes.append({row: s["p50"]["slot_quantum_s"] for row, s in first.items()})
        return real_run(cfg, settings, **kw)

    monkeypatch.setattr(suite_tuning, "run_suite", recording)
    return passes


def test_a_new_grid_point_runs_alone_and_the_best_is_the_full_grids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _grid(monkeypatch, (10.0, 200.0))
    path = tmp_path / "suite.json"
    suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=path)
    first = orjson.loads(path.read_bytes())
    scenario = next(iter(first["values"]))
    assert first["grids"][scenario]["vllm_sleep"] == [["quantum", 10.0], ["quantum", 200.0]]
    assert first["grids"][scenario]["baseline"] == [["quantum", 10.0], ["quantum", 200.0],
                                                    ["quantum", 60.0]]

    _grid(monkeypatch, (5.0, 10.0, 200.0))
    passes = _record_passes(monkeypatch)
    extended = suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=path, new_points_only=True)
    assert passes == [{"baseline": 5.0, "vllm_sleep": 5.0}]  # the one point not run yet
    data = orjson.loads(path.read_bytes())
    assert data["grids"][scenario]["vllm_sleep"] == [["quantum", 10.0], ["quantum", 200.0],
                                                     ["quantum", 5.0]]
    assert extended.tuned == data["settings"]

    passes.clear()
    full = tmp_path / "full.json"
    suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=full)
    assert len(passes) == 4  # 5, 10, 200 and the baseline's 60: every point again
    whole = orjson.loads(full.read_bytes())
    assert data["values"] == whole["values"]  # the same best values, one pass instead of four
    for name, rows in whole["settings"].items():
        for row, by_figure in rows.items():
            for figure, setting in by_figure.items():
                kept = data["settings"][name][row][figure]
                # a tie keeps the cached setting; otherwise both chose the same point
                assert kept == setting or (
                    whole["values"][name][row][figure] == first["values"][name][row][figure])

    passes.clear()  # nothing new: no pass, the cache unchanged
    suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=path, new_points_only=True)
    assert passes == [] and orjson.loads(path.read_bytes()) == data


def test_new_points_only_needs_the_cache_to_say_what_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _grid(monkeypatch, (10.0,))
    path = tmp_path / "suite.json"
    with pytest.raises(ValueError, match="holds no tuning"):
        suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=path, new_points_only=True)
    suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=path)
    data = orjson.loads(path.read_bytes())
    del data["grids"]
    path.write_bytes(orjson.dumps(data))
    with pytest.raises(ValueError, match="holds no tuning"):
        suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=path, new_points_only=True)


def test_the_shipped_cache_records_the_grid_of_its_settings() -> None:
    """Every cached setting is one of the points its scenario's row was run at."""
    data = orjson.loads(suite_tuning.SUITE_SETTINGS_PATH.read_bytes())
    assert set(data["grids"]) == set(data["settings"])
    for name, rows in data["settings"].items():
        for row, by_figure in rows.items():
            ran = data["grids"][name][row]
            for setting in by_figure.values():
                assert [setting["slot_close"], setting["slot_quantum_s"]] in ran


def test_tuning_some_rows_keeps_the_others_as_the_cache_holds_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _grid(monkeypatch, (10.0, 200.0))
    path = tmp_path / "suite.json"
    with pytest.raises(ValueError, match="holds no tuning of baseline"):
        suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=path, rows=("vllm_sleep",))
    suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=path)
    first = orjson.loads(path.read_bytes())
    scenario = next(iter(first["values"]))
    # the cache's baseline as another tuning would have left it: it must come back untouched
    first["values"][scenario]["baseline"]["p50"] = 1.0
    first["grids"][scenario]["baseline"].append(["drained", 7.0])
    path.write_bytes(orjson.dumps(first))

    passes = _record_passes(monkeypatch)
    retuned = suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=path, rows=("vllm_sleep",))
    # vllm_sleep at each of its points; the baseline at one point in each pass, for the rates
    assert passes == [{"baseline": 60.0, "vllm_sleep": 10.0}, {"baseline": 60.0, "vllm_sleep": 200.0}]
    data = orjson.loads(path.read_bytes())
    assert data["values"][scenario]["baseline"] == first["values"][scenario]["baseline"]
    assert data["settings"][scenario]["baseline"] == first["settings"][scenario]["baseline"]
    assert data["grids"][scenario]["baseline"] == first["grids"][scenario]["baseline"]
    assert data["values"][scenario]["vllm_sleep"] == first["values"][scenario]["vllm_sleep"]
    assert data["grids"][scenario]["vllm_sleep"] == [["quantum", 10.0], ["quantum", 200.0]]
    assert retuned.tuned == data["settings"]
    with pytest.raises(ValueError, match="rows to tune"):
        suite_tuning.tune_suite(_CONFIG, _FALLBACK, path=path, rows=("talaria",))
