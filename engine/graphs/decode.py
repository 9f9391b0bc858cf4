"""Decode steps run in fixed-shape buckets and, on a GPU, replayed from CUDA graphs.

A decode step's host work (dispatching some 40 kernels a layer) is most of its time on a
GPU: on an H200 the eager step of a 1B model decoding 32 sequences took 14 ms while the GPU
was busy for 6 (docs/gpu.md). A CUDA graph replays the whole forward pass in one launch, as
vLLM and gpt-fast do. A graph needs every shape fixed, so a decode-only step of ``n``
sequences whose longest block table has ``b`` blocks runs padded to a bucket: the next power
of two of ``n`` (at most ``max_seqs``) and of ``b`` (at most ``max_blocks``), through the
runner's fixed-shape step (``ModelRunner.prepare(out, FixedShape)``, ``forward_step``).

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


class StaticInputs(Protocol):
    """A step's inputs (``engine.model_runner.StepInputs``) as a bucket keeps them."""

    num_samples: int

    def copy_(self, other: Any) -> None: ...

WARMUP_RUNS = 2

log = structlog.get_logger(__name__)


def bucket_size(n: int, limit: int) -> int:
    """The smallest power of two >= ``n``, capped at ``limit`` (``n`` <= ``limit``)."""
    return min(limit, 1 << max(0, n - 1).bit_length())


@dataclass
class _Bucket:
    inputs: StaticInputs  # the graph's static inputs
    logits: torch.Tensor | None  # its static output (None until captured, or eager)
    graph: Any = None  # torch.cuda.CUDAGraph


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[Any], torch.Tensor | None],
        max_seqs: int,
        max_blocks: int,
        *,
        capture: bool,
        max_graphs: int = 48,
    ) -> None:
        if max_seqs < 1 or max_blocks < 1 or max_graphs < 1:
            raise ValueError(f"need max_seqs, max_blocks and max_graphs >= 1, got {max_seqs}, "
                             f"{max_blocks}, {max_graphs}")
        self._forward = forward
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks
        self.capture = capture
        self.max_graphs = max_graphs
        self._buckets: OrderedDict[FixedShape, _Bucket] = OrderedDict()
        self._pool: Any = None
        self.captured = 0  # graphs captured so far
        self.steps = 0  # steps run through a bucket

    def __len__(self) -> int:
        return len(self._buckets)

    def bucket(self, out: SchedulerOutput) -> FixedShape | None:
        """The bucket of a step this path can run (decode only, every sequence sampling,
        inside the largest bucket); None for any other step."""
        scheduled = out.scheduled
        if not scheduled or len(scheduled) > self.max_seqs:
            return None
        if any(s.num_new_tokens != 1 or not s.samples for s in scheduled):
            return None
        longest = max(len(s.block_ids) for s in scheduled)
        if longest > self.max_blocks:
            return None
        return FixedShape(bucket_size(len(scheduled), self.max_seqs),
                          bucket_size(longest, self.max_blocks))

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
