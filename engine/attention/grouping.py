"""Which sequences of a step the torch backend attends together (host side, once per step).

A group is attended in one batched call, every member padded to the group's widest query
and context, so a group of similar sequences wastes little work on padding while every extra
group costs one more gather and attention call per layer. Decodes and prefill chunks are
grouped apart. Within each kind, sequences are sorted by context length (longest first) and
cut into equal-count groups; the number of groups minimises an estimate in units of "one
context token gathered": a padded (query, key) pair costs ``1 / QUERIES_PER_KEY`` of that,
an extra group ``GROUP_COST_KEYS``. The constants fit a CPU, where gathering a key's K and V
costs about as much as attending eight queries to it and a batched call's fixed cost is about
that of gathering a few hundred keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

QUERIES_PER_KEY = 8
GROUP_COST_KEYS = 256
MAX_GROUPS = 8


@dataclass(frozen=True)
class GroupPlan:
    """Members (indices into the step's sequences) and the group's padded widths."""

    seqs: tuple[int, ...]
    query_width: int
    num_blocks: int


def plan_groups(
    query_lens: Sequence[int], seq_lens: Sequence[int], block_size: int
) -> list[GroupPlan]:
    """Groups covering every sequence once: decodes (one new token) first, then prefills."""
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    prefills = [i for i, q in enumerate(query_lens) if q != 1]
    return split_groups(decodes, query_lens, seq_lens, block_size) + split_groups(
        prefills, query_lens, seq_lens, block_size
    )


def split_groups(
    seqs: list[int], query_lens: Sequence[int], seq_lens: Sequence[int], block_size: int
) -> list[GroupPlan]:
    """Groups of ``seqs`` (indices of one kind), sorted by context length."""
    if not seqs:
        return []
    order = sorted(seqs, key=lambda i: seq_lens[i], reverse=True)
    n = len(order)
    best: tuple[float, list[GroupPlan]] | None = None
    for count in range(1, min(n, MAX_GROUPS) + 1):
        bounds = [n * j // count for j in range(count + 1)]
        cost = float(count * GROUP_COST_KEYS)
        plans: list[GroupPlan] = []
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            members = tuple(order[lo:hi])
            num_blocks = -(-seq_lens[members[0]] // block_size)
            width = max(query_lens[i] for i in members)
            cost += len(members) * num_blocks * block_size * (1 + width / QUERIES_PER_KEY)
            plans.append(GroupPlan(members, width, num_blocks))
        if best is None or cost < best[0]:
            best = (cost, plans)
    assert best is not None
    return best[1]
