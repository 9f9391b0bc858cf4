"""The baseline and the peers at their best in hindsight, per scenario and per figure.

``tune_suite`` runs every row of ``TUNED_ROWS`` over its grid of slot-closing rules and quanta
(``SUITE_RULES`` x ``SUITE_QUANTA``; Aegaeon over its quota grid, ``SUITE_QUOTAS``), plus its
default-trace setting when that is not on the grid, in every scenario, and keeps, for p50, p95 and the mean separately, the setting with the lowest value
(ties to the earlier grid point). The grid is coarser than the default trace's
(``workloads.benchmark.tuning``): closing when the queue is empty was no row's best there (the
baseline's best "empty" setting was 4.6x its best p50), and the quanta span a slot of a
minute to one that outlasts most sessions; each point is a whole pass of the suite.
Talaria is not tuned: it runs one configuration everywhere. The result is cached in
``SUITE_SETTINGS_PATH`` per scenario, under a key of what a scenario's runs depend on beyond
its name (``suite_key``: sizes, seed, cluster), so ``make replay`` runs each row at its best
settings without the grids. A tuning over some of the server counts (``servers``) adds its
scenarios to the cache and keeps the others'. The cache also records, per scenario and row,
the grid points it was run at (``grids``), so a grid extended by a point (30 s slots were
added when half the rows' best settings sat at the shortest quantum, 60 s) runs that point
alone (``new_points_only``, ``--tune-new-points``).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from substrate.devices import server_preset, server_to_dict
from workloads.replay.systems import PEERS, SYSTEMS
from workloads.suite.run import BASELINE, FIGURES, SuiteSettings, run_suite
from workloads.suite.scenarios import SuiteConfig, scenarios

__all__ = ["SUITE_QUANTA", "SUITE_QUOTAS", "SUITE_RULES", "SUITE_SETTINGS_PATH", "TUNED_ROWS", "load_suite_settings",
           "suite_key", "tune_suite"]

SUITE_SETTINGS_PATH = Path(__file__).parents[1] / "data" / "suite_settings.json"
TUNED_ROWS: tuple[str, ...] = (BASELINE, *PEERS)
SUITE_RULES: tuple[str, ...] = ("drained", "quantum")
SUITE_QUANTA: tuple[float, ...] = (0.234375, 0.46875, 0.9375, 1.875, 3.75, 7.5, 15.0, 30.0, 60.0, 240.0, 960.0)
SUITE_QUOTAS: tuple[float, ...] = (1.0, 2.0, 4.0)  # Aegaeon's, within its Q_MAX of 4 s


def suite_key(config: SuiteConfig) -> str:
    """What a scenario's tuned settings depend on beyond its name (trace, arrivals, servers):
    the suite's sizes, seed and cluster, its server's physical numbers included (settings
    tuned under other prices read as untuned)."""
    spec = config.spec
    parts = [config.sessions_per_server, config.pooled_sessions, config.seed,
             [spec.server, spec.tp, list(spec.models), spec.block_size,
              spec.max_fused_decode_steps] + (["cut"] if spec.cut_fused_steps else []),
             server_to_dict(server_preset(spec.server))]
    return hashlib.sha256(orjson.dumps(parts)).hexdigest()[:16]


def _grid(row: str, fallback: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The row's grid, and its ``fallback`` (its default-trace setting) when not on it: a row
    tuned per scenario is never worse there than it would be untuned."""
    quanta = SUITE_QUOTAS if SYSTEMS[row].grid == "preempt" else SUITE_QUANTA
    grid = [{"slot_close": rule, "slot_quantum_s": q} for q in quanta for rule in SUITE_RULES]
    if fallback is not None:
        point = {"slot_close": fallback["slot_close"],
                 "slot_quantum_s": float(fallback["slot_quantum_s"])}
        if point not in grid:
            grid.append(point)
    return grid


def _cached(config: SuiteConfig, path: Path) -> dict[str, Any]:
    """The cache's ``settings`` and ``values`` when made for ``config``'s key, else empty."""
    if path.exists():
        data = orjson.loads(path.read_bytes())
        if data.get("suite_key") == suite_key(config):
            return data
    return {"settings": {}, "values": {}}


def _new_points(
    grids: dict[str, list[dict[str, Any]]], cached: dict[str, Any], names: list[str],
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, dict[str, Any]]]]:
    """Per row, the grid points some scenario of ``names`` has no recorded run of; and the
    cached best of every scenario, figure by figure, to start from."""
    seed = _cached_best(cached, names, list(grids), "tune them in full first")
    recorded = cached["grids"]
    points = {}
    for row, grid in grids.items():
        everywhere = set.intersection(*({(rule, float(q)) for rule, q in recorded[name][row]}
                                        for name in names))
        points[row] = [p for p in grid if tuple(_pair(p)) not in everywhere]
    return points, seed


def tune_suite(config: SuiteConfig, fallback: dict[str, dict[str, Any]], *, workers: int = 1,
               progress: bool = False, path: Path = SUITE_SETTINGS_PATH,
               servers: tuple[int, ...] | None = None,
               new_points_only: bool = False,
               rows: tuple[str, ...] | None = None) -> SuiteSettings:
    """Run every tuned row's grid in every scenario (only those on ``servers`` when given);
    write the best settings beside the cached ones of other scenarios; return them all.

    ``rows``: tune only these rows of ``TUNED_ROWS`` (a row whose code or router changed);
    every other row keeps the cache's settings, values and grids in these scenarios, which it
    must hold. The baseline runs in every pass whichever rows are tuned (its bursts set the
    Poisson rates).

    ``new_points_only``: run only the grid points the cache records no run of in these
    scenarios (its ``grids``), starting from its best values: a grid extended by a point
    costs one pass, not all of them. Sound only while the rows' code is what made the cached
    values (they are not re-run); a point that ties a cached best keeps the cached setting."""
    if servers is not None:
        unknown = set(servers) - set(config.servers)
        if unknown:
            raise ValueError(f"server count(s) {sorted(unknown)} are not in the suite's "
                             f"{list(config.servers)}")
        config = replace(config, servers=tuple(servers))
    tuned_rows = _tuned_rows(rows)
    grids = {row: _grid(row, fallback.get(row)) for row in tuned_rows}
    names = [s.name for s in scenarios(config)]
    start = _cached(config, path)
    points, seed = _new_points(grids, start, names) if new_points_only else (grids, {})
    kept = [row for row in TUNED_ROWS if row not in grids]
    _cached_best(start, names, kept, "tune every row there first")  # refused before any pass
    checkpoint = _Checkpoint(_partial_path(path), config, points)
    done, best = checkpoint.load()
    if not done:
        best = seed
    width = max((len(g) for g in points.values()), default=0)
    if progress and done:
        print(f"tuning resumes after {done} of {width} grid passes ({checkpoint.path})", flush=True)
    for i in range(done, width):
        # grid point i of every row at once: each pass is a complete suite (its Poisson
        # rates come from the baseline at its fallback setting, the same in every pass); a
        # row whose grid is shorter repeats its last point, except in a pass of new points
        # only, where it sits out (the baseline always runs: its bursts set the rates)
        chosen = {row: g[min(i, len(g) - 1)] for row, g in points.items()
                  if i < len(g) or (g and not new_points_only)}
        if BASELINE not in chosen:
            baseline_grid = points.get(BASELINE) or grids.get(BASELINE) or _grid(
                BASELINE, fallback.get(BASELINE))
            chosen = {BASELINE: baseline_grid[-1]} | chosen
        run_rows = list(chosen)
        settings = SuiteSettings({name: {row: {f: chosen[row] for f in FIGURES} for row in run_rows}
                                  for name in names}, fallback)
        result = run_suite(config, settings, rows=run_rows, workers=workers, progress=progress)
        for name, res in result.scenarios.items():
            for row, r in res.rows.items():
                if row not in grids:
                    continue  # run for the rates only: it keeps what the cache holds
                for f in FIGURES:
                    current = best.setdefault(name, {}).setdefault(row, {}).get(f)
                    if current is None or r.values[f] < current["value"]:
                        best[name][row][f] = {"value": r.values[f], "setting": chosen[row]}
        checkpoint.save(i + 1, best)
    cached = _cached(config, path)  # read again: another tuning may have written it meanwhile
    # a row not tuned here is the cache's as it is now (a tuning of it may have ended since)
    source = {(name, row): cached if _holds(cached, name, row) else start
              for name in names for row in kept}
    for (name, row), held in source.items():
        best = _merge(best, _cached_best(held, [name], [row], "tune every row there first"))
    tuned = cached["settings"] | {name: {row: {f: v["setting"] for f, v in by_fig.items()}
                                         for row, by_fig in by_row.items()}
                                  for name, by_row in best.items()}
    values = cached["values"] | {name: {row: {f: v["value"] for f, v in by_fig.items()}
                                        for row, by_fig in by_row.items()}
                                 for name, by_row in best.items()}
    recorded = start.get("grids", {}) if new_points_only else {}
    ran = {name: {row: (_union(recorded.get(name, {}).get(row, []), grids[row]) if row in grids
                        else source[name, row]["grids"][name][row])
                  for row in TUNED_ROWS} for name in names}
    data = {"suite_key": suite_key(config), "criterion": "per figure, the lowest over the grid",
            "settings": tuned, "values": values, "grids": cached.get("grids", {}) | ran}
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")
    checkpoint.path.unlink(missing_ok=True)
    return SuiteSettings(tuned, fallback)


def _union(recorded: list[list[Any]], grid: list[dict[str, Any]]) -> list[list[Any]]:
    """The points a scenario's row has been run at: ``recorded`` ones, then ``grid``'s new."""
    out = [[rule, float(q)] for rule, q in recorded]
    for pair in map(_pair, grid):
        if pair not in out:
            out.append(pair)
    return out


def _pair(point: dict[str, Any]) -> list[Any]:
    """A grid point as the cache records it: [rule, quantum]."""
    return [point["slot_close"], float(point["slot_quantum_s"])]


def _tuned_rows(rows: tuple[str, ...] | None) -> tuple[str, ...]:
    """``rows`` in ``TUNED_ROWS``' order (None: all of them); a row not tuned is refused."""
    if rows is None:
        return TUNED_ROWS
    unknown = [row for row in rows if row not in TUNED_ROWS]
    if unknown or not rows:
        raise ValueError(f"rows to tune must be some of {', '.join(TUNED_ROWS)}; got "
                         f"{', '.join(rows) or 'none'}")
    return tuple(row for row in TUNED_ROWS if row in rows)


def _cached_best(cached: dict[str, Any], names: list[str], rows: list[str],
                 hint: str) -> dict[str, dict[str, dict[str, Any]]]:
    """The cache's best of ``rows`` in every scenario of ``names``, figure by figure: what a
    tuning of new points starts from, and what a tuning of other rows keeps. A scenario whose
    cache lacks a row's values or its grid is refused (``hint``: what to do instead)."""
    recorded = cached.get("grids", {})
    missing = [name for name in names
               if not all(row in recorded.get(name, {}) and row in cached["values"].get(name, {})
                          for row in rows)]
    if missing:
        raise ValueError(f"the cache holds no tuning of {', '.join(rows)} for {missing[:3]}"
                         f"{' ...' if len(missing) > 3 else ''}: {hint}")
    return {name: {row: {f: {"value": cached["values"][name][row][f],
                             "setting": cached["settings"][name][row][f]} for f in FIGURES}
                   for row in rows} for name in names}


def _holds(cached: dict[str, Any], name: str, row: str) -> bool:
    """Whether the cache holds ``row``'s settings, values and grid in scenario ``name``."""
    return all(row in cached.get(key, {}).get(name, {}) for key in ("settings", "values", "grids"))


def _merge(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Two per-scenario maps of rows, joined scenario by scenario."""
    return {name: {**a.get(name, {}), **b.get(name, {})} for name in {*a, *b}}


def _partial_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.partial.json")


class _Checkpoint:
    """The grid passes a tuning has finished and the best values so far, written after each
    pass (a pass of the four-server suite takes tens of minutes), so a tuning that stops
    resumes at the next pass. It is read back only by a tuning of the same suite, servers and
    grids (``key``); the cache of settings is written only when every pass is done."""

    def __init__(self, path: Path, config: SuiteConfig,
                 points: dict[str, list[dict[str, Any]]]) -> None:
        self.path = path
        parts = [suite_key(config), list(config.servers), list(config.traces), list(config.loads),
                 points]
        self.key = hashlib.sha256(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]

    def load(self) -> tuple[int, dict[str, dict[str, dict[str, Any]]]]:
        if self.path.exists():
            data = orjson.loads(self.path.read_bytes())
            if data.get("key") == self.key:
                return int(data["passes"]), data["best"]
        return 0, {}

    def save(self, passes: int, best: dict[str, dict[str, dict[str, Any]]]) -> None:
        data = {"key": self.key, "passes": passes, "best": best}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
        tmp.replace(self.path)


def load_suite_settings(config: SuiteConfig, fallback: dict[str, dict[str, Any]],
                        path: Path = SUITE_SETTINGS_PATH) -> SuiteSettings:
    """The cached settings of this suite configuration's scenarios (a scenario with none runs
    each row at ``fallback``, its default-trace setting, marked untuned)."""
    names = {s.name for s in scenarios(config)}
    tuned = {name: rows for name, rows in _cached(config, path)["settings"].items()
             if name in names}
    return SuiteSettings(tuned, fallback)

