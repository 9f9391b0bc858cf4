"""``talaria replay --bench-sim``: how fast the simulator itself runs (a benchmark, not a test).

For each server count N, one policy replays the trace replicated N times (``replicate``: copy
r's sessions on their own, as ``--servers N`` does) on an N-instance simulated cluster, in a
fresh worker process so that its peak resident memory is that run's own. It prints simulated
calls per second of wall time and of CPU time (the CPU figure is the one to compare on a
shared machine: other processes' load inflates wall time, not CPU time), peak RSS, and the
simulated makespan each run covered. Given a ``reference`` cluster spec (``--cut-fused-steps``
against the default fusion), each server count runs under both, back to back, and the
second line of each pair says how many times the reference's calls per CPU-second it ran.

Last, the control plane's floor (``control_plane_floor``): the same sessions on one server
with every prompt a few tokens and every answer one token. What is left of a call there is
the work the router, the instance and the engine do per call whatever its size (route,
admit, one prefill step, finish, deliver), so its calls per CPU-second bound what a simulator
gains by making everything that grows with prompts and answers free (KV blocks, prompt
digests, decode steps) while it runs that code per call (DESIGN.md section 5); beyond it,
the per-call code itself has to get faster. Its ratio to the one-server row says how far.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import replicate, run_sim
from workloads.replay.systems import SystemConfig
from workloads.traces.trace import Session

__all__ = ["FLOOR_PROMPT_TOKENS", "SimBenchRow", "bench_sim", "control_plane_floor",
           "format_bench_sim", "parse_server_counts"]

FLOOR_PROMPT_TOKENS = 32  # a floor session's first prompt: two blocks of 16 tokens
FLOOR_LABEL = "floor"


@dataclass(frozen=True)
class SimBenchRow:
    servers: int
    sessions: int
    calls: int
    wall_s: float
    cpu_s: float
    peak_rss_mb: float
    simulated_s: float  # makespan of the replay in virtual time
    failed_calls: int
    label: str = ""  # which spec ran, when two are compared
    speedup: float | None = None  # calls per CPU-second over the reference run's

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def calls_per_cpu_s(self) -> float:
        return self.calls / self.cpu_s if self.cpu_s > 0 else 0.0


def _run_one(sessions: Sequence[Session], system: SystemConfig, spec: ClusterSpec,
             seed: int) -> SimBenchRow:
    from workloads.replay.jobs import quiet_logs

    quiet_logs()
    wall, cpu = time.perf_counter(), time.process_time()
    result = run_sim(sessions, system, spec, seed=seed)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return SimBenchRow(spec.servers, len(sessions), sum(s.num_calls for s in sessions), wall,
                       cpu, peak_kb / 1024, result.makespan_s, result.failed_calls)


def control_plane_floor(sessions: Sequence[Session]) -> list[Session]:
    """``sessions`` with their arrivals, tool gaps and dependencies, each prompt cut to
    ``FLOOR_PROMPT_TOKENS`` tokens and growing by two a call (the previous answer and one new
    token), each answer one token."""
    return [replace(s, calls=tuple(
        replace(c, input_tokens=FLOOR_PROMPT_TOKENS + 2 * k, output_tokens=1, prefix_tokens=None)
        for k, c in enumerate(s.calls))) for s in sessions]


def _in_process(sessions: Sequence[Session], system: SystemConfig, spec: ClusterSpec,
                seed: int) -> SimBenchRow:
    with ProcessPoolExecutor(max_workers=1) as pool:
        return pool.submit(_run_one, sessions, system, spec, seed).result()


def parse_server_counts(text: str, what: str) -> list[int]:
    """``"1,16,64"`` -> [1, 16, 64]; anything else is refused naming ``what``."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"{what} must be comma-separated integers >= 1, got {text!r}")
    return counts


def bench_sim(
    sessions: Sequence[Session], system: SystemConfig, spec: ClusterSpec,
    servers: Sequence[int] = (1, 16, 64), seed: int = 0, progress: bool = True,
    reference: ClusterSpec | None = None, floor: bool = True,
) -> list[SimBenchRow]:
    """One run per server count (two with a ``reference`` spec: it first), each in its own
    fresh process (printed as it ends when ``progress``); then, with ``floor``, the control
    plane's floor on one server (its ``speedup``: its calls per CPU-second over the
    one-server row's, when there is one)."""
    rows: list[SimBenchRow] = []
    for n in servers:
        if n < 1:
            raise ValueError(f"server counts must be >= 1, got {n}")
        copies = replicate(sessions, n)
        pair: list[tuple[ClusterSpec, str]] = (
            [(reference, "reference"), (spec, "this")] if reference else [(spec, "")])
        first: SimBenchRow | None = None
        for run_spec, label in pair:
            row = _in_process(copies, system, replace(run_spec, servers=n), seed)
            if first is not None and first.calls_per_cpu_s > 0:
                row = replace(row, speedup=row.calls_per_cpu_s / first.calls_per_cpu_s)
            row = replace(row, label=label)
            if first is None:
                first = row
            rows.append(row)
            if progress:
                print(format_bench_sim([row], header=len(rows) == 1), flush=True)
    if floor:
        row = _in_process(control_plane_floor(sessions), system, replace(spec, servers=1), seed)
        one = next((r for r in rows if r.servers == 1 and r.label != "reference"), None)
        speedup = (row.calls_per_cpu_s / one.calls_per_cpu_s
                   if one is not None and one.calls_per_cpu_s > 0 else None)
        rows.append(replace(row, label=FLOOR_LABEL, speedup=speedup))
        if progress:
            print(format_bench_sim(rows[-1:], header=len(rows) == 1), flush=True)
    return rows


def format_bench_sim(rows: Sequence[SimBenchRow], header: bool = True) -> str:
    lines = []
    if header:
        lines.append(f"{'servers':>7} {'sessions':>8} {'calls':>8} {'wall s':>8} {'cpu s':>8} "
                     f"{'calls/s':>8} {'calls/cpu-s':>11} {'peak RSS MB':>11} {'simulated s':>11}")
    for r in rows:
        failed = f"  ({r.failed_calls} failed calls)" if r.failed_calls else ""
        which = f"  {r.label}" if r.label else ""
        if r.label == FLOOR_LABEL:
            which += (f" ({FLOOR_PROMPT_TOKENS}-token prompts, 1-token answers: the control "
                      "plane's own work a call")
            if r.speedup is not None:
                which += (f"; {r.speedup:.1f}x the one-server row's calls/cpu-s: the most "
                          "that making work that grows with prompts and answers free gains")
            which += ")"
        elif r.speedup is not None:
            which += f": {r.speedup:.2f}x the reference's calls/cpu-s"
        lines.append(f"{r.servers:7d} {r.sessions:8d} {r.calls:8d} {r.wall_s:8.1f} "
                     f"{r.cpu_s:8.1f} {r.calls_per_s:8.0f} {r.calls_per_cpu_s:11.0f} "
                     f"{r.peak_rss_mb:11.0f} {r.simulated_s:11.0f}{which}{failed}")
    return "\n".join(lines)
