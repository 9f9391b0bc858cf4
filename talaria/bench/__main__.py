"""`make bench`: every benchmark of the project, as ratios measured in one run.

Sections (each can be chosen with ``--only``):
- engine:     engine throughput vs transformers generate (one at a time / padded batch) on
              mixed prompt lengths, and the decode step's fraction of the memory bandwidth
- engine-real: the same on SmolLM2-135M-Instruct (the default catalog's real model, its GGUF
              dequantized to fp32 and given to both), with fewer requests
- tp:         TP=2 step time vs TP=1 with the time spent in collectives
- switch:     substrate copy rates (H2D, staging, D2D) vs a plain torch copy
- multimodel: live model switch from host / staging, KV restore vs recompute
- state:      the instance's state report per poll at 1k and 10k sessions: the router's parse
              and the instance's side, the whole table (every poll before it was sent as
              deltas; the first poll now) against a delta
- device-steps: on a GPU only, the engine's step times on a Llama-1B-shaped model against
              the simulator's h200x8 preset's prediction (``talaria.bench.device_steps``)
Models are the "small" tiny checkpoints (tens of millions of parameters), written on
first use into the cache directory, and (engine-real) SmolLM2-135M-Instruct. ``--device``
(default: a GPU when torch sees one) is where the engine, switch, multimodel and
device-steps sections run; on a GPU the engine section also runs the Llama-1B-shaped model
(a tiny model's step there is launch overhead, not bandwidth) in bfloat16.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from talaria.paths import cache_dir, ensure_tiny_models


def _section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def _on_gpu(args: argparse.Namespace) -> bool:
    return torch.device(args.device).type == "cuda"


def _engine_throughput(model_dir: Path, label: str, requests: int, args: argparse.Namespace) -> None:
    from talaria.bench.engine_throughput import bench_engine_throughput

    where = (f"{torch.cuda.get_device_name(args.device)}" if _on_gpu(args)
             else f"{torch.get_num_threads()} threads")
    _section(
        f"engine throughput: {requests} requests x {args.min_prompt_len}-"
        f"{args.max_prompt_len} prompt tokens (uniform), {args.output_len} output tokens, "
        f"{label}, {args.dtype}, greedy, {where}; engine and padded "
        "batch: best of 2 interleaved runs"
    )
    result = bench_engine_throughput(
        model_dir,
        requests,
        args.min_prompt_len,
        args.max_prompt_len,
        args.output_len,
        device=args.device,
        dtype=args.dtype,
    )
    engine = result.runs[-1]
    for r in result.runs:
        print(
            f"  {r.name:30s} {r.seconds:7.2f} s  {r.tokens_per_s:8.1f} tok/s  "
            f"engine speedup x{engine.tokens_per_s / r.tokens_per_s:5.2f}"
        )
    d = result.decode
    print(
        f"  decode steps: {d.steps}, {d.seconds / max(d.steps, 1) * 1e3:.1f} ms each, reading "
        f"{d.weight_bytes / 1e6:.0f} MB weights + {d.kv_bytes / max(d.steps, 1) / 1e6:.0f} MB KV "
        f"per step: {d.achieved_bytes_per_s / 1e9:.1f} GB/s = {d.fraction:.0%} of the "
        f"{d.copy_bytes_per_s / 1e9:.1f} GB/s {args.device} copy rate (read + write)"
    )


def bench_engine(models: dict[str, Path], args: argparse.Namespace) -> None:
    _engine_throughput(models["tiny-llama"], "small tiny-llama", args.requests, args)
    if _on_gpu(args):
        from talaria.bench.device_steps import write_llama_1b_shape

        _engine_throughput(write_llama_1b_shape(cache_dir() / "bench"), "Llama-1B-shaped",
                           args.requests, args)


def bench_engine_real(models: dict[str, Path], args: argparse.Namespace) -> None:
    """The same comparison on the real checkpoint (both sides on its dequantized weights)."""
    from talaria.real_model import ensure_real_model, missing_reason

    path = ensure_real_model()
    if path is None:
        _section(f"engine throughput on SmolLM2-135M-Instruct: skipped, {missing_reason()}")
        return
    _engine_throughput(path, "SmolLM2-135M-Instruct (Q4_1 dequantized)", args.real_requests,
                       args)


def bench_tp(models: dict[str, Path], args: argparse.Namespace) -> None:
    from talaria.bench.tensor_parallel import bench_tp as run

    _section("tensor parallelism: TP=2 (gloo, one thread per rank) vs TP=1 (two threads), small tiny-llama")
    r = run(models["tiny-llama"], steps=16, world_size=2, num_threads=2)
    print(
        f"  prefill: TP=1 {r['tp1_prefill_ms']:.1f} ms, TP=2 {r['tp2_prefill_ms']:.1f} ms; "
        f"decode step: TP=1 {r['tp1_decode_step_ms']:.1f} ms, TP=2 {r['tp2_decode_step_ms']:.1f} ms "
        f"(speedup x{r['decode_speedup']:.2f})"
    )
    for c in r["collectives"]:
        print(
            f"  rank {c['rank']}: {c['collectives_per_step']} collectives/step, "
            f"{c['collective_ms_per_step']:.1f} ms/step = {c['collective_ms_per_layer']:.2f} ms/layer "
            f"({c['collective_us_per_call']:.0f} us/call)"
        )


def bench_switch(models: dict[str, Path], args: argparse.Namespace) -> None:
    from talaria.bench.substrate import bench_switch as run

    nbytes = 128 * 2**20
    _section(f"substrate copies: {nbytes >> 20} MiB shard, best of 3")
    r = run(nbytes, args.device, repeats=3)
    for kind in ("activate_h2d", "stage", "activate_d2d", "plain_copy", "alloc_copy"):
        row = r[kind]
        ratio = f"  vs plain copy x{row['vs_plain_copy']:.2f}" if "vs_plain_copy" in row else ""
        print(f"  {kind:14s} {row['seconds'] * 1e3:8.1f} ms  {row['gb_per_s']:6.2f} GB/s{ratio}")


def bench_multimodel(models: dict[str, Path], args: argparse.Namespace) -> None:
    from talaria.bench.multi_model import bench_multi_model

    _section(
        "multi-model engine: switch small llama <-> small qwen3; KV restore vs recompute "
        "(4k and 16k prefixes, one thread)"
    )
    r = bench_multi_model(args.device, prefix_lens=(4096, 16384), repeats=3, threads=1)
    sw = r["switch"]
    print(
        f"  switch from host:    {sw['host_s'] * 1e3:7.1f} ms {sw['host_gb_per_s']:6.2f} GB/s "
        f"(vs plain copy x{sw['host_vs_plain']:.2f})"
    )
    print(
        f"  switch from staging: {sw['staged_s'] * 1e3:7.1f} ms {sw['staged_gb_per_s']:6.2f} GB/s "
        f"(vs plain copy x{sw['staged_vs_plain']:.2f})"
    )
    for row in r["restore"]:
        print(
            f"  {row['prefix_tokens']:6d}-token prefix: recompute {row['recompute_s']:7.2f} s, "
            f"restore {row['restore_s']:6.3f} s ({row['restore_gb_per_s']:.2f} GB/s): "
            f"restore/recompute = {row['restore_vs_recompute']:.4f}"
        )


def bench_state(models: dict[str, Path], args: argparse.Namespace) -> None:
    from talaria.bench.state_report import bench_state_report

    changed = 16
    _section(f"state report per instance and poll ({changed} sessions changed between polls, "
             "best of 5)")
    names = {"full": "whole table (every poll before)", "first": "whole table (first poll now)",
             "delta": f"delta ({changed} changed)"}
    print(f"  {'sessions':>8s}  {'report':32s} {'bytes':>10s} {'router parse':>13s} {'instance':>9s}")
    for r in bench_state_report(changed=changed):
        print(f"  {r.sessions:8d}  {names[r.kind]:32s} {r.bytes:10d} {r.parse_ms:10.2f} ms "
              f"{r.instance_ms:6.2f} ms")


def bench_device_steps(models: dict[str, Path], args: argparse.Namespace) -> None:
    from talaria.bench.device_steps import device_cases, run_device_steps, write_llama_1b_shape
    from talaria.bench.step_fidelity import format_table

    if not _on_gpu(args):
        _section("step times against the h200x8 preset: skipped, needs a GPU (--device cuda)")
        return
    _section(f"step times on {torch.cuda.get_device_name(args.device)} against the simulator's "
             f"h200x8 preset at TP=1: Llama-1B-shaped, {args.dtype}, median of 5 steps")
    cases = device_cases()
    results = run_device_steps(write_llama_1b_shape(cache_dir() / "bench"), cases,
                               device=args.device, dtype=args.dtype)
    print(format_table(results, worst=len(results)))


SECTIONS: dict[str, Callable[[dict[str, Path], argparse.Namespace], None]] = {
    "engine": bench_engine,
    "engine-real": bench_engine_real,
    "tp": bench_tp,
    "switch": bench_switch,
    "multimodel": bench_multimodel,
    "state": bench_state,
    "device-steps": bench_device_steps,
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m talaria.bench", description=__doc__)
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--real-requests", type=int, default=8,
                        help="requests of the engine-real section (SmolLM2-135M)")
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=448)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's, one per core)"
    )
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: cuda when torch sees a GPU)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="the engine sections' dtype (default: float32 on the CPU, "
                        "bfloat16 on a GPU)")
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no GPU here")
    if args.dtype is None:
        args.dtype = "bfloat16" if _on_gpu(args) else "float32"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print("preparing the small tiny models (written once into the cache)...", flush=True)
    models = ensure_tiny_models("small")
    start = time.perf_counter()
    for name in args.only or list(SECTIONS):
        SECTIONS[name](models, args)
    print(f"\nbench done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
