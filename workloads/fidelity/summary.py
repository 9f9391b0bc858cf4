"""The closing table of ``talaria fidelity``: everything a fidelity run is judged by, in
one place (from the run's ``fidelity.json`` dict): the step-time errors and their spread
over the rounds, each replay row's errors, the ranking live and simulated, and how busy the
machine was while it ran (the load average, and what other processes used of the CPUs: 0
on an idle machine). Each figure is set against issue 30's bar (``GOALS``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workloads.fidelity.replays import ranking, same_ranking, told_apart

__all__ = ["GOALS", "failed_calls", "format_summary", "replay_checks"]

GOALS = {"step_median": 0.25, "step_p90": 0.50, "replay_rel_err": 0.30}


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _cores(use: Mapping[str, Any] | None, cpus: int) -> str:
    if not use or use.get("others_cores") is None:
        return "n/a"
    return f"{use['others_cores']:.2f} of {cpus} cores (steal {use['steal_cores']:.2f})"


def _ordered(rows: Mapping[str, Mapping[str, Any]], order: list[str], side: str,
             stat: str) -> str:
    """The policies in ``order`` with the gap to the next one: "a <(1.2 s) b"."""
    out = order[0]
    for a, b in zip(order, order[1:], strict=False):
        out += f" <({rows[b][f'{side}_{stat}_s'] - rows[a][f'{side}_{stat}_s']:.1f} s) {b}"
    return out


def _apart(rows: Mapping[str, Mapping[str, Any]], stat: str) -> str:
    """Which pairs the live replay tells apart, and which it does not."""
    pairs = told_apart(rows, stat)  # in live order already
    order = ranking(rows, "live", stat)
    close = [f"{a} ~ {b}" for i, a in enumerate(order) for b in order[i + 1:]
             if (a, b) not in pairs]
    apart = ", ".join(f"{a} < {b}" for a, b in pairs)
    return (f"told apart live: {apart or 'none'}; within the live sessions' 95% interval: "
            f"{', '.join(close) or 'none'}")


def _row_within(row: Mapping[str, Any]) -> bool:
    """A replay row's simulated p50 and p95 are both within the bar of the live ones."""
    bar = GOALS["replay_rel_err"]
    return abs(row["p50_rel_err"]) <= bar and abs(row["p95_rel_err"]) <= bar


def replay_checks(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, bool]:
    """Whether every row is within the bar at p50 and p95, and whether the ranking by each
    is the same live and simulated (``same_ranking``: every pair of policies the live replay
    tells apart beyond its sessions' 95% interval is in the same order simulated)."""
    return {"rows_within": all(_row_within(r) for r in rows.values()),
            **{f"same_ranking_{stat}": same_ranking(rows, stat) for stat in ("p50", "p95")}}


def failed_calls(out: Mapping[str, Any]) -> int:
    """Calls that failed on either side of either replay (the tiny models' and the real
    model's): a run with any exits non-zero."""
    replays = [out.get("replay") or {}, (out.get("real_model") or {}).get("replay") or {}]
    return sum(int(r["live_failed_calls"] + r["sim_failed_calls"])
               for replay in replays for r in replay.get("rows", {}).values())


def format_summary(out: Mapping[str, Any]) -> str:
    cpus = int(out.get("cpus", 1))
    wall = float(out.get("wall_s", 0.0))
    lines = [f"== talaria fidelity: summary (wall {int(wall // 60)} min {wall % 60:.0f} s, "
             f"{out.get('rounds', 1)} round(s), {out.get('threads_per_rank', 1)} torch "
             f"thread(s) per rank, step clock {out.get('clock', '?')})"]
    watch = out.get("load_watch", {})
    use = out.get("cpu_use", {})
    if watch:
        lines.append(f"machine: load average (1 min) at start {watch['first']:.2f}, mean "
                     f"{watch['mean']:.2f}, max {watch['max']:.2f} during the run; other "
                     f"processes used {_cores(use.get('run'), cpus)} over the run")
    lines += _step_lines(out.get("step_time"), "each point's median over the rounds",
                         _cores(use.get("calibration_and_steps"), cpus))
    lines += _replay_lines(out.get("replay"), use.get("replay", {}), cpus)
    real = out.get("real_model")
    if real and real.get("skipped"):
        lines.append(f"real model: skipped, {real['skipped']}")
    elif real:
        lines.append(f"real model, {real['model']} (off the calibration's fitting set):")
        lines += _step_lines(real.get("step_time"), "priced with the kept spec", None)
        lines += _replay_lines(real.get("replay"), real.get("cpu_use", {}), cpus)
    return "\n".join(lines)


def _step_lines(steps: Mapping[str, Any] | None, how: str, others: str | None) -> list[str]:
    """Step time's median and p90 |error| against the bar, and the rounds' spread."""
    if not steps:
        return []
    med, p90 = steps["median_rel_err"], steps["p90_rel_err"]
    lines = [
        f"step time ({steps['num_points']} points, {how}): "
        f"median |err| {med:.0%} (<= {GOALS['step_median']:.0%}: "
        f"{_met(med <= GOALS['step_median'])}), "
        f"p90 |err| {p90:.0%} (<= {GOALS['step_p90']:.0%}: {_met(p90 <= GOALS['step_p90'])}), "
        f"median signed {steps['median_signed_err']:+.0%}"
        + (f"; other processes used {others}" if others else "")]
    gap = steps.get("spread")
    if gap:
        lo, hi = gap["median_rel_err_range"]
        plo, phi = gap["p90_rel_err_range"]
        slo, shi = gap["median_signed_err_range"]
        pts = gap["point_time_spread"]
        lines.append(f"  spread over {gap['rounds']} rounds: median |err| {lo:.0%} to "
                     f"{hi:.0%}, p90 {plo:.0%} to {phi:.0%}, signed {slo:+.0%} to {shi:+.0%}; "
                     f"a point's measured time moved by {pts['median']:.0%} (median over "
                     f"points, p90 {pts['p90']:.0%})")
    return lines


def _replay_lines(replay: Mapping[str, Any] | None, per_policy: Mapping[str, Any],
                  cpus: int) -> list[str]:
    """Each replay row's errors against the bar, and the ranking live and simulated."""
    if not replay:
        return []
    rows = replay["rows"]
    lines = [f"{'replay':10s} {'live p50':>8s} {'sim p50':>8s} {'err':>6s} "
             f"{'live p95':>8s} {'sim p95':>8s} {'err':>6s}  within "
             f"{GOALS['replay_rel_err']:.0%}  {'engine s live/sim':>17s}  "
             f"other processes' CPU"]
    for policy, r in rows.items():
        live_s, sim_s = r.get("live_engine_s", 0.0), r.get("sim_engine_s", 0.0)
        engine = (f"{live_s:6.1f}/{sim_s:<5.1f} {sim_s / live_s - 1:+4.0%}" if live_s
                  else f"{'n/a':>17s}")
        lines.append(f"{policy:10s} {r['live_p50_s']:8.1f} {r['sim_p50_s']:8.1f} "
                     f"{r['p50_rel_err']:+6.0%} {r['live_p95_s']:8.1f} {r['sim_p95_s']:8.1f} "
                     f"{r['p95_rel_err']:+6.0%}  {_met(_row_within(r)):9s}  {engine:>17s}  "
                     f"{_cores(per_policy.get(policy), cpus)}")
    lines.append("  (engine s: the live instance's engine thread's CPU seconds against the "
                 "simulated engine's busy seconds, a figure other processes do not inflate)")
    if len(rows) < 2:
        return lines
    checks = replay_checks(rows)
    for stat in ("p50", "p95"):
        live, sim = ranking(rows, "live", stat), ranking(rows, "sim", stat)
        lines.append(f"ranking by SCT {stat}: live {_ordered(rows, live, 'live', stat)}; "
                     f"simulated {_ordered(rows, sim, 'sim', stat)}: "
                     f"{'same' if checks[f'same_ranking_{stat}'] else 'DIFFERENT'} "
                     f"({_apart(rows, stat)})")
    return lines
