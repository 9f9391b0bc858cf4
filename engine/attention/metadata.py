"""Attention metadata for one forward pass, built once per step and passed explicitly.

A batch is flattened: the new tokens of every scheduled sequence are concatenated (a
prefill chunk contributes its chunk, a decode one token). Sequence i's new tokens are rows
``query_start_loc[i]:query_start_loc[i+1]``; they sit at the end of its context of
``seq_lens[i]`` tokens (cached + new), whose KV lives in blocks
``block_tables[i, :ceil(seq_lens[i] / block_size)]``. Before attention, each layer writes
the new tokens' K and V at ``slot_mapping`` (block_id * block_size + offset).

The torch backend attends ``groups`` of sequences in batched calls (see
``engine.attention.grouping``); the builder orders the batch so that each group's tokens are
contiguous. Every index a layer needs is here, so the forward pass does no host work and
reads nothing back from the device.

Fixed shapes (a decode step a CUDA graph can capture): with ``FixedShape(num_seqs,
num_blocks)`` a decode-only batch is padded to exactly ``num_seqs`` sequences with block
tables of exactly ``num_blocks`` blocks, in one group, so every tensor's shape depends only on
the bucket. A padding row attends to one key and, through ``write_rows``, writes row 0's K/V
into row 0's slot again, which leaves the cache as the real rows left it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

import torch

from engine.attention.decode_context import AssignedContext, DecodeContexts
from engine.attention.grouping import GroupPlan, plan_groups, split_groups


@dataclass(frozen=True)
class FixedShape:
    """A decode bucket: sequences and blocks per sequence of every padded tensor."""

    num_seqs: int
    num_blocks: int


@dataclass
class AttentionGroup:
    """Sequences attended in one batched call, padded to ``query_width`` new tokens and
    ``num_blocks`` blocks of context each. Their tokens are the contiguous rows
    ``token_start : token_start + num_tokens`` of the batch."""

    num_seqs: int
    query_width: int
    num_blocks: int
    token_start: int
    num_tokens: int
    causal: bool  # every member's new tokens are its whole context (a fresh prefill)
    block_ids: torch.Tensor  # [num_seqs * num_blocks] padded block tables, flattened
    seq_lens: torch.Tensor  # [num_seqs]
    query_lens: torch.Tensor  # [num_seqs]
    # Only when members have fewer new tokens than query_width: the batch row of each padded
    # query, and the row of the padded result holding each of the group's real tokens.
    query_rows: torch.Tensor | None = None  # [num_seqs * query_width]
    out_rows: torch.Tensor | None = None  # [num_tokens]
    mask: torch.Tensor | None = None  # additive, set by the torch backend's ``prepare``
    # A decode group's context kept across steps (see ``engine.attention.decode_context``):
    # [num_layers, 2, num_seqs, kv_heads, capacity, head_dim]; ``context_fresh``: gather the
    # whole context into it this step, else append each member's new token, head by head,
    # at ``append_slots`` ((row * kv_heads + head) * capacity + seq_len - 1).
    context: torch.Tensor | None = None
    context_fresh: bool = False
    append_slots: torch.Tensor | None = None  # [num_seqs * kv_heads]

    @property
    def needs_mask(self) -> bool:
        """A causal group needs none: its queries sit at the start of its keys, so
        top-left-aligned causal attention hides exactly the keys a query may not see."""
        return not self.causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative context lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length incl. new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    num_seqs: int
    groups: list[AttentionGroup]  # in batch order, covering every token once
    write_rows: torch.Tensor | None = None  # fixed shapes: the row whose K/V each slot gets

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class StepLayout:
    """How a step's sequences are laid out: ``order[i]`` is the index (in the caller's
    order) of the i-th sequence of the batch; ``positions`` are the batch tokens'."""

    order: list[int]
    positions: torch.Tensor
    attn: AttentionMetadata


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    fixed: FixedShape | None = None,
    contexts: DecodeContexts | None = None,
    seq_keys: Sequence[object] | None = None,
) -> StepLayout:
    """The batch layout and metadata for sequences whose new tokens are the last
    ``query_lens[i]`` of ``seq_lens[i]`` tokens, moved to ``device`` in one copy. Sequences
    are reordered so that every attention group is contiguous (under ``fixed``, the order is
    kept and padding sequences follow). With ``contexts`` (and ``seq_keys``, an object per
    sequence that stays the same across its steps), decode groups get kept contexts."""
    num_real = len(query_lens)
    if num_real == 0 or len(seq_lens) != num_real or len(block_tables) != num_real:
        raise ValueError(
            f"need one query length, sequence length and block table per sequence, got "
            f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
        )
    for i, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if not 0 < q <= s or len(table) * block_size < s:
            raise ValueError(
                f"sequence {i}: query_len {q}, seq_len {s} and {len(table)} blocks of "
                f"{block_size} do not fit together"
            )
    assigned: list[AssignedContext | None] = [None]
    if fixed is not None:
        _check_fixed(fixed, query_lens, block_tables)
        pad = fixed.num_seqs - num_real
        order = list(range(num_real))
        q_lens = list(query_lens) + [1] * pad
        s_lens = list(seq_lens) + [1] * pad
        tables = [list(t) for t in block_tables] + [[]] * pad
        plans = [GroupPlan(tuple(range(fixed.num_seqs)), 1, fixed.num_blocks)]
        width = fixed.num_blocks
    else:
        planned, assigned = _plan(query_lens, seq_lens, block_size, contexts, seq_keys)
        order = [i for plan in planned for i in plan.seqs]
        rank = {seq: pos for pos, seq in enumerate(order)}
        plans = [
            GroupPlan(tuple(rank[i] for i in p.seqs), p.query_width, p.num_blocks) for p in planned
        ]
        q_lens = [query_lens[i] for i in order]
        s_lens = [seq_lens[i] for i in order]
        tables = [list(block_tables[i]) for i in order]
        width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    q_t = torch.tensor(q_lens, dtype=torch.long)
    s_t = torch.tensor(s_lens, dtype=torch.long)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.long)
    torch.cumsum(q_t, 0, out=starts[1:])
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_t)
    positions = torch.arange(int(starts[-1])) - starts[seq_of_token] + (s_t - q_t)[seq_of_token]
    slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size
    host: dict[str, torch.Tensor] = {
        "positions": positions,
        "slots": slots,
        "starts": starts,
        "seq_starts": torch.nn.functional.pad(s_t.cumsum(0), (1, 0)),
        "seq_lens": s_t,
        "table": table,
    }
    if fixed is not None:
        slots[num_real:] = slots[0]
        host["write_rows"] = torch.cat(
            (torch.arange(num_real), torch.zeros(fixed.num_seqs - num_real, dtype=torch.long))
        )
    for g, plan in enumerate(plans):
        host.update(
            {f"{g}.{k}": v for k, v in _group_tensors(plan, starts, q_t, s_t, table).items()}
        )
        kept = assigned[g]
        if kept is not None:
            _, _, b, kv_heads, capacity, _ = kept.buffer.shape
            heads = torch.arange(b * kv_heads).view(b, kv_heads) * capacity
            last = s_t[plan.seqs[0] : plan.seqs[-1] + 1] - 1
            host[f"{g}.append_slots"] = (heads + last[:, None]).reshape(-1)
    dev = _to_device(host, torch.device(device))
    groups: list[AttentionGroup] = []
    for g, (plan, kept) in enumerate(zip(plans, assigned, strict=True)):
        first, last = plan.seqs[0], plan.seqs[-1]
        groups.append(
            AttentionGroup(
                num_seqs=len(plan.seqs),
                query_width=plan.query_width,
                num_blocks=plan.num_blocks,
                token_start=int(starts[first]),
                num_tokens=int(starts[last + 1] - starts[first]),
                causal=fixed is None and all(q_lens[i] == s_lens[i] for i in plan.seqs),
                block_ids=dev[f"{g}.block_ids"],
                seq_lens=dev[f"{g}.seq_lens"],
                query_lens=dev[f"{g}.query_lens"],
                query_rows=dev.get(f"{g}.query_rows"),
                out_rows=dev.get(f"{g}.out_rows"),
                context=kept.buffer if kept is not None else None,
                context_fresh=kept.fresh if kept is not None else False,
                append_slots=dev.get(f"{g}.append_slots"),
            )
        )
    meta = AttentionMetadata(
        slot_mapping=dev["slots"],
        query_start_loc=dev["starts"].to(torch.int32),
        seq_start_loc=dev["seq_starts"].to(torch.int32),
        seq_lens=dev["seq_lens"].to(torch.int32),
        block_tables=dev["table"].to(torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=width * block_size if fixed is not None else max(s_lens),
        block_size=block_size,
        num_seqs=len(q_lens),
        groups=groups,
        write_rows=dev.get("write_rows"),
    )
    return StepLayout(order, dev["positions"], meta)


def _plan(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_size: int,
    contexts: DecodeContexts | None,
    seq_keys: Sequence[object] | None,
) -> tuple[list[GroupPlan], list[AssignedContext | None]]:
    """Groups (decodes first) and, with ``contexts``, each decode group's kept context."""
    if contexts is None or seq_keys is None:
        plans = plan_groups(query_lens, seq_lens, block_size)
        return plans, [None] * len(plans)
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    prefills = [i for i, q in enumerate(query_lens) if q != 1]
    plans, assigned = contexts.plan(decodes, seq_lens, seq_keys)
    prefill_plans = split_groups(prefills, query_lens, seq_lens, block_size)
    return plans + prefill_plans, assigned + [None] * len(prefill_plans)


def _check_fixed(fixed: FixedShape, query_lens: list[int], tables: list[list[int]]) -> None:
    if any(q != 1 for q in query_lens):
        raise ValueError("fixed shapes are for decode-only batches (one new token per sequence)")
    if len(query_lens) > fixed.num_seqs:
        raise ValueError(f"{len(query_lens)} sequences exceed the bucket of {fixed.num_seqs}")
    longest = max(len(t) for t in tables)
    if longest > fixed.num_blocks:
        raise ValueError(
            f"a block table of {longest} blocks exceeds the bucket's {fixed.num_blocks}"
        )


def _group_tensors(
    plan: GroupPlan,
    starts: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    table: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Host index tensors of one group whose members are consecutive in the batch (a padded
    query repeats its sequence's last real one)."""
    members = torch.arange(plan.seqs[0], plan.seqs[-1] + 1)
    q = query_lens[members]
    out = {
        "block_ids": table[members, : plan.num_blocks].reshape(-1),
        "seq_lens": seq_lens[members],
        "query_lens": q,
    }
    if bool((q < plan.query_width).any()):
        offsets = torch.arange(plan.query_width)
        rows = starts[members, None] + torch.minimum(offsets[None, :], q[:, None] - 1)
        out["query_rows"] = rows.reshape(-1)
        out["out_rows"] = (offsets[None, :] < q[:, None]).reshape(-1).nonzero().squeeze(1)
    return out


def _to_device(host: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every int64 host tensor on ``device`` through a single copy (views of one buffer)."""
    if device.type == "cpu":
        return host
    flat = torch.cat([t.reshape(-1) for t in host.values()])
    moved = flat.to(device, non_blocking=True)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for key, t in host.items():
        out[key] = moved[offset : offset + t.numel()].view(t.shape)
        offset += t.numel()
    return out


def copy_into(dst: Any, src: Any, path: str = "inputs") -> None:
    """Copy every tensor of ``src`` into the same-shaped tensor of ``dst`` (dataclasses,
    lists and tuples walked field by field); every other value must already be equal. This
    refreshes a captured graph's static inputs for a new step of the same bucket."""
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor) or src.shape != dst.shape:
            got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
            raise ValueError(f"{path}: cannot copy {got} into a tensor of {tuple(dst.shape)}")
        dst.copy_(src)
    elif is_dataclass(dst) and not isinstance(dst, type):
        if type(src) is not type(dst):
            raise ValueError(f"{path}: {type(src).__name__} is not a {type(dst).__name__}")
        for f in fields(dst):
            copy_into(getattr(dst, f.name), getattr(src, f.name), f"{path}.{f.name}")
    elif isinstance(dst, list | tuple):
        if not isinstance(src, list | tuple) or len(src) != len(dst):
            raise ValueError(f"{path}: lengths differ")
        for i, (d, s) in enumerate(zip(dst, src, strict=True)):
            copy_into(d, s, f"{path}[{i}]")
    elif dst != src:
        raise ValueError(f"{path}: {src!r} differs from the static {dst!r}")


def with_group_masks(
    attn: AttentionMetadata, masks: list[torch.Tensor | None]
) -> AttentionMetadata:
    """A copy of ``attn`` whose groups carry ``masks`` (one per group, in order)."""
    groups = [replace(g, mask=m) for g, m in zip(attn.groups, masks, strict=True)]
    return replace(attn, groups=groups)
