"""Every row at its best setting: the slot-closing rule and quantum grid, and its cache.

``tune`` replays the trace for every (row, setting) of the row's grid (in parallel worker
processes) and keeps, per row, the setting with the lowest geometric mean of p50 and p95 SCT
(the two numbers the table reports; ties go to the earlier grid point). The ideal bound's
family of schedules (``workloads.bounds.oracle.ideal_schedules``) runs too and keeps, for p50 and
for p95 separately, the schedule that does best: the bound is the best of them per
percentile. ``talaria replay --tune`` writes the result to ``TUNED_PATH``;
``talaria replay`` reads it back when it was made for the same trace and cluster
(``setup_key``), so the benchmark does not re-run the grids.

Grids: a round-scheduled row tries every closing rule at quanta from 5 s to 960 s
(``workloads.replay.systems.ROUND_QUANTA``); Aegaeon, whose quota the paper bounds by Q_MAX = 4 s,
tries every rule at 0.5 s to 4 s.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from substrate.devices import server_preset, server_to_dict
from talaria.policies.config import SLOT_CLOSE_RULES
from workloads.bounds.oracle import ideal_schedules
from workloads.bounds.shared_device import DeviceSchedule
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import ReplayResult
from workloads.replay.jobs import Job, run_many
from workloads.replay.systems import PREEMPT_QUANTA, ROUND_QUANTA, SystemConfig
from workloads.suite.stats import percentile
from workloads.traces.trace import Session

__all__ = ["GRIDS", "TUNE_COMMAND", "TUNED_PATH", "Tuned", "apply_settings", "grid",
           "best_ideal", "ideal_candidates", "load_settings", "save_settings", "setup_key", "tune"]

TUNED_PATH = Path(__file__).parents[1] / "data" / "tuned_settings.json"
TUNE_COMMAND = "make replay ARGS=--tune"
GRIDS: dict[str, tuple[float, ...]] = {"round": ROUND_QUANTA, "preempt": PREEMPT_QUANTA}


def grid(system: SystemConfig, quanta: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """The settings ``system`` may run at; ``quanta`` replaces its grid's quanta. A row on
    the ``fixed`` grid has one: its own (Talaria's one configuration)."""
    if system.grid == "fixed":
        return [system.setting]
    return [{"slot_close": rule, "slot_quantum_s": q}
            for q in (quanta or GRIDS[system.grid]) for rule in SLOT_CLOSE_RULES]


@dataclass
class Tuned:
    """Each row's best setting, and the ideal family's best schedule for p50 and for p95
    (``{"p50": {"schedule": {...}, "name", "sct_s"}, "p95": ...}``)."""

    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    ideal: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def settings(self) -> dict[str, dict[str, Any]]:
        return {name: row["setting"] for name, row in self.rows.items()}

    def merged(self, newer: Tuned) -> Tuned:
        """These settings with ``newer``'s rows (and ideal, when it has one) replacing them."""
        return Tuned({**self.rows, **newer.rows}, dict(newer.ideal or self.ideal))


def setup_key(sessions: Sequence[Session], spec: ClusterSpec, seed: int) -> str:
    """What a tuned setting depends on: the trace's content and the simulated cluster, its
    server's physical numbers included (settings tuned under other prices are not kept)."""
    trace = [(s.session_id, s.model, s.arrival_s,
              [(c.input_tokens, c.output_tokens, c.tool_gap_s) for c in s.calls])
             for s in sessions]
    cluster = [spec.servers, spec.server, spec.tp, list(spec.models), spec.block_size,
               spec.max_fused_decode_steps, seed] + (["cut"] if spec.cut_fused_steps else [])
    cluster.append(server_to_dict(server_preset(spec.server)))
    return hashlib.sha256(orjson.dumps([trace, cluster])).hexdigest()[:16]


def _score(scts: Sequence[float]) -> float:
    return math.sqrt(percentile(scts, 50) * percentile(scts, 95))


def tune(
    sessions: Sequence[Session], systems: Sequence[SystemConfig], spec: ClusterSpec, *,
    seed: int = 0, workers: int = 1, progress: bool = False,
    quanta: Sequence[float] | None = None, with_ideal: bool = True,
) -> Tuned:
    """Run every row's grid and (``with_ideal``) the ideal family (``quanta``: instead of the
    grids' own); keep the best of each."""
    points = {s.name: grid(s, quanta) for s in systems}
    schedules = (ideal_schedules(quanta) if quanta else ideal_schedules()) if with_ideal else []
    jobs = [Job((s.name, i), tuple(sessions), s.with_setting(**setting), spec, seed)
            for s in systems for i, setting in enumerate(points[s.name])]
    jobs += [Job(("__ideal__", i), tuple(sessions), None, spec, seed, ideal=schedule)
             for i, schedule in enumerate(schedules)]
    done = run_many(jobs, workers, progress)
    tuned = Tuned()
    for s in systems:
        scored = [(_score(_scts(done[(s.name, i)])), i, setting)
                  for i, setting in enumerate(points[s.name])]
        _, best, setting = min(scored, key=lambda x: (x[0], x[1]))
        tuned.rows[s.name] = {
            "setting": setting,
            **_percentiles(_scts(done[(s.name, best)])),
            "grid": [{**p, **_percentiles(_scts(done[(s.name, i)]))}
                     for _, i, p in sorted(scored, key=lambda x: x[1])],
        }
    for key, q in (("p50", 50.0), ("p95", 95.0)) if schedules else ():
        value, i = min((percentile(_scts(done[("__ideal__", i)]), q), i)
                       for i in range(len(schedules)))
        tuned.ideal[key] = {"schedule": schedules[i].to_dict(), "name": schedules[i].name,
                            "sct_s": value}
    return tuned


def _scts(result: ReplayResult) -> list[float]:
    return [s.sct_s for s in result.sessions]


def _percentiles(scts: Sequence[float]) -> dict[str, float]:
    return {"sct_p50_s": percentile(scts, 50), "sct_p95_s": percentile(scts, 95)}


# Run when nothing is tuned for a trace: the step-level orders and short preemptive slots
# (the members that bound the default trace's p50 and p95), not one schedule alone.
UNTUNED_IDEAL: tuple[DeviceSchedule, ...] = (
    DeviceSchedule("fair"), DeviceSchedule("las"), DeviceSchedule("mas"),
    DeviceSchedule("slots", "drained", 5.0, True), DeviceSchedule("slots", "drained", 30.0, True),
)


def ideal_candidates(tuned: Tuned | None) -> tuple[list[DeviceSchedule], int]:
    """The ideal schedules to run now, and the size of the family they were chosen from:
    the tuned best for p50 and for p95 (one when both agree) out of the whole family, or,
    untuned, ``UNTUNED_IDEAL``. ``best_ideal`` then takes the best run per percentile."""
    if tuned is None or not tuned.ideal:
        return list(UNTUNED_IDEAL), len(UNTUNED_IDEAL)
    chosen = [DeviceSchedule.from_dict(c["schedule"]) for c in tuned.ideal.values()]
    return list(dict.fromkeys(chosen)), len(ideal_schedules())


def best_ideal(runs: dict[DeviceSchedule, ReplayResult]) -> dict[str, DeviceSchedule]:
    """Of the ideal runs, the schedule with the lowest p50 and the one with the lowest p95."""
    return {key: min(runs, key=lambda s: (percentile(_scts(runs[s]), q), s.name))
            for key, q in (("p50", 50.0), ("p95", 95.0))}


def save_settings(tuned: Tuned, key: str, path: Path = TUNED_PATH) -> None:
    data = {
        "setup_key": key,
        "criterion": "rows: lowest sqrt(p50 * p95) SCT over the grid; ideal: lowest p50 and "
                     "lowest p95 over its family and grids",
        "command": TUNE_COMMAND,
        "rows": tuned.rows,
        "ideal": tuned.ideal,
    }
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")


def load_settings(key: str | None, path: Path = TUNED_PATH) -> Tuned | None:
    """The cached settings, or None when the file is missing or was made for another trace
    or cluster (``key`` None: whatever trace and cluster they were made for)."""
    if not path.exists():
        return None
    try:
        data = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a tuned-settings file ({exc})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    ideal = data.get("ideal", {}) if isinstance(data, dict) else None
    if not (isinstance(rows, dict) and isinstance(ideal, dict) and all(
            isinstance(r, dict) and isinstance(r.get("setting"), dict) for r in rows.values())):
        raise ValueError(f"{path}: not a tuned-settings file (a table of rows, each with its "
                         f"setting, as --tune writes)")
    if key is not None and data.get("setup_key") != key:
        return None
    return Tuned(dict(rows), dict(ideal))


def apply_settings(
    systems: Sequence[SystemConfig], settings: Mapping[str, Mapping[str, Any]]
) -> list[SystemConfig]:
    """The systems at their settings (those with none cached, and those on the ``fixed`` grid,
    keep their own)."""
    return [s.with_setting(**settings[s.name]) if s.name in settings and s.grid != "fixed"
            else s for s in systems]
