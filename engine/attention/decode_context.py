"""Gathered decode contexts kept across steps, so that the torch backend does not gather
every decoding sequence's whole context from the paged cache in every layer of every step.

A decode group whose members are the very sequences of one of the previous step's decode
groups, in the same order and each exactly one token longer, keeps that group's buffer and
only appends this step's K/V to it; any other decode group gets a new buffer and gathers its
context into it once. Planning is sticky: the previous step's groups that continue are kept
as they are (their padding does not grow: every member grows by one token), and only the
other decodes (new ones, and members of groups someone left) are grouped afresh, unless
that would make more than ``MAX_GROUPS`` decode groups.

A buffer is ``[num_layers, 2, num_seqs, kv_heads, capacity, head_dim]`` (zeroed, so slots
nothing wrote stay finite), with ``capacity`` a few blocks beyond the group's width so it
can grow in place. It is head-major, unlike the paged cache: attention reads each head's
keys contiguously, which on a CPU makes it markedly faster than over a gathered copy of the
paged (token-major) layout. The paged cache stays the source of truth (every new token is written
there too); a buffer is only valid for the step it was assigned to, and a buffer no group of
a step keeps is dropped at that step. Buffers never take more than ``budget_bytes``
together; a group that does not fit gathers from the paged cache as before. Sequences are
identified by an object that stays the same over their steps (compared with ``is``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention.grouping import MAX_GROUPS, GroupPlan, split_groups

SLACK_BLOCKS = 4


@dataclass(frozen=True)
class AssignedContext:
    buffer: torch.Tensor  # [num_layers, 2, num_seqs, kv_heads, capacity, head_dim]
    fresh: bool  # gather the whole context this step (else append the new tokens)


@dataclass
class _Entry:
    members: tuple[object, ...]
    seq_lens: tuple[int, ...]
    buffer: torch.Tensor


class DecodeContexts:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        budget_bytes: int,
    ) -> None:
        self.block_shape = (kv_heads, head_dim)
        self.num_layers = num_layers
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.budget_bytes = budget_bytes
        self._entries: list[_Entry] = []

    @property
    def num_bytes(self) -> int:
        return sum(e.buffer.numel() * e.buffer.element_size() for e in self._entries)

    def plan(
        self,
        decodes: list[int],
        seq_lens: Sequence[int],
        keys: Sequence[object],
    ) -> tuple[list[GroupPlan], list[AssignedContext | None]]:
        """Decode groups of ``decodes`` (indices into ``seq_lens``/``keys``) and each one's
        buffer (None: over budget); forgets the buffers no group keeps."""
        index = {id(keys[i]): i for i in decodes}
        kept: list[tuple[GroupPlan, _Entry]] = []
        for entry in self._entries:
            members = [index.get(id(m)) for m in entry.members]
            if any(i is None for i in members):
                continue
            seqs = tuple(i for i in members if i is not None)
            grown = all(seq_lens[i] == n + 1 for i, n in zip(seqs, entry.seq_lens, strict=True))
            blocks = max(-(-seq_lens[i] // self.block_size) for i in seqs)
            if grown and blocks * self.block_size <= entry.buffer.shape[4]:
                kept.append((GroupPlan(seqs, 1, blocks), entry))
        taken = {i for plan, _ in kept for i in plan.seqs}
        rest = [i for i in decodes if i not in taken]
        ones = [1] * len(seq_lens)
        new = split_groups(rest, ones, seq_lens, self.block_size)
        if len(kept) + len(new) > MAX_GROUPS:
            kept, new = [], split_groups(decodes, ones, seq_lens, self.block_size)
        self._entries = []
        assigned: list[AssignedContext | None] = []
        for plan, entry in kept:
            entry.seq_lens = tuple(seq_lens[i] for i in plan.seqs)
            self._entries.append(entry)
            assigned.append(AssignedContext(entry.buffer, fresh=False))
        used = self.num_bytes
        for plan in new:
            capacity = (plan.num_blocks + SLACK_BLOCKS) * self.block_size
            kv_heads, head_dim = self.block_shape
            shape = (self.num_layers, 2, len(plan.seqs), kv_heads, capacity, head_dim)
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=self.dtype).element_size()
            if used + nbytes > self.budget_bytes:
                assigned.append(None)
                continue
            used += nbytes
            buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)
            members = tuple(keys[i] for i in plan.seqs)
            self._entries.append(_Entry(members, tuple(seq_lens[i] for i in plan.seqs), buffer))
            assigned.append(AssignedContext(buffer, fresh=True))
        return [plan for plan, _ in kept] + new, assigned
