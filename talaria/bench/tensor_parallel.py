"""TP=N against TP=1 step times on this machine, with the time spent in collectives.

``bench_tp`` runs the same batch (prefill, then decode steps) at TP=1 and TP=N and times
each step. For the TP=N run it turns on every rank's collective timer
(``ParallelContext.timer``) for the run, so the per-layer cost of the collectives is visible:
on rank 0 a collective's time includes waiting for the slowest rank. Print-free: the caller
formats the dict.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.interface import EngineRequest
from engine.parallel.worker import RankContext
from engine.sampling_params import SamplingParams


def start_collective_timers(ctx: RankContext) -> None:
    """Time this rank's collectives from now on (``ParallelContext.timer``)."""
    ctx.parallel.timer.enabled = True
    ctx.parallel.timer.read(reset=True)


def read_collective_timers(ctx: RankContext, reset: bool = False) -> dict[str, list[float]]:
    """{collective: [calls, seconds]} since they were started (or the last reset)."""
    return ctx.parallel.timer.read(reset)


def stop_collective_timers(ctx: RankContext) -> None:
    ctx.parallel.timer.enabled = False
    ctx.parallel.timer.read(reset=True)


def set_num_threads(ctx: RankContext, n: int) -> None:
    torch.set_num_threads(n)


def _run(
    model_dir: Path, world_size: int, steps: int, batch: int, prompt_len: int, threads: int
) -> dict[str, Any]:
    block = 16
    max_len = prompt_len + steps + 8
    config = EngineConfig(
        model=model_dir,
        dtype="float32",
        device="cpu",
        max_model_len=max_len,
        block_size=block,
        num_kv_blocks=batch * (-(-max_len // block)) + 4,
        max_num_batched_tokens=batch * prompt_len,
        max_num_seqs=batch,
        enable_prefix_caching=False,
        tensor_parallel_size=world_size,
    )
    saved = torch.get_num_threads()
    per_rank = max(1, threads // world_size)
    torch.set_num_threads(per_rank)
    core = EngineCore(config)
    group = getattr(core.runner, "group", None)
    try:
        if group is not None:
            group.run_on_all_ranks(set_num_threads, per_rank)
            group.run_on_all_ranks(start_collective_timers)
        params = SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        vocab = core.vocab_size
        for i in range(batch):
            prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
            core.add_request(EngineRequest(f"bench-{i}", prompt, params))
        start = time.perf_counter()
        first = core.step()
        prefill_s = time.perf_counter() - start
        if first.num_prefill_tokens != batch * prompt_len:
            raise RuntimeError("the prefill did not fit one step")
        for _ in range(2):
            core.step()
        if group is not None:
            group.run_on_all_ranks(read_collective_timers, True)
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        decode_s = time.perf_counter() - start
        timers = group.run_on_all_ranks(read_collective_timers) if group is not None else []
        num_layers = int(core.runner.hf_config.num_hidden_layers)
    finally:
        if group is not None and group.is_alive:
            group.run_on_all_ranks(stop_collective_timers)
        core.shutdown()
        torch.set_num_threads(saved)
    return {
        "prefill_ms": prefill_s * 1e3,
        "decode_step_ms": decode_s / steps * 1e3,
        "timers": timers,
        "num_layers": num_layers,
    }


def bench_tp(
    model_dir: str | Path,
    steps: int = 32,
    *,
    world_size: int = 2,
    batch: int = 4,
    prompt_len: int = 64,
    num_threads: int | None = None,
) -> dict[str, Any]:
    """Step times of ``model_dir`` at TP=1 and TP=``world_size`` (CPU, gloo, fp32): one
    prefill of ``batch`` prompts of ``prompt_len`` tokens, then ``steps`` timed decode steps
    (after 2 untimed ones). Both runs get the same ``num_threads`` (default: torch's
    current count): TP=1 uses them all, each TP rank ``num_threads // world_size`` (at
    least 1). Collective times are per decode step, per rank."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    threads = num_threads if num_threads is not None else torch.get_num_threads()
    if threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {threads}")
    path = Path(model_dir)
    one = _run(path, 1, steps, batch, prompt_len, threads)
    many = _run(path, world_size, steps, batch, prompt_len, threads)
    layers = many["num_layers"]
    per_rank = []
    for rank, t in enumerate(many["timers"]):
        calls = sum(v[0] for v in t.values()) / steps
        secs = sum(v[1] for v in t.values()) / steps
        per_rank.append(
            {
                "rank": rank,
                "collectives_per_step": calls,
                "collective_ms_per_step": secs * 1e3,
                "collective_ms_per_layer": secs * 1e3 / layers,
                "collective_us_per_call": secs * 1e6 / calls if calls else 0.0,
                "by_kind_ms_per_step": {k: v[1] * 1e3 / steps for k, v in t.items()},
            }
        )
    tp1, tpn = one["decode_step_ms"], many["decode_step_ms"]
    return {
        "model": str(path),
        "world_size": world_size,
        "batch": batch,
        "prompt_len": prompt_len,
        "steps": steps,
        "num_threads": threads,
        "threads_per_rank": max(1, threads // world_size),
        "num_layers": layers,
        "tp1_prefill_ms": one["prefill_ms"],
        f"tp{world_size}_prefill_ms": many["prefill_ms"],
        "tp1_decode_step_ms": tp1,
        f"tp{world_size}_decode_step_ms": tpn,
        "decode_speedup": tp1 / tpn if tpn > 0 else 0.0,
        "collectives": per_rank,
    }
