"""``talaria calibrate``: this machine as a server spec the simulator loads (``--server
path.json``), so that the cost model that prices an H200 can be checked against the live
engine here (``talaria fidelity``).

The devices are the CPU cores, one per tensor-parallel rank, and every rank runs ``threads``
torch threads (1 by default: each rank has its own core, as a GPU rank has its own GPU, and
one thread per rank is what the engine's worker ranks get on a 2-core machine anyway; a
shared machine also stalls single-thread kernels far less than two-thread ones). Measured, a
few constants and nothing per data point (``talaria.bench.calibrate_kernels``):
- the matrix-product FLOP rate at the small tiny models' layer shapes (weights in cache);
- memory bandwidth: those layers' weights, far beyond the caches, streamed by one-row
  products (a decode step), and at 16 rows how much compute and memory overlap;
- attention: the FLOP and softmax rates of prefill attention at the tiny and small head
  sizes, and the rate decode attention reads KV at;
- the substrate's copies: a weight shard host -> weight region and staging -> weight region,
  KV blocks of the served catalog's shape offloaded to and restored from the host KV store;
- gloo all-reduce latency and bandwidth between two single-thread processes;
- the live engine's host overheads (``talaria.bench.calibrate_overheads``): steps of
  checkpoints of 1 and 4 layers at both tiny widths, less what the cost model with the
  rates above predicts for them, fitted term by term (per step, layer, MoE layer, sampled
  sequence, layer and hidden unit, token-layer-unit of element-wise work, decoding sequence
  and layer; per TP step, and the all-reduce latency inside a TP step).
Everything in-process is timed on the clock of ``talaria.bench.timing`` (this thread's CPU
time at one thread per rank), the median of a few runs. The spec records the conditions it
was measured under (``talaria.bench.calibration_conditions``), so that a spec measured under
others is not reused. The GPU presets are untouched: a CPU says nothing about an H200's
constants.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.layers.moe import DENSE_MAX_TOKENS
from engine.sim.model_spec import ModelSpec
from substrate.devices import DeviceSpec, ServerSpec, server_to_dict
from talaria.arg_types import check_output_path
from talaria.bench import calibrate_kernels as k
from talaria.bench.calibrate_overheads import fit_engine
from talaria.bench.calibration_conditions import current_conditions
from talaria.bench.timing import clock_for

__all__ = ["calibrate", "calibration_dict"]

STREAM_BYTES = 128 << 20  # four times a 32 MiB last-level cache


def _shapes(spec: ModelSpec) -> k.LayerShapes:
    return k.LayerShapes(spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads,
                         spec.head_dim, spec.dense_intermediate_size)


def _total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def calibrate(
    catalog: dict[str, Path],
    shape_models: tuple[Path, Path],
    *,
    threads: int = 1,
    log: Callable[[str], None] = print,
) -> tuple[ServerSpec, dict[str, Any]]:
    """Measure this machine. ``catalog``: the models the fidelity replay serves (weight and
    KV copies are timed at their sizes); ``shape_models``: a small and a tiny checkpoint
    whose layer shapes the kernels are timed at. Returns the spec and how it was measured."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    clock = clock_for(threads)
    conditions = current_conditions(threads, clock.name)
    start = time.perf_counter()
    try:
        small, tiny = (ModelSpec.from_hf_config(p) for p in shape_models)
        specs = [ModelSpec.from_hf_config(p, name) for name, p in catalog.items()]
        flops = k.matmul_flops(_shapes(small), clock=clock)
        stream = k.weight_stream(_shapes(small), STREAM_BYTES, clock=clock)
        overlap = _overlap(stream, flops)
        log(f"  matmul {flops / 1e9:.1f} GFLOP/s, weights streamed at "
            f"{stream.bytes_per_s / 1e9:.2f} GB/s, overlap {overlap:.2f}")
        attn = k.attention_rates(_shapes(small), _shapes(tiny), clock=clock)
        def rate(r: float | None) -> str:
            return f"{r / 1e9:.2f} G scores/s" if r else "none"

        log(f"  attention {attn.flops / 1e9:.1f} GFLOP/s; beyond it, prefill "
            f"{rate(attn.scores_per_s)}, decode {rate(attn.decode_scores_per_s)}; decode reads "
            f"KV at {attn.kv_read_bytes_per_s / 1e9:.2f} GB/s")
        shard = max(16 << 20, max(s.weight_bytes for s in specs))
        copies = k.weight_copy_rates(shard, clock)
        biggest = max(specs, key=lambda s: s.kv_bytes_per_token)
        offload, restore = k.kv_copy_rates(biggest.num_layers, biggest.num_kv_heads,
                                           biggest.head_dim, clock=clock)
        log(f"  copies: host->weights {copies['activate_h2d'] / 1e9:.2f} GB/s, staging->weights "
            f"{copies['activate_d2d'] / 1e9:.2f} GB/s, KV offload {offload / 1e9:.2f} GB/s, "
            f"restore {restore / 1e9:.2f} GB/s")
        latency, bus = k.allreduce_costs()
        log(f"  gloo all-reduce: {latency * 1e6:.0f} us + bytes at {bus / 1e9:.2f} GB/s")
        memory = _total_memory_bytes()
        cores = os.cpu_count() or 1
        device = DeviceSpec(
            name=f"cpu core ({platform.processor() or platform.machine()}), {threads} thread(s)",
            hbm_bytes=memory // cores, hbm_bytes_per_s=stream.bytes_per_s, bf16_flops=flops,
            nvlink_bytes_per_s=bus, host_link_bytes_per_s=copies["activate_h2d"],
            d2d_bytes_per_s=copies["activate_d2d"], attention_flops=attn.flops,
            attention_scores_per_s=attn.scores_per_s, decode_scores_per_s=attn.decode_scores_per_s,
            kv_read_bytes_per_s=attn.kv_read_bytes_per_s, kv_offload_bytes_per_s=offload,
            kv_restore_bytes_per_s=restore, copies_overlap_compute=False,
        )
        efficiency = {"compute": 1.0, "memory": 1.0, "nvlink": 1.0, "memory_reserve_fraction": 0.0,
                      "allreduce_latency_s": latency, "overlap": overlap,
                      "moe_dense_max_tokens": float(DENSE_MAX_TOKENS), "step_overhead_s": 0.0}
        server = ServerSpec(f"cpu-{platform.node() or 'local'}", device, num_devices=cores,
                            host_memory_bytes=memory,
                            efficiency=tuple(sorted(efficiency.items())))
        server, fit = fit_engine(server, log)
    finally:
        torch.set_num_threads(saved)
    info = {"threads_per_rank": threads, "seconds": round(time.perf_counter() - start, 1),
            "conditions": conditions.to_dict(), "load_average_after": list(os.getloadavg()),
            "engine_fit": fit,
            "catalog": {n: str(p) for n, p in catalog.items()}}
    return server, info


def calibration_dict(server: ServerSpec, info: dict[str, Any]) -> dict[str, Any]:
    """The spec as JSON, with how it was measured under ``calibration``."""
    return {**server_to_dict(server), "calibration": info}


def _overlap(stream: k.StreamResult, flops: float) -> float:
    """The share of the smaller of compute and memory hidden by the larger, from the 16-row
    products over streamed weights: 1 when they cost the larger of the two, 0 the sum."""
    memory_s = stream.seconds_by_rows[1]
    compute_s = 16 * stream.flops / flops
    measured = stream.seconds_by_rows[16]
    if min(compute_s, memory_s) <= 0:
        return 1.0
    unhidden = (measured - max(compute_s, memory_s)) / min(compute_s, memory_s)
    return min(1.0, max(0.0, 1.0 - unhidden))


def calibrate_here(
    threads: int = 1, log: Callable[[str], None] = print
) -> tuple[ServerSpec, dict[str, Any]]:
    """:func:`calibrate` on the small tiny catalog (what ``talaria fidelity`` replays),
    kernels at its layer shapes and the tiny catalog's."""
    from talaria.paths import ensure_tiny_models

    small, tiny = ensure_tiny_models("small"), ensure_tiny_models("tiny")
    return calibrate(small, (small["tiny-llama"], tiny["tiny-llama"]), threads=threads, log=log)


def write_spec(server: ServerSpec, info: dict[str, Any], path: str | Path) -> None:
    import orjson

    Path(path).write_bytes(orjson.dumps(calibration_dict(server, info), option=orjson.OPT_INDENT_2))


def run_calibrate_command(out: str, threads: int) -> int:
    """``talaria calibrate``: measure, print, write the spec to ``out``. The arguments are
    checked first: nothing is measured or written (the tiny models included) for bad ones."""
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    check_output_path(out)
    print(f"calibrating this machine at {threads} thread(s) per rank "
          f"(load average {', '.join(f'{x:.2f}' for x in os.getloadavg())})...", flush=True)
    server, info = calibrate_here(threads, log=lambda line: print(line, flush=True))
    write_spec(server, info, out)
    print(f"wrote {out} ({info['seconds']:.0f} s); use it with --server {out}")
    return 0
