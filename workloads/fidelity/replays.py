"""The same small trace replayed live and simulated (the second half of ``talaria fidelity``).

Live: ``talaria serve`` with one CPU instance serving the tiny catalog under a policy preset,
driven by the live replay client (``talaria replay --live``). Simulated: the in-process
cluster of the same system, its engine priced by the cost model with the calibrated server
spec and the tiny models' own configs. Both get the very same scaled trace: the first
``max_calls`` calls of the first ``sessions`` sessions of the default trace, each model
mapped to a tiny one, token counts times ``token_scale`` (calls that no longer fit the
context end their session), arrivals
and tool gaps times ``time_scale``, prompt ids from the same seeded generators, outputs
replaced by stand-in ids on both sides (a live answer is text), and the same engine limits
(KV blocks per model, host KV bytes, block size, step budget). So the two count the same
things: per call, prompt tokens served from cache and, of those, restored from host KV
(the live side reads them from ``usage.prompt_tokens_details``); per run, how many sessions'
KV each side demoted to host and how many slots lent the staging region (the live side's
counts from the router's ``/metrics``), and the engine's time: the simulated engine's
modelled busy seconds against the CPU seconds of the live instance's busiest thread (its
engine thread, which runs every step, switch and KV copy), a figure the machine's other
load does not inflate.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.sim.model_spec import ModelSpec
from talaria.bench.machine_load import busiest_thread_cpu_s, descendants, thread_cpu_s
from workloads.replay.cluster import ClusterSpec, ClusterTotals
from workloads.replay.driver import ReplayResult, run_sim
from workloads.replay.live import run_live_replay, scale_sessions
from workloads.replay.live_serve import COUNTER_GAUGES, instance_counters, running_serve
from workloads.replay.systems import system
from workloads.suite.stats import paired_interval, percentile
from workloads.traces.trace import Session

__all__ = ["ReplaySetup", "FIDELITY_POLICIES", "fidelity_trace", "real_model_map", "serve_config_text",
           "replay_pair", "compare", "format_replay_table", "ranking", "same_ranking",
           "told_apart"]

FIDELITY_POLICIES = ("baseline", "+host_kv", "talaria")
# The default trace's models, by role: the popular MoE, the other MoE, the dense one.
MODEL_MAP = {"qwen3-235b-a22b": "tiny-qwen3-moe", "glm-4.5-air": "tiny-qwen3",
             "mistral-large-2407": "tiny-llama"}


def real_model_map(real: str) -> dict[str, str]:
    """The map of the run with the real model: the dense model's sessions go to it (``real``,
    its catalog name), the MoE ones to the tiny MoE and tiny Qwen3 as before."""
    return {**MODEL_MAP, "mistral-large-2407": real}


@dataclass(frozen=True)
class ReplaySetup:
    sessions: int = 16
    max_calls: int = 10  # per session
    token_scale: float = 0.04
    time_scale: float = 0.1
    vocab: int = 256  # prompt ids are drawn from [1, vocab)
    kv_blocks: int = 512  # per model, on both sides
    host_kv_bytes: int = 256 << 20
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    slot_close: str = "drained"
    slot_quantum_s: float = 10.0
    seed: int = 0
    device: str = "cpu"  # the live instance's ("cuda:0": the replay on a GPU)

    def policy_overrides(self) -> dict[str, Any]:
        return {"slot_close": self.slot_close, "slot_quantum_s": self.slot_quantum_s}


def fidelity_trace(
    setup: ReplaySetup, catalog: Mapping[str, ModelSpec],
    model_map: Mapping[str, str] = MODEL_MAP,
) -> list[Session]:
    """The scaled trace both sides replay (see the module doc)."""
    from workloads.traces.generator import default_trace

    chosen = default_trace()[: setup.sessions]
    missing = sorted({model_map.get(s.model, s.model) for s in chosen} - set(catalog))
    if missing:
        raise ValueError(f"the fidelity catalog lacks {missing}")
    mapped = [dataclasses.replace(s, model=model_map.get(s.model, s.model),
                                  calls=s.calls[: setup.max_calls]) for s in chosen]
    context = min(spec.max_position_embeddings for spec in catalog.values())
    scaled, _dropped = scale_sessions(mapped, setup.token_scale, context)
    return scaled


def serve_config_text(setup: ReplaySetup, models: Mapping[str, Path], policy: str) -> str:
    """The ``talaria serve`` TOML of the live side: one instance on ``setup.device``,
    ``policy``."""
    lines = ["[router]", "port = 0", "",
             "[engine]", f"block_size = {setup.block_size}",
             f"max_num_seqs = {setup.max_num_seqs}",
             f"max_num_batched_tokens = {setup.max_num_batched_tokens}", ""]
    for name, path in models.items():
        lines += [f'[models."{name}"]', f'path = "{path}"', ""]
    chosen = system(policy)  # its engine's staging region, as the simulated side has it
    lines += ["[[instances]]", 'id = "i0"', f'device = "{setup.device}"',
              f"kv_blocks = {setup.kv_blocks}",
              f"host_kv_bytes = {setup.host_kv_bytes}",
              f"staging = {str(chosen.staging).lower()}",
              f'staging_region = "{chosen.staging_region}"', "",
              "[policy]", f'preset = "{policy}"', f'slot_close = "{setup.slot_close}"',
              f"slot_quantum_s = {setup.slot_quantum_s}", ""]
    return "\n".join(lines)


def cluster_spec(setup: ReplaySetup, server: str, catalog: Mapping[str, ModelSpec]) -> ClusterSpec:
    """The simulated side's cluster: one TP=1 instance with the live one's limits."""
    return ClusterSpec(
        servers=1, server=server, tp=1, models=tuple(catalog), block_size=setup.block_size,
        max_fused_decode_steps=1, kv_tokens=setup.kv_blocks * setup.block_size,
        model_specs=tuple(catalog.values()), host_kv_bytes=setup.host_kv_bytes,
        max_num_batched_tokens=setup.max_num_batched_tokens, max_num_seqs=setup.max_num_seqs,
    )


def replay_pair(
    setup: ReplaySetup, policy: str, sessions: Sequence[Session], *, server: str,
    models: Mapping[str, Path], threads: int = 1, log: Callable[[str], None] = print,
) -> tuple[ReplayResult, ReplayResult]:
    """(live, simulated) replays of ``sessions`` under ``policy``. The live instance runs
    ``threads`` torch threads (as the server spec was calibrated)."""
    catalog = {name: ModelSpec.from_hf_config(path, name) for name, path in models.items()}
    chosen = system(policy).with_policy(**setup.policy_overrides())
    simulated = run_sim(sessions, chosen, cluster_spec(setup, server, catalog), seed=setup.seed,
                        time_scale=setup.time_scale, vocab_size=setup.vocab,
                        output_kv_reusable=False, exact_max_tokens=True)
    with tempfile.TemporaryDirectory(prefix="talaria-fidelity-") as tmp:
        config = Path(tmp) / "serve.toml"
        config.write_text(serve_config_text(setup, models, policy))
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        with running_serve(config, env=env) as url:
            before = _threads_below_us()
            live, info = run_live_replay(sessions, url, time_scale=setup.time_scale,
                                         token_scale=1.0, vocab_size=setup.vocab,
                                         seed=setup.seed, progress=False)
            engine_cpu_s = busiest_thread_cpu_s(before, _threads_below_us())
            live.totals = ClusterTotals(counters=instance_counters(url), busy_s=engine_cpu_s)
    log(f"  {policy}: live {live.wall_s:.0f} s wall ({info['retries']} re-sent), "
        f"simulated {simulated.wall_s:.1f} s wall")
    return live, simulated


def _threads_below_us() -> dict[int, dict[int, float]]:
    """CPU seconds of every thread of every process below this one."""
    return {pid: thread_cpu_s(pid) for pid in descendants(os.getpid())}


def _side(result: ReplayResult) -> dict[str, float]:
    scts = [s.sct_s for s in result.sessions]
    counters = result.totals.counters if result.totals is not None else {}
    calls = result.calls
    return {"p50_s": percentile(scts, 50), "p95_s": percentile(scts, 95),
            "calls": float(len(calls)), "failed_calls": float(result.failed_calls),
            "prompt_tokens": float(sum(c.prompt_tokens for c in calls)),
            "output_tokens": float(sum(c.output_tokens for c in calls)),
            "cached_tokens": float(sum(c.cached_tokens for c in calls)),
            "restored_tokens": float(sum(c.restored_tokens for c in calls)),
            "engine_s": result.totals.busy_s if result.totals is not None else 0.0,
            **{key: float(counters.get(key, 0)) for key in COUNTER_GAUGES}}


def compare(live: ReplayResult, simulated: ReplayResult) -> dict[str, Any]:
    """The fidelity.json row of one policy: both sides' SCT percentiles and counts, and the
    live SCTs by session id (``told_apart`` pairs two policies' sessions)."""
    a, b = _side(live), _side(simulated)
    row: dict[str, Any] = {"live_p50_s": a["p50_s"], "sim_p50_s": b["p50_s"],
           "live_p95_s": a["p95_s"], "sim_p95_s": b["p95_s"],
           "p50_rel_err": b["p50_s"] / a["p50_s"] - 1.0, "p95_rel_err": b["p95_s"] / a["p95_s"] - 1.0}
    for key in ("calls", "failed_calls", "prompt_tokens", "output_tokens", "cached_tokens",
                "restored_tokens", "engine_s", *COUNTER_GAUGES):
        row[f"live_{key}"], row[f"sim_{key}"] = a[key], b[key]
    row["live_scts"] = [s.sct_s for s in sorted(live.sessions, key=lambda s: s.session_id)]
    return row


def ranking(rows: Mapping[str, Mapping[str, Any]], side: str, stat: str) -> list[str]:
    """Policies from fastest to slowest by ``{side}_{stat}_s`` (e.g. "live", "p50")."""
    return sorted(rows, key=lambda p: rows[p][f"{side}_{stat}_s"])


def told_apart(rows: Mapping[str, Mapping[str, Any]], stat: str) -> list[tuple[str, str]]:
    """The pairs (faster, slower) of policies whose live order at ``stat`` is more than the
    draw of sessions: the paired bootstrap 95% interval of slower / faster - 1 over the
    live sessions lies above 0. Two policies a replay of a few sessions cannot tell apart
    live (their order would flip with other sessions) have no order a simulation could get
    wrong. Rows without live SCTs (an older fidelity.json) are told apart by any gap."""
    order = ranking(rows, "live", stat)
    pairs = []
    for i, fast in enumerate(order):
        for slow in order[i + 1:]:
            a, b = rows[fast].get("live_scts"), rows[slow].get("live_scts")
            if a and b and len(a) == len(b) and paired_interval(a, b, stat)[0] <= 0:
                continue
            pairs.append((fast, slow))
    return pairs


def same_ranking(rows: Mapping[str, Mapping[str, Any]], stat: str) -> bool:
    """Whether the simulation orders every pair the live replay tells apart as it does."""
    return all(rows[fast][f"sim_{stat}_s"] < rows[slow][f"sim_{stat}_s"]
               for fast, slow in told_apart(rows, stat))


def format_replay_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    head = (f"{'policy':10s} {'live p50':>9s} {'sim p50':>8s} {'err':>6s} {'live p95':>9s} "
            f"{'sim p95':>8s} {'err':>6s}  {'calls live/sim':>14s} {'cached live/sim':>16s} "
            f"{'restored live/sim':>18s} {'demoted live/sim':>17s} {'lent live/sim':>13s}")
    lines = [head]
    for policy, r in rows.items():
        lines.append(
            f"{policy:10s} {r['live_p50_s']:9.1f} {r['sim_p50_s']:8.1f} {r['p50_rel_err']:+6.0%} "
            f"{r['live_p95_s']:9.1f} {r['sim_p95_s']:8.1f} {r['p95_rel_err']:+6.0%}  "
            f"{r['live_calls']:6.0f}/{r['sim_calls']:<7.0f} "
            f"{r['live_cached_tokens']:7.0f}/{r['sim_cached_tokens']:<8.0f} "
            f"{r['live_restored_tokens']:8.0f}/{r['sim_restored_tokens']:<9.0f} "
            f"{r['live_kv_demotions']:8.0f}/{r['sim_kv_demotions']:<8.0f} "
            f"{r['live_staging_lends']:6.0f}/{r['sim_staging_lends']:<6.0f}")
    for stat in ("p50", "p95"):
        live, sim = ranking(rows, "live", stat), ranking(rows, "sim", stat)
        same = "same" if same_ranking(rows, stat) else "DIFFERENT"
        lines.append(f"ranking by SCT {stat}: live {' < '.join(live)}; "
                     f"simulated {' < '.join(sim)} ({same})")
    lines.append(f"(load average now: {', '.join(f'{x:.2f}' for x in os.getloadavg())})")
    return "\n".join(lines)
