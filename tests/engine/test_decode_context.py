"""Decode contexts kept across steps: appended to while a group continues, gathered afresh
when it changes, never over budget, and always equal to attending the paged cache."""

from __future__ import annotations

import torch
from helpers import allocate_kv_cache, dense_causal

from engine.attention.decode_context import SLACK_BLOCKS, DecodeContexts
from engine.attention.metadata import build_attention_metadata
from engine.attention.torch_paged import TorchPagedAttention

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 2, 4, 2, 8, 4


class Sequence:
    """A decoding sequence with its full per-layer K/V history (the dense reference)."""

    def __init__(self, length: int, blocks: list[int], g: torch.Generator) -> None:
        self.k = [torch.randn(length, KV_HEADS, DIM, generator=g) for _ in range(LAYERS)]
        self.v = [torch.randn(length, KV_HEADS, DIM, generator=g) for _ in range(LAYERS)]
        self.blocks = blocks

    @property
    def length(self) -> int:
        return self.k[0].shape[0]


def run_steps(
    budget_bytes: int, schedule: list[list[int]], lengths: list[int]
) -> list[list[bool | None]]:
    """Decode the sequences named by each step of ``schedule`` (indices into ``lengths``),
    checking every layer's output against dense attention; returns, per step, each group's
    context state: True fresh, False appended, None gathered without a kept context."""
    g = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-(n + len(schedule)) // BLOCK) for n in lengths)
    kv = allocate_kv_cache(LAYERS, num_blocks, BLOCK, KV_HEADS, DIM)
    free = list(range(num_blocks))
    seqs = []
    for n in lengths:  # context written by earlier steps, in every layer
        blocks = [free.pop() for _ in range(-(-(n + len(schedule)) // BLOCK))]
        seq = Sequence(n, blocks, g)
        for layer in range(LAYERS):
            for pos in range(n):
                b, off = blocks[pos // BLOCK], pos % BLOCK
                kv[layer, 0, b, off], kv[layer, 1, b, off] = seq.k[layer][pos], seq.v[layer][pos]
        seqs.append(seq)
    contexts = DecodeContexts(
        LAYERS, KV_HEADS, DIM, BLOCK, torch.float32, torch.device("cpu"), budget_bytes
    )
    backend = TorchPagedAttention()
    states = []
    for members in schedule:
        for i in members:  # each member gets one new token
            for layer in range(LAYERS):
                seqs[i].k[layer] = torch.cat((seqs[i].k[layer], torch.randn(1, KV_HEADS, DIM)))
                seqs[i].v[layer] = torch.cat((seqs[i].v[layer], torch.randn(1, KV_HEADS, DIM)))
        layout = build_attention_metadata(
            [1] * len(members),
            [seqs[i].length for i in members],
            [seqs[i].blocks for i in members],
            BLOCK,
            contexts=contexts,
            seq_keys=[seqs[i] for i in members],
        )
        attn = backend.prepare(layout.attn)
        order = [members[j] for j in layout.order]
        for layer in range(LAYERS):
            q = torch.randn(len(order), HEADS, DIM)
            k_new = torch.cat([seqs[i].k[layer][-1:] for i in order])
            v_new = torch.cat([seqs[i].v[layer][-1:] for i in order])
            out = backend.forward(q, k_new, v_new, kv[layer], attn, DIM**-0.5, layer)
            want = torch.cat(
                [
                    dense_causal(q[r : r + 1], seqs[i].k[layer], seqs[i].v[layer], DIM**-0.5)
                    for r, i in enumerate(order)
                ]
            )
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert contexts.num_bytes <= budget_bytes
        states.append([g.context_fresh if g.context is not None else None for g in attn.groups])
    return states


def test_groups_append_while_they_continue_and_gather_when_they_change() -> None:
    lengths = [3, 17, 9, 30, 12, 5, 22, 8]
    everyone = list(range(8))
    schedule = [everyone, everyone, everyone[1:], everyone[1:], everyone[1:]]
    states = run_steps(1 << 24, schedule, lengths)
    assert all(s is True for s in states[0])  # first step: every group gathers
    assert all(s is False for s in states[1])  # same groups, one token longer: append
    assert all(s is True for s in states[2])  # a member left: groups re-form and gather
    assert all(s is False for s in states[3] + states[4])


def test_over_budget_groups_gather_without_a_kept_context() -> None:
    states = run_steps(0, [[0, 1, 2], [0, 1, 2]], [5, 9, 14])
    assert all(s is None for step in states for s in step)


def test_a_buffer_grows_by_a_new_gather_when_its_capacity_is_reached() -> None:
    """A kept buffer holds a few blocks beyond its width; past that, it is gathered anew."""
    steps = (SLACK_BLOCKS + 1) * BLOCK + 2  # from 7 tokens (2 blocks) past 2 + SLACK blocks
    states = run_steps(1 << 24, [[0]] * steps, [6])
    flat = [s[0] for s in states]
    assert flat[0] is True and flat.count(True) == 2 and flat[1] is False
