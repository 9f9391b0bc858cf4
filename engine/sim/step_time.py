"""Pricing runs of decode steps in closed form (the simulated engine's hot path), and how
many decode steps one simulated step may fuse."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.sim.cost_model import CostModel


@dataclass(frozen=True)
class DecodeLine:
    """A decode step of ``num_seqs`` sequences as a function of their summed context C.

    The cost model's compute and memory times of such a step are each affine in C (attention
    pairs and KV bytes read grow linearly; weights, LM head, all-reduces and overhead do
    not, but for the host's per-context-token overhead), so two evaluations give the lines
    exactly and any run of consecutive decode steps is priced without calling the cost model
    again. A step costs ``overlap * max(c, m) + (1 - overlap) * (c + m)``
    (``engine.sim.cost_model.combine``) plus the all-reduces and overhead.
    """

    num_seqs: int
    compute0: float
    compute_per_token: float
    memory0: float
    memory_per_token: float
    fixed: float  # all-reduces + overhead, at C = 0
    overlap: float = 1.0
    fixed_per_token: float = 0.0  # the overhead's growth with C

    _PROBE = 1 << 20  # context tokens at the second evaluation

    @classmethod
    def of(cls, cost: CostModel, num_seqs: int) -> DecodeLine:
        a = cost.step_cost([], num_seqs, 0)
        b = cost.step_cost([], num_seqs, cls._PROBE)
        return cls(
            num_seqs,
            a.compute_s,
            (b.compute_s - a.compute_s) / cls._PROBE,
            a.memory_s,
            (b.memory_s - a.memory_s) / cls._PROBE,
            a.allreduce_s + a.overhead_s,
            a.overlap,
            (b.overhead_s - a.overhead_s) / cls._PROBE,
        )

    def seconds(self, context: int, num_steps: int = 1) -> float:
        """``num_steps`` consecutive decode steps, the first over ``context`` tokens, each
        next one over ``num_seqs`` more: the sum of max(compute, memory), split exactly at
        the one step where the two lines may cross (and of compute + memory, as far as they
        do not overlap)."""
        n = num_steps
        if n < 1:
            return 0.0
        grow = self.num_seqs
        c0, dc = self.compute0 + self.compute_per_token * context, self.compute_per_token * grow
        m0, dm = self.memory0 + self.memory_per_token * context, self.memory_per_token * grow
        diff0, ddiff = c0 - m0, dc - dm
        if ddiff == 0.0:  # parallel: one line is the maximum throughout
            cross, compute_first = (n if diff0 >= 0 else 0), True
        else:
            cross = min(n, max(0, math.ceil(-diff0 / ddiff)))
            compute_first = ddiff < 0  # compute is the larger before the crossing
        first, then = ((c0, dc), (m0, dm)) if compute_first else ((m0, dm), (c0, dc))
        larger = _affine_sum(*first, 0, cross) + _affine_sum(*then, cross, n)
        both = _affine_sum(c0 + m0, dc + dm, 0, n)
        fixed = _affine_sum(self.fixed + self.fixed_per_token * context,
                            self.fixed_per_token * grow, 0, n)
        return self.overlap * larger + (1.0 - self.overlap) * both + fixed


def _affine_sum(a: float, d: float, lo: int, hi: int) -> float:
    """Sum of ``a + d * j`` for j in [lo, hi)."""
    k = hi - lo
    return k * a + d * (lo + hi - 1) * k / 2.0 if k > 0 else 0.0


def split_scheduled(out: SchedulerOutput) -> tuple[list[tuple[int, int]], list[ScheduledRequest]]:
    """A step's work as the cost model prices it: prefill chunks as ``(new_tokens,
    cached_context)`` and the decodes (one new token of a request that has output)."""
    chunks: list[tuple[int, int]] = []
    decodes: list[ScheduledRequest] = []
    for s in out.scheduled:
        if s.samples and s.num_new_tokens == 1 and s.request.num_output_tokens > 0:
            decodes.append(s)
        else:
            chunks.append((s.num_new_tokens, s.num_computed_tokens))
    return chunks, decodes


def fusable_steps(
    scheduler: Scheduler, kv: KVCacheManager, out: SchedulerOutput,
    decodes: list[ScheduledRequest], max_fused: int, tokens_left: Callable[[Request], int],
    finish_alone: bool = False,
) -> int:
    """How many decode steps a decode-only step may stand for (>= 1): at most ``max_fused``,
    stopping at the step where the first request ends (``tokens_left``: the output tokens a
    request may still sample); with ``finish_alone`` one step before it, so that a fused run
    can be cut short without undoing a finish (``engine.sim.fused``). Extra KV blocks for
    the fused tokens are allocated here; fusion shrinks until they fit."""
    limit = max_fused
    if limit == 1 or out.preempted_ids or len(decodes) != scheduler.num_running:
        return 1
    last = 1 if finish_alone else 0  # the step that samples a request's last token
    for s in decodes:
        limit = min(limit, tokens_left(s.request) - last)
    if limit <= 1:
        return 1
    bs = kv.block_size
    free = kv.num_free_blocks
    while limit > 1:
        need = sum(
            max(0, -(-(s.num_computed_tokens + limit) // bs) - len(s.block_ids)) for s in decodes
        )
        if need <= free:
            break
        limit -= 1
    if limit > 1:
        for s in decodes:
            allocated = kv.allocate_slots(s.request, limit)
            assert allocated, "free blocks were counted before allocating"
    return limit
