"""The replay's prompt chains (``CallRequest.prompt_chain``): each call's block-hash chain,
hashed from the last call's, so the router and the simulated engine need not hash the
prompt. They must be exactly the chains the prompts hash to, and change no result."""

from __future__ import annotations

import random

import pytest

from engine.block_hash import BlockChain, block_hashes
from engine.sampling_params import SamplingParams
from router.sessions.prefix_chain import KnownChains
from talaria.protocol import CallRequest
from workloads.replay import driver
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import run_sim
from workloads.replay.prompts import SessionTokens, next_prompt, prompt_chain
from workloads.replay.systems import SYSTEMS
from workloads.traces.generator import generate_trace

BS = 16


@pytest.mark.parametrize("seed", range(4))
def test_a_chain_is_the_hash_of_its_whole_prompt(seed: int) -> None:
    """Over a session's calls, prompts growing, cut (``prefix_tokens``) and shrinking, each
    chain built from the last equals hashing the whole prompt."""
    rng = random.Random(seed)
    tokens = SessionTokens(f"s{seed}", seed, 50_000)
    prompt = tokens.take(rng.randrange(1, 200))
    chain = prompt_chain(prompt, None, 0, BS)
    assert chain.hashes == block_hashes(prompt, BS)
    for _ in range(40):
        output = tokens.take(rng.randrange(0, 60))
        base = len(prompt) + len(output)
        keep = rng.choice([None, None, rng.randrange(0, base + 1)])
        size = rng.choice([base + rng.randrange(1, 300), rng.randrange(1, base + 2)])
        repeated = min(base if keep is None else keep, size)
        prompt = next_prompt(prompt, output, size, tokens, keep)
        chain = prompt_chain(prompt, chain, repeated, BS)
        assert chain.hashes == block_hashes(prompt, BS)


def test_a_chain_is_used_only_where_it_fits() -> None:
    prompt = list(range(1, 100))
    chain = BlockChain(BS, block_hashes(prompt, BS))
    assert chain.of(len(prompt), BS) is chain.hashes
    assert chain.of(len(prompt), BS // 2) is None  # another block size
    assert chain.of(len(prompt) + BS, BS) is None  # another prompt's length
    router_side = KnownChains(BS)
    assert router_side.hash_prompt(["k"], prompt, chain).hashes is chain.hashes
    wrong = BlockChain(BS // 2, block_hashes(prompt, BS // 2))
    assert router_side.hash_prompt(["k"], prompt, wrong).hashes == block_hashes(prompt, BS)


def test_a_chain_never_crosses_the_wire() -> None:
    """In-process only: an HTTP call carries no chain, and an instance refuses one sent."""
    prompt = list(range(1, 40))
    call = CallRequest("c", "s", "m", prompt, SamplingParams(max_tokens=4),
                       prompt_chain=BlockChain(BS, block_hashes(prompt, BS)))
    data = call.to_dict()
    assert "prompt_chain" not in data
    assert CallRequest.from_dict(data).prompt_chain is None
    with pytest.raises(ValueError, match="prompt_chain"):
        CallRequest.from_dict({**data, "prompt_chain": {"block_size": BS, "hashes": []}})


@pytest.mark.parametrize("send_session_ids", [True, False])
def test_a_simulated_replay_is_the_same_without_chains(
    monkeypatch: pytest.MonkeyPatch, send_session_ids: bool
) -> None:
    """Every call record of a two-server Talaria replay (placement by KV, host KV, session
    inference when ids are not sent) is the same when the router and the engines hash every
    prompt themselves, as they do live."""
    models = ("glm-4.5-air", "mistral-large-2407")
    trace = generate_trace(num_sessions=8, total_calls=60, models=models, seed=5)
    spec = ClusterSpec(models=models, servers=2)
    chained = run_sim(trace, SYSTEMS["talaria"], spec, seed=1, send_session_ids=send_session_ids)
    plain = driver.drive
    monkeypatch.setattr(driver, "drive", lambda *a, **k: plain(*a, **{**k, "prompt_chains": False}))
    hashed = run_sim(trace, SYSTEMS["talaria"], spec, seed=1, send_session_ids=send_session_ids)
    assert sum(c.cached_tokens for c in chained.calls) > 0  # prefixes were reused
    assert [repr(s) for s in chained.sessions] == [repr(s) for s in hashed.sessions]
    assert chained.totals == hashed.totals
