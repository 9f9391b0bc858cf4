"""Micro-benchmarks behind ``talaria calibrate``: the rates of this machine's kernels and
copies at the shapes the tiny models use (see ``talaria.bench.calibrate``).

Each figure is the median of a few repeats on the clock the caller passes
(``talaria.bench.timing``: the calling thread's CPU time when it runs one torch thread, so
that other processes on a shared machine do not count); the gloo all-reduce between two
processes is timed on the wall clock, its fastest run.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from substrate.host_kv import HostKVStore
from substrate.mover import TorchMover
from talaria.bench.timing import WALL, Clock, median_seconds

__all__ = ["LayerShapes", "matmul_flops", "weight_stream", "attention_rates", "kv_copy_rates",
           "weight_copy_rates", "allreduce_costs"]


@dataclass(frozen=True)
class LayerShapes:
    """A decoder layer's weight matrices ``(out, in)``: QKV, output, gate-up and down."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def matrices(self) -> tuple[tuple[int, int], ...]:
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        h, i = self.hidden, self.intermediate
        return ((qkv, h), (h, self.heads * self.head_dim), (2 * i, h), (h, i))

    @property
    def params(self) -> int:
        return sum(o * i for o, i in self.matrices)


def _layers(shapes: LayerShapes, num_layers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(o, i, generator=g) for _ in range(num_layers) for o, i in shapes.matrices]


def _run_layers(weights: list[torch.Tensor], rows: int) -> Callable[[], None]:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def run() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    return run


def matmul_flops(shapes: LayerShapes, rows: int = 512, clock: Clock = WALL) -> float:
    """FLOP/s of one layer's products at ``rows`` tokens, weights resident in cache."""
    weights = _layers(shapes, 1)
    return 2.0 * rows * shapes.params / median_seconds(_run_layers(weights, rows), clock=clock)


@dataclass(frozen=True)
class StreamResult:
    bytes_per_s: float  # weights streamed from memory by one-row products
    seconds_by_rows: dict[int, float]  # the same layers at more rows
    flops: int  # per row
    bytes: int


def weight_stream(
    shapes: LayerShapes, total_bytes: int, rows: tuple[int, ...] = (1, 16), clock: Clock = WALL
) -> StreamResult:
    """Distinct layers of ``total_bytes`` of weights (far more than the caches hold), run
    as a decode step runs them: the bandwidth of one-row products, and the time at more rows
    (the calibration fits how compute and memory overlap from it)."""
    per_layer = shapes.params * 4
    weights = _layers(shapes, max(1, total_bytes // per_layer))
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    seconds = {r: median_seconds(_run_layers(weights, r), 3, clock) for r in rows}
    return StreamResult(nbytes / seconds[rows[0]], seconds, 2 * nbytes // 4, nbytes)


@dataclass(frozen=True)
class AttentionRates:
    flops: float  # QK^T + PV FLOPs per second
    scores_per_s: float | None  # prefill (query, key, head) scores per second of softmax work
    decode_scores_per_s: float | None  # the same for decodes
    kv_read_bytes_per_s: float  # decode: K and V read per second, contexts past the caches


def _linear_fit(x: tuple[float, float], y: tuple[float, float]) -> tuple[float, float]:
    """(intercept, slope) of the line through two points."""
    slope = (y[1] - y[0]) / (x[1] - x[0])
    return y[0] - slope * x[0], slope


def _prefill_seconds_per_score(shape: LayerShapes, length: int, clock: Clock) -> float:
    q = torch.randn(1, shape.heads, length, shape.head_dim)
    k = torch.randn(1, shape.kv_heads, length, shape.head_dim)
    v = torch.randn_like(k)
    t = median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=True), 5, clock)
    return t / (shape.heads * length * (length + 1) / 2)


def _decode_seconds_per_score(shape: LayerShapes, seqs: int, context: int,
                              clock: Clock) -> float:
    q = torch.randn(seqs, shape.heads, 1, shape.head_dim)
    k = torch.randn(seqs, shape.kv_heads, context, shape.head_dim)
    v = torch.randn_like(k)
    mask = torch.zeros(seqs, 1, 1, context)
    t = median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                               enable_gqa=True), 3, clock)
    return t / (seqs * shape.heads * context)


def _kv_bytes_per_score(shape: LayerShapes) -> float:
    """K and V bytes (fp32) a decode reads per (query, key, head) score."""
    return 2 * shape.head_dim * 4 * shape.kv_heads / shape.heads


def attention_rates(small: LayerShapes, tiny: LayerShapes, length: int = 2048,
                    decode_seqs: int = 32, decode_context: int = 4096,
                    clock: Clock = WALL) -> AttentionRates:
    """Attention as the engine runs it (``scaled_dot_product_attention``), at two head sizes.
    Causal prefill over ``length`` tokens costs ``a + 4 * head_dim / flops`` per score: the
    slope gives the products' FLOP rate, ``a`` the softmax work. Decode attention (one query
    per sequence, a mask over its context) over ``decode_seqs`` contexts too large for the
    caches costs, beyond its products, ``a' + kv_bytes_per_score / kv_rate``: the line
    through the two sizes gives the rate KV is read at and the per-score work ``a'``. A
    term that noise pushes below zero is left out (its share goes to the other one)."""
    per_tiny = _prefill_seconds_per_score(tiny, length, clock)
    per_small = _prefill_seconds_per_score(small, length, clock)
    fixed, slope = _linear_fit((4.0 * tiny.head_dim, 4.0 * small.head_dim), (per_tiny, per_small))
    if slope <= 0 or fixed <= 0:
        fixed, slope = 0.0, per_small / (4.0 * small.head_dim)
    rest = [_decode_seconds_per_score(s, decode_seqs, decode_context, clock)
            - 4.0 * s.head_dim * slope for s in (tiny, small)]
    per_score, per_byte = _linear_fit((_kv_bytes_per_score(tiny), _kv_bytes_per_score(small)),
                                      (rest[0], rest[1]))
    if per_byte <= 0 or per_score <= 0:
        per_score, per_byte = 0.0, max(rest[1], 1e-15) / _kv_bytes_per_score(small)
    return AttentionRates(1.0 / slope, 1.0 / fixed if fixed > 0 else None,
                          1.0 / per_score if per_score > 0 else None, 1.0 / per_byte)


def kv_copy_rates(num_layers: int, kv_heads: int, head_dim: int, block_size: int = 16,
                  num_blocks: int = 512, clock: Clock = WALL) -> tuple[float, float]:
    """(offload, restore) bytes per second of ``num_blocks`` KV blocks of this shape through
    the live host KV store, restored as the engine restores (layer group by layer group;
    device and host are both this machine's memory on a CPU): the median of three runs
    after a warm-up, each into a fresh store."""
    kv = torch.randn(num_layers, 2, 2 * num_blocks, block_size, kv_heads, head_dim)
    hashes = list(range(1, num_blocks + 1))
    ids = list(range(0, 2 * num_blocks, 2))
    offload: list[float] = []
    restore: list[float] = []
    nbytes = 0
    for r in range(4):
        store = HostKVStore(1 << 40, pin=False)
        start = clock.read()
        saved = store.save("m", hashes, ids, kv)
        saved_at = clock.read()
        store.load("m", hashes, [i + 1 for i in ids], kv)
        loaded_at = clock.read()
        nbytes = saved.bytes
        if r:  # the first run is a warm-up
            offload.append(saved_at - start)
            restore.append(loaded_at - saved_at)
    return nbytes / statistics.median(offload), nbytes / statistics.median(restore)


def weight_copy_rates(nbytes: int, clock: Clock = WALL, repeats: int = 3) -> dict[str, float]:
    """Bytes per second of a weight shard of ``nbytes`` copied into the weight region by
    the substrate's mover: from the host weight store (``activate_h2d``) and from the
    staging region (``activate_d2d``); on a CPU both are this machine's memory."""
    device = torch.device("cpu")
    weights = torch.empty(nbytes, dtype=torch.uint8, device=device)
    staging = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    host = torch.full((nbytes,), 7, dtype=torch.uint8)
    mover = TorchMover(device)
    runs = {"activate_h2d": lambda: mover.activate_from_host(weights, host, nbytes),
            "activate_d2d": lambda: mover.activate_from_staging(weights, staging, nbytes)}
    return {kind: nbytes / median_seconds(run, repeats, clock) for kind, run in runs.items()}


def _allreduce_worker(rank: int, port: int, sizes: list[int], repeats: int,
                      out: dict[int, float]) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for n in sizes:
            x = torch.ones(n // 4)
            best = float("inf")
            for r in range(repeats + 2):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(x)
                if r >= 2:
                    best = min(best, time.perf_counter() - start)
            if rank == 0:
                out[n] = best
    finally:
        dist.destroy_process_group()


def allreduce_costs(sizes: tuple[int, ...] = (256, 4096, 1 << 20, 4 << 20),
                    repeats: int = 20) -> tuple[float, float]:
    """(latency s, bus bytes/s) of a gloo all-reduce between two single-thread processes:
    the smallest message's time, and the slope of the largest two (a two-rank ring moves
    the message's size once per rank)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.get_context("spawn").Manager() as manager:
        out = manager.dict()
        mp.start_processes(_allreduce_worker, args=(port, list(sizes), repeats, out), nprocs=2,
                           start_method="spawn")
        times = dict(out)
    a, b = sizes[-2], sizes[-1]
    slope = (times[b] - times[a]) / (b - a)
    bandwidth = 1.0 / slope if slope > 0 else b / times[b]
    return times[sizes[0]], bandwidth
