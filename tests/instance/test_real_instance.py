"""An instance on the real multi-model engine (two tiny models, CPU) survives what killed it
before: a call aborted while a call of another model waits (the loop then switches models
while the engine still holds the abort's undelivered event). A call's thinking budget, sent as
the router sends it, is enforced by the engine behind the instance."""

from __future__ import annotations

from pathlib import Path

import orjson
from real_engine import LLAMA, NUM_BLOCKS, QWEN, real_engine

from engine.sampling_params import SamplingParams
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.protocol import CallRequest


def call(cid: str, model: str, max_tokens: int, n: int = 12) -> CallRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return CallRequest(cid, f"s-{cid}", model, [(i * 3) % 400 + 1 for i in range(n)], params)


async def test_an_abort_while_another_model_waits_leaves_the_instance_serving(
    tiny_models: dict[str, Path],
) -> None:
    inst = Instance("i", real_engine(tiny_models), PolicyConfig(slot_quantum_s=60.0))
    await inst.start()
    try:
        long = inst.submit(call("long", LLAMA, max_tokens=300))
        first = await anext(long)
        assert first.token_ids and not first.finished
        short = inst.submit(call("short", QWEN, max_tokens=3))
        long.abort()  # the client left, or the router cut the stream at a stop string
        events = await short.collect()
        assert events[-1].finish_reason == "length", events[-1]
        assert inst.healthy
        again = await inst.submit(call("again", LLAMA, max_tokens=2)).collect()
        assert again[-1].finish_reason == "length"
        assert inst.counters["switches"] == 2
    finally:
        await inst.stop()
    assert inst.engine.stats().num_free_blocks == inst.engine.stats().num_total_blocks


async def test_a_thinking_budget_sent_over_the_wire_is_enforced(tiny_models: dict[str, Path]) -> None:
    """The call as the router's HTTP client sends it (``to_dict``) and the instance server
    parses it (``from_dict``): its budget and end ids reach the engine, which forces the end
    after two thinking tokens."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, thinking_budget=2,
                            thinking_end_ids=[7, 8], thinking_from_start=True)
    sent = CallRequest("think", "s-think", LLAMA, [(i * 3) % 400 + 1 for i in range(12)], params)
    received = CallRequest.from_dict(orjson.loads(orjson.dumps(sent.to_dict())))
    assert received.params == params
    inst = Instance("i", real_engine(tiny_models), PolicyConfig())
    await inst.start()
    try:
        events = await inst.submit(received).collect()
    finally:
        await inst.stop()
    tokens = [t for e in events for t in e.token_ids]
    assert len(tokens) == 6 and tokens[2:4] == [7, 8]


async def _qwen_burst(tiny_models: dict[str, Path], lend: bool
                      ) -> tuple[dict[str, int], list[list[int]], int]:
    """Six Qwen calls of 18 blocks each (108 > the 96 of Qwen's KV region) queued while
    Llama is active, under Talaria's policy with or without lending; returns the counters,
    each call's tokens and the KV blocks Qwen's slot had (Qwen is still active at the end)."""
    inst = Instance("i", real_engine(tiny_models), PolicyConfig(lend_staging=lend))
    await inst.start()
    try:
        handles = [inst.submit(call(f"q{i}", QWEN, max_tokens=10, n=60 + i)) for i in range(6)]
        outputs = []
        for handle in handles:
            events = await handle.collect()
            assert events[-1].finish_reason == "length", events[-1]
            outputs.append([t for e in events for t in e.token_ids])
        return dict(inst.counters), outputs, inst.engine.stats().num_total_blocks
    finally:
        await inst.stop()


async def test_a_burst_under_kv_pressure_runs_on_the_lent_staging_region(
    tiny_models: dict[str, Path],
) -> None:
    """The switch to Qwen lends the live engine's staging region to its KV cache; every call
    gets the tokens it gets without lending."""
    lent, with_lending, lent_blocks = await _qwen_burst(tiny_models, lend=True)
    plain, without, plain_blocks = await _qwen_burst(tiny_models, lend=False)
    assert lent["staging_lends"] == 1 and "staging_lends" not in plain
    assert plain_blocks == NUM_BLOCKS < lent_blocks
    assert with_lending == without and all(len(out) == 10 for out in with_lending)


async def test_a_call_stalled_in_the_live_engine_makes_a_pin_yield(
    tiny_models: dict[str, Path],
) -> None:
    """Continuum's row on the live engine (96 blocks of 4 tokens): s's 49 blocks stay
    pinned (hard) after its call; x's prompt (30 blocks) fits the 47 free, so it is handed,
    but its answer grows it to 55: its decode finds no block and preempts x itself, which
    then waits in the engine with nothing running. The engine's step that ran nothing must
    read as one (``num_steps`` 0) for the deadlock guard to make s's pin yield; otherwise x
    waits for the pin's TTL (1000 s)."""
    import asyncio

    from workloads.replay.systems import PEERS

    policy = PEERS["continuum_ttl"].policy.with_(reservation_ttl="fixed",
                                                 reservation_ttl_s=1000.0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    inst = Instance("i", real_engine(tiny_models), policy)
    await inst.start()
    try:
        s = CallRequest("s#0", "s", LLAMA, [(i * 7) % 400 + 2 for i in range(199)], params,
                        expected_gap_s=1.0)
        await inst.submit(s).collect()
        res = inst.loop.sessions.reservations.get("s")
        assert res is not None and res.pinned and res.blocks == 49
        x = inst.submit(call("x", LLAMA, max_tokens=100, n=120))
        try:
            events = await asyncio.wait_for(x.collect(), timeout=30.0)
        except TimeoutError:
            x.abort()  # else stopping waits for it
            raise AssertionError("x waited in the engine for the pin's TTL") from None
        assert events[-1].finish_reason == "length", events[-1]
        assert inst.counters["reservations_yielded"] == 1
    finally:
        await inst.stop()
