"""The simulated engine's session records let a finished call's tokens go after
``session_tokens_s``: memory then follows the sessions active lately, and a session that
comes back later reuses exactly the KV it would have reused with its tokens kept."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.block_hash import BlockChain, block_hashes
from engine.interface import EngineRequest
from engine.sim.engine import SimEngineConfig
from tests.engine.sim.sim_helpers import BS, QWEN, Clock, drain, make, output, req, tokens


def _chained(request: EngineRequest, block_size: int = BS) -> EngineRequest:
    """``request`` carrying its prompt's block-hash chain, as a simulated replay sends it."""
    chain = BlockChain(block_size, block_hashes(request.prompt_token_ids, block_size))
    return replace(request, prompt_chain=chain)


def _continue_after(gap_s: float, keep_s: float | None,
                    chains: int | None = None) -> tuple[int, int, bool]:
    """Session "s" calls, waits ``gap_s`` (while session "t" finishes a call), and continues
    with a prompt that diverges at token 1000: (its cached tokens, its prefill tokens,
    whether s's record still held its tokens when it continued). ``chains``: every request
    carries its prompt's chain at that block size."""
    clock = Clock()
    engine = make(clock=clock, session_tokens_s=keep_s)
    engine.activate(QWEN)
    add = engine.add_request if chains is None else (
        lambda r: engine.add_request(_chained(r, chains)))
    prompt = tokens(5000)
    add(req("c1", prompt, max_tokens=10, session="s"))
    _, first = drain(engine)
    clock.now += gap_s
    add(req("t1", tokens(300, 90_000), max_tokens=2, session="t"))
    drain(engine)
    kept = bool(engine.sessions.records["s"].prompt_token_ids)
    assert engine.sessions.records["s"].block_hashes  # where its KV is: always kept
    full = prompt + output(first["c1"]) + tokens(2000, 50_000)
    changed = full[:1000] + [7] + full[1001:]
    add(req("c2", full, max_tokens=1, session="s"))
    add(req("c3", changed, max_tokens=1, session="u"))
    _, events = drain(engine)
    last = events["c2"][-1]
    return last.num_cached_tokens, events["c3"][-1].num_cached_tokens, kept


def test_tokens_go_after_the_horizon_and_reuse_is_the_same_either_way() -> None:
    within = _continue_after(gap_s=100.0, keep_s=600.0)
    after = _continue_after(gap_s=700.0, keep_s=600.0)
    forever = _continue_after(gap_s=700.0, keep_s=None)
    assert within[2] and forever[2] and not after[2]
    assert within[:2] == after[:2] == forever[:2] == (78 * BS, 15 * BS)


@pytest.mark.parametrize("block_size", [BS, BS // 2])  # the second: a chain that does not fit
def test_prompt_chains_give_the_same_reuse(block_size: int) -> None:
    """Requests that carry their prompts' chains (used at the engine's block size, ignored at
    another) reuse exactly the KV they reuse without them, tokens kept or let go."""
    for gap_s, keep_s in ((100.0, 600.0), (700.0, 600.0)):
        assert (_continue_after(gap_s, keep_s, chains=block_size)[:2]
                == _continue_after(gap_s, keep_s)[:2] == (78 * BS, 15 * BS))


def test_a_chained_continuation_still_has_its_new_tokens_checked() -> None:
    """A chain spares the engine hashing, not checking: the tokens past the part equal to
    the session's last call are still checked, so a bad id there is refused."""
    engine = make()
    engine.activate(QWEN)
    prompt = tokens(3000)
    engine.add_request(_chained(req("c1", prompt, max_tokens=4, session="s")))
    _, first = drain(engine)
    grown = prompt + output(first["c1"]) + tokens(700, 40_000)
    grown[3500] = 10**9  # past every id of the last call, beyond any vocabulary
    with pytest.raises(ValueError, match="10+"):
        engine.add_request(_chained(req("c2", grown, max_tokens=1, session="s")))
    grown[3500] = 5
    engine.add_request(_chained(req("c2", grown, max_tokens=1, session="s")))
    _, events = drain(engine)
    assert events["c2"][-1].num_cached_tokens == 3000 // BS * BS


def test_a_forgotten_session_leaves_no_tokens_behind() -> None:
    clock = Clock()
    engine = make(clock=clock, session_tokens_s=600.0)
    engine.activate(QWEN)
    engine.add_request(req("c1", tokens(3000), max_tokens=2, session="s"))
    drain(engine)
    engine.forget_session("s")
    clock.now += 1000.0
    engine.add_request(req("t1", tokens(300, 90_000), max_tokens=2, session="t"))
    drain(engine)  # the sweep must not trip over the forgotten session
    assert "s" not in engine.sessions.records and engine.sessions.records["t"].prompt_token_ids


def test_session_tokens_s_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="session_tokens_s"):
        SimEngineConfig(session_tokens_s=-1.0)
