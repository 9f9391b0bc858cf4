"""Decode steps run in fixed-shape buckets and, on a GPU, replayed from CUDA graphs.

A decode step's host work (dispatching some 40 kernels a layer) is most of its time on a
GPU: on an H200 the eager step of a 1B model decoding 32 sequences took 14 ms while the GPU
was busy for 6 (docs/gpu.md). A CUDA graph replays the whole forward pass in one launch, as
vLLM and gpt-fast do. A graph needs every shape fixed, so a decode-only step of ``n``
sequences whose longest block table has ``b`` blocks runs padded to a bucket: ``n`` and
``b`` rounded up to the next size of ``bucket_size`` (every integer to 8, then four sizes per
doubling: at most 25% padding), through the runner's fixed-shape step
(``ModelRunner.prepare(out, FixedShape)``, ``forward_step``), whose one attention group reads
every sequence's padded context.

Padding costs device work where graphs save host work, so only small steps take a bucket:
at most ``max_padded_tokens`` context tokens (sequences x blocks x block size) padded. On the
H200 (2026-12-04, power-of-two buckets) every step measured at up to 16384 padded tokens ran
faster from a graph (a 1B model: 1 x 512 context 21.5 -> 4.1 ms, 8 x 512 23.6 -> 9.1 ms,
32 x 256 18.9 -> 12.5 ms) and every one at 65536 and beyond slower (64 x 512 29 -> 45 ms,
8 x 4096 27 -> 50 ms, 64 x 2048 72 -> 153 ms): the default is 16384. The finer buckets
came after that run and were not measured on a GPU.

Lifetimes: a bucket's first step captures its graph (after two warm-up runs on a side
stream, which write the same K/V into the same slots as the step itself); its inputs become
the graph's static inputs, and later steps copy theirs in (``StepInputs.copy_``). A graph
reads the weights and the KV cache at the addresses they had at capture: weights stay put
(the substrate's fixed regions, or the model's own parameters), and the runner drops every
graph when its KV cache is rebound (``clear``). At most ``max_graphs`` are kept (least
recently used first out); all share one memory pool, as only one replays at a time and its
logits are read before the next. Without CUDA (``capture`` False) the bucketed step runs
eagerly: the same inputs, padding and copies, which is how a CPU test checks this path.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import torch

from engine.attention.metadata import FixedShape
from engine.scheduler import SchedulerOutput

__all__ = ["DecodeGraphs", "StaticInputs", "bucket_size"]

WARMUP_RUNS = 2

log = structlog.get_logger(__name__)


class StaticInputs(Protocol):
    """A step's inputs (``engine.model_runner.StepInputs``) as a bucket keeps them."""

    num_samples: int

    def copy_(self, other: Any) -> None: ...


def bucket_size(n: int, limit: int) -> int:
    """The smallest bucket size >= ``n``, capped at ``limit`` (``n`` <= ``limit``): ``n``
    itself up to 8, then 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... (a quarter of the
    power of two below apart)."""
    if n <= 8:
        return min(limit, max(1, n))
    power = 1 << (n.bit_length() - 1)  # the power of two <= n
    step = power // 4
    return min(limit, -(-n // step) * step)


@dataclass
class _Bucket:
    inputs: StaticInputs  # the graph's static inputs
    logits: torch.Tensor | None  # its static output (None until captured, or eager)
    graph: Any = None  # torch.cuda.CUDAGraph


class DecodeGraphs:
    """A runner's decode buckets (see the module): ``bucket`` says whether a step takes
    one, ``run`` runs it there, ``clear`` drops them all."""

    def __init__(
        self,
        forward: Callable[[Any], torch.Tensor | None],
        max_seqs: int,
        max_blocks: int,
        *,
        capture: bool,
        block_size: int = 16,
        max_padded_tokens: int = 16384,
        max_graphs: int = 48,
    ) -> None:
        if min(max_seqs, max_blocks, block_size, max_padded_tokens, max_graphs) < 1:
            raise ValueError("need max_seqs, max_blocks, block_size, max_padded_tokens and "
                             f"max_graphs >= 1, got {max_seqs}, {max_blocks}, {block_size}, "
                             f"{max_padded_tokens}, {max_graphs}")
        self._forward = forward
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.max_padded_tokens = max_padded_tokens
        self.capture = capture
        self.max_graphs = max_graphs
        self._buckets: OrderedDict[FixedShape, _Bucket] = OrderedDict()
        self._pool: Any = None
        self.captured = 0  # graphs captured so far
        self.steps = 0  # steps run through a bucket

    def __len__(self) -> int:
        return len(self._buckets)

    def bucket(self, out: SchedulerOutput) -> FixedShape | None:
        """The bucket of a step this path takes (decode only, every sequence sampling,
        inside the largest bucket, at most ``max_padded_tokens`` padded); None otherwise."""
        scheduled = out.scheduled
        if not scheduled or len(scheduled) > self.max_seqs:
            return None
        if any(s.num_new_tokens != 1 or not s.samples for s in scheduled):
            return None
        longest = max(len(s.block_ids) for s in scheduled)
        if longest > self.max_blocks:
            return None
        shape = FixedShape(bucket_size(len(scheduled), self.max_seqs),
                           bucket_size(longest, self.max_blocks))
        if shape.num_seqs * shape.num_blocks * self.block_size > self.max_padded_tokens:
            return None
        return shape

    def run(self, shape: FixedShape, fresh: StaticInputs) -> torch.Tensor | None:
        """The step's logits (rows padded to the bucket; the first ``fresh.num_samples`` are
        real), from ``fresh``, the inputs ``prepare`` built for ``shape``."""
        self.steps += 1
        bucket = self._buckets.get(shape)
        if bucket is None:
            bucket = self._add(shape, fresh)
        else:
            bucket.inputs.copy_(fresh)
            self._buckets.move_to_end(shape)
        if bucket.graph is None:
            return self._forward(bucket.inputs)
        bucket.graph.replay()
        return bucket.logits

    def clear(self) -> None:
        """Drop every graph (the KV cache they read moved)."""
        self._buckets.clear()

    def _add(self, shape: FixedShape, fresh: StaticInputs) -> _Bucket:
        while len(self._buckets) >= self.max_graphs:
            self._buckets.popitem(last=False)
        bucket = _Bucket(fresh, None)
        if self.capture:
            try:
                bucket.graph, bucket.logits = self._capture(fresh)
                self.captured += 1
            except RuntimeError as exc:  # a step that cannot be captured: eager from now on
                log.warning("decode_graphs.capture_failed", shape=str(shape), error=str(exc))
                self.capture = False
        self._buckets[shape] = bucket
        return bucket

    def _capture(self, inputs: StaticInputs) -> tuple[Any, torch.Tensor | None]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._forward(inputs)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(inputs)
        return graph, logits
