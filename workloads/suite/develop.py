"""Trying a constant or a rule of Talaria's on development traces only (``make develop``).

Talaria runs one configuration everywhere, and each constant in it names the traces it was
chosen on (docs/constants.md). This is how a new value is tried without looking at what the
headline reports: a variant (``talaria:min_slot_factor=20``: a row of ``SYSTEMS`` with
fields of its policy, ``PolicyConfig``, or of its system, ``SystemConfig``, set) replays the
same sessions as Talaria in every development scenario (``DEV_SUITE_TRACES`` x a burst and
Poisson arrivals x one and four servers), and is compared with it as a leave-one-out row is
(``workloads.suite.leave_one_out``): per scenario the paired change ``variant / talaria - 1``
at p50, p95 and the mean with its 95% interval, and over every scenario the mean change with
a 95% interval over scenarios. A change above zero is a slower variant. A report trace is
refused by name.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from talaria.policies.config import PolicyConfig
from workloads.replay.systems import SYSTEMS, SystemConfig
from workloads.suite.leave_one_out import Comparison, run_paired, suite_level
from workloads.suite.run import BASELINE, FIGURES, TALARIA
from workloads.suite.scenarios import DEV_TRACES, SUITE_TRACES, TRACES, SuiteConfig

__all__ = ["DEV_SUITE_TRACES", "check_development", "format_development", "parse_variant",
           "run_development"]

DEV_SUITE_TRACES: tuple[str, ...] = (
    *(name for name, t in SUITE_TRACES.items() if t.split == "dev"), *DEV_TRACES)
_FIXED = {"name", "description", "policy"}  # SystemConfig fields a variant does not set
_MARK = {"pays": "+", "hurts": "-", "neither": " "}  # + slower than talaria, - faster


def parse_variant(spec: str) -> SystemConfig:
    """``ROW[:field=value,...]``: ``SYSTEMS[ROW]`` with those fields of its policy or its
    system set (a field of both, ``host_kv``, in both), named ``spec``. Values are read as
    the field's type (``true`` / ``false`` for a flag, ``none`` for an optional one); an
    unknown row or field, a value of the wrong type or a configuration the row refuses is a
    ValueError naming the variant."""
    base, _, assignments = spec.partition(":")
    if base not in SYSTEMS:
        raise ValueError(f"variant {spec!r}: no row {base!r}; rows: {', '.join(SYSTEMS)}")
    policy_types = typing.get_type_hints(PolicyConfig)
    system_types = {k: v for k, v in typing.get_type_hints(SystemConfig).items()
                    if k not in _FIXED}
    policy: dict[str, Any] = {}
    system: dict[str, Any] = {}
    for item in filter(None, (a.strip() for a in assignments.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"variant {spec!r}: {item!r} is not field=value")
        known = False
        if key in policy_types and key != "name":
            policy[key] = _value(spec, key, policy_types[key], raw.strip())
            known = True
        if key in system_types:  # host_kv is both: the policy's use and the engine's store
            system[key] = _value(spec, key, system_types[key], raw.strip())
            known = True
        if not known:
            raise ValueError(f"variant {spec!r}: no field {key!r} in PolicyConfig or "
                             "SystemConfig")
    try:
        chosen = SYSTEMS[base].with_policy(**policy)
        return dataclasses.replace(chosen, name=spec, **system)
    except ValueError as exc:
        raise ValueError(f"variant {spec!r}: {exc}") from None


def _value(spec: str, key: str, kind: Any, raw: str) -> Any:
    """``raw`` as a value of the annotated type ``kind``."""
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    if type(None) in options and raw.lower() == "none":
        return None
    for option in (o for o in options if o is not type(None)):
        if option is bool:
            flag = {"true": True, "false": False}.get(raw.lower())
            if flag is not None:
                return flag
        elif option in (int, float, str):
            try:
                return option(raw)
            except ValueError:
                pass
    name = getattr(kind, "__name__", str(kind))
    raise ValueError(f"variant {spec!r}: {key} takes a {name}, not {raw!r}")


def check_development(traces: Sequence[str]) -> None:
    """Refuse a trace the report shows (or one not known), naming it."""
    report = [t for t in traces if t in TRACES and TRACES[t].split != "dev"]
    if report:
        raise ValueError(f"{', '.join(report)}: report trace(s), never looked at to choose a "
                         f"constant; development traces: {', '.join(DEV_SUITE_TRACES)}")
    unknown = [t for t in traces if t not in TRACES]
    if unknown:
        raise ValueError(f"unknown trace(s) {', '.join(unknown)}; development traces: "
                         f"{', '.join(DEV_SUITE_TRACES)}")


def run_development(config: SuiteConfig, variants: Sequence[SystemConfig],
                    baseline_setting: Mapping[str, Any], *, draws: int = 1, workers: int = 1,
                    progress: bool = False) -> list[Comparison]:
    """Each variant against Talaria in every scenario of ``config`` (its traces must all be
    development traces), ``draws`` draws pooled; the baseline runs for the Poisson rates."""
    check_development(config.traces)
    if not variants:
        raise ValueError("name at least one variant to try")
    names = [v.name for v in variants]
    taken = [n for n in names if n in (BASELINE, TALARIA)]
    if taken or len(set(names)) != len(names):
        raise ValueError(f"variants need names of their own, not twice and not "
                         f"{BASELINE} or {TALARIA}: {', '.join(names)}")
    return run_paired(config, baseline_setting, names, draws=draws, workers=workers,
                      progress=progress, systems={v.name: v for v in variants})


def format_development(found: Sequence[Comparison], draws: int) -> str:
    scenarios = list(dict.fromkeys(c.scenario for c in found))
    rows = list(dict.fromkeys(c.row for c in found))
    by_key = {(c.scenario, c.row, c.figure): c for c in found}
    width = max(len(s) for s in scenarios)
    lines = [f"development scenarios, {draws} draw(s): talaria's p50 / p95 / mean (s), then "
             "each variant / talaria - 1 (same sessions; + slower, - faster, beyond the "
             "paired 95% interval)"]
    for row in rows:
        lines.append(f"  variant {rows.index(row) + 1}: {row}")
    lines.append(f"{'scenario':{width}s}  {'talaria':>17s}  " + "  ".join(
        f"{'variant ' + str(i + 1):>20s}" for i in range(len(rows))))
    for name in scenarios:
        base = "/".join(f"{by_key[(name, rows[0], f)].talaria:.0f}" for f in FIGURES)
        cells = ["/".join(f"{100 * c.relative:+.1f}{_MARK[c.verdict]}"
                          for c in (by_key[(name, row, f)] for f in FIGURES)) for row in rows]
        lines.append(f"{name:{width}s}  {base:>17s}  " + "  ".join(f"{c:>20s}" for c in cells))
    lines.append("over every scenario: the mean of variant / talaria - 1, 95% interval over "
                 "scenarios (+ slower, - faster, each only where every draw agrees)")
    for v in suite_level(found):
        if v.figure == FIGURES[0]:
            lines.append(f"  variant {rows.index(v.row) + 1}:")
        per_draw = f" (draws: {', '.join(f'{100 * d:+.1f}' for d in v.per_draw)})" \
            if v.per_draw else ""
        lines.append(f"    {v.figure:4s} {100 * v.relative:+6.2f}% [{100 * v.ci95[0]:+.2f}, "
                     f"{100 * v.ci95[1]:+.2f}]{_MARK[v.verdict]}{per_draw}")
    return "\n".join(lines)
