"""An instance on the live multi-model engine (two tiny models, CPU) against its substrate: a
background staging copy that fails is counted and backed off, not started again at every
turn, and the switch to its model still works (from host); a session's soft reservation
keeps its host KV while the KV of unreserved sessions is evicted to make room."""

from __future__ import annotations

from pathlib import Path

import torch
from real_engine import BLOCK, LLAMA, QWEN, real_engine

from engine.interface import Residency
from engine.sampling_params import SamplingParams
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.protocol import CallRequest


def call(cid: str, session: str, model: str, max_tokens: int, n: int = 12, seed: int = 3,
         last: bool = False, gap: float | None = None) -> CallRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = [(i * seed) % 400 + 1 for i in range(n)]
    return CallRequest(cid, session, model, prompt, params, expected_gap_s=gap, last_call=last)


async def test_a_failed_background_staging_copy_is_backed_off_not_retried_every_turn(
    tiny_models: dict[str, Path],
) -> None:
    engine = real_engine(tiny_models)
    stager = engine.rank.memory.stager

    def failing(dst: torch.Tensor, src: torch.Tensor) -> None:
        stager._error = RuntimeError("link down")

    stager._cpu_copy = failing  # type: ignore[method-assign]
    started: list[str] = []
    stage = engine.stage

    def counted(model: str):  # type: ignore[no-untyped-def]
        started.append(model)
        return stage(model)

    engine.stage = counted  # type: ignore[method-assign]
    inst = Instance("i", engine, PolicyConfig(slot_quantum_s=60.0, staging_retry_backoff_s=600.0))
    await inst.start()
    try:
        long = inst.submit(call("long", "s-long", LLAMA, max_tokens=200))
        first = await anext(long)
        assert first.token_ids and not first.finished
        short = inst.submit(call("short", "s-short", QWEN, max_tokens=3))  # Qwen is staged next
        events = [first, *await long.collect()]
        assert events[-1].finish_reason == "length" and events[-1].error is None
        short_events = await short.collect()
        assert short_events[-1].finish_reason == "length", short_events[-1]
        assert inst.healthy and inst.counters["engine_faults"] == 0
    finally:
        await inst.stop()
    # one try per model: the copy failed, and its model waits out a backoff before another
    assert started.count(QWEN) == 1 and started.count(LLAMA) <= 1, started
    assert inst.counters["staging_failures"] == len(started)
    assert engine.rank.memory.ledger.staged_model is None  # nothing half-staged is kept
    assert engine.residency()[QWEN] is Residency.ACTIVE  # switched in from host
    assert engine.rank.move_totals("activate_h2d")[0] > 0
    assert engine.rank.move_totals("activate_d2d") == (0, 0.0)


async def test_a_reserved_sessions_host_kv_outlives_unreserved_kv(
    tiny_models: dict[str, Path],
) -> None:
    """Three Llama sessions' KV goes to a host store that holds two and a half of them at the
    switch to Qwen. The one with a soft reservation (expected back) comes out whole; the
    store evicts the unreserved sessions' KV, although the reserved one's is the oldest."""
    probe = real_engine(tiny_models)
    block_bytes = int(probe.kv_bytes_per_token(LLAMA)) * BLOCK
    probe.shutdown()
    tokens = 40  # the prompt; 43 tokens of KV once 4 are generated: 10 full blocks
    engine = real_engine(tiny_models, host_kv_bytes=25 * block_bytes)
    inst = Instance("i", engine, PolicyConfig(slot_quantum_s=60.0, session_prefill=False,
                                              d2d_staging=False))
    await inst.start()
    try:
        reserved = await inst.submit(call("r", "r", LLAMA, 4, n=tokens, seed=3, gap=30.0)).collect()
        assert reserved[-1].finish_reason == "length"
        for i, seed in enumerate((5, 7)):
            done = await inst.submit(call(f"u{i}", f"u{i}", LLAMA, 4, n=tokens, seed=seed,
                                          last=True)).collect()
            assert done[-1].finish_reason == "length"
        assert "r" in inst.reservations and "u0" not in inst.reservations
        done = await inst.submit(call("q", "q", QWEN, 2)).collect()  # the switch offloads
        assert done[-1].finish_reason == "length"
        assert "r" in inst.reservations
        host = {s: engine.session_kv_tokens(s)[1] for s in ("r", "u0", "u1")}
    finally:
        await inst.stop()
    assert host["r"] == 10 * BLOCK, host
    assert host["u0"] + host["u1"] == 15 * BLOCK, host
