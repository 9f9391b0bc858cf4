"""Calibration and the step-time check interleaved (the first half of ``talaria
fidelity``): round after round in one process at one torch thread setting, this machine is
calibrated and then the live engine's steps are measured and priced with that round's
calibration, so each error compares two measurements taken minutes apart under the same
conditions. Over the rounds:
- the spec the run keeps (and the replay uses) is each constant's median over the rounds;
- the step-time result is every point's median measured step over the rounds, priced with
  that spec;
- the spread says how far the rounds are apart: each round's own median and p90 error, how
  much each point's measured time moved, and how much each calibrated constant moved.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from substrate.devices import DeviceSpec, ServerSpec
from talaria.bench.step_fidelity import PointResult, quantile, summarize

__all__ = ["Round", "run_rounds", "median_server", "pooled_results", "spread", "format_spread"]


@dataclass(frozen=True)
class Round:
    server: ServerSpec
    info: dict[str, Any]  # how it was calibrated (talaria.bench.calibrate)
    results: list[PointResult]  # the step-time check, priced with ``server``


def run_rounds(
    rounds: int,
    calibrate: Callable[[], tuple[ServerSpec, dict[str, Any]]],
    measure: Callable[[ServerSpec], list[PointResult]],
    log: Callable[[str], None] = print,
) -> list[Round]:
    """``rounds`` times: calibrate, then measure the steps and price them with it."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    out = []
    for r in range(rounds):
        log(f"-- round {r + 1} of {rounds}: calibration")
        server, info = calibrate()
        log(f"-- round {r + 1} of {rounds}: step time")
        out.append(Round(server, info, measure(server)))
    return out


def _median_or_none(values: Sequence[float | None]) -> float | None:
    """The median of the values given; None where most rounds measured none."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if 2 * len(known) > len(values) else None


def median_server(servers: Sequence[ServerSpec]) -> ServerSpec:
    """Every numeric constant of the device and of the efficiency overrides at its median
    over ``servers`` (the rest as the first has it)."""
    if not servers:
        raise ValueError("no servers to take the median of")
    first = servers[0]
    device: dict[str, Any] = {}
    for f in dataclasses.fields(DeviceSpec):
        values = [getattr(s.device, f.name) for s in servers]
        if all(isinstance(v, int | float | None) and not isinstance(v, bool) for v in values):
            median = _median_or_none(values)
            device[f.name] = int(median) if isinstance(values[0], int) and median else median
        else:
            device[f.name] = values[0]
    names = sorted({name for s in servers for name, _ in s.efficiency})
    efficiency = {n: statistics.median(dict(s.efficiency).get(n, 0.0) for s in servers)
                  for n in names}
    return dataclasses.replace(first, device=DeviceSpec(**device),
                               efficiency=tuple(sorted(efficiency.items())))


def pooled_results(rounds: Sequence[Round], server: ServerSpec,
                   price: Callable[[Sequence[PointResult], ServerSpec], list[PointResult]]
                   ) -> list[PointResult]:
    """Each point's median measured step over the rounds (the lower middle one, with the
    work it ran), priced with ``server`` by ``price`` (results of one case at a time)."""
    if not rounds:
        raise ValueError("no rounds to pool")
    count = len(rounds[0].results)
    if any(len(r.results) != count for r in rounds):
        raise ValueError("rounds measured different points")
    middle = []
    for i in range(count):
        ordered = sorted((r.results[i] for r in rounds), key=lambda p: p.measured.seconds)
        middle.append(ordered[(len(ordered) - 1) // 2])
    out: list[PointResult] = []
    start = 0
    while start < count:  # one case at a time, in order
        end = start
        while end < count and middle[end].case == middle[start].case:
            end += 1
        out.extend(price(middle[start:end], server))
        start = end
    return out


def _relative_range(values: Sequence[float]) -> float:
    """(max - min) / median; 0 for fewer than two values or a median of 0."""
    median = statistics.median(values) if values else 0.0
    return (max(values) - min(values)) / median if len(values) > 1 and median else 0.0


def _constants(server: ServerSpec) -> dict[str, float]:
    out = {f"device.{k}": float(v) for k, v in dataclasses.asdict(server.device).items()
           if isinstance(v, int | float) and not isinstance(v, bool)}
    return {**out, **{f"efficiency.{k}": float(v) for k, v in server.efficiency}}


def spread(rounds: Sequence[Round]) -> dict[str, Any]:
    """How far the rounds are apart (see the module doc)."""
    per_round = []
    for r in rounds:
        s = summarize(r.results)
        per_round.append({k: s[k] for k in ("median_rel_err", "p90_rel_err",
                                            "median_signed_err")})
    points = [_relative_range([r.results[i].measured.seconds for r in rounds])
              for i in range(len(rounds[0].results))] if rounds else []
    constants = [_constants(r.server) for r in rounds]
    names = sorted(set().union(*constants)) if constants else []
    moved = {n: _relative_range([c[n] for c in constants if n in c]) for n in names}
    moved = {n: v for n, v in moved.items() if v > 0}
    def extent(key: str) -> list[float]:
        values = [p[key] for p in per_round]
        return [min(values), max(values)] if values else [0.0, 0.0]

    return {
        "rounds": len(rounds),
        "per_round": per_round,
        "median_rel_err_range": extent("median_rel_err"),
        "p90_rel_err_range": extent("p90_rel_err"),
        "median_signed_err_range": extent("median_signed_err"),
        "point_time_spread": {"median": quantile(points, 0.5), "p90": quantile(points, 0.9)},
        "constant_spread": dict(sorted(moved.items(), key=lambda kv: -kv[1])),
    }


def format_spread(s: Mapping[str, Any], worst: int = 4) -> str:
    """The spread as a few lines."""
    lines = ["per round (median |err| / p90 |err| / median signed): " + "; ".join(
        f"{p['median_rel_err']:.0%} / {p['p90_rel_err']:.0%} / {p['median_signed_err']:+.0%}"
        for p in s["per_round"])]
    pts = s["point_time_spread"]
    lines.append(f"a point's measured time moved between rounds by {pts['median']:.0%} "
                 f"(median over points; p90 {pts['p90']:.0%}), (max - min) / median")
    moved = list(s["constant_spread"].items())
    if moved:
        lines.append("calibrated constants that moved most: " + ", ".join(
            f"{n.split('.', 1)[1]} {v:.0%}" for n, v in moved[:worst]))
    return "\n".join(lines)
