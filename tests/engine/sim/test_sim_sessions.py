"""The simulated engine's session records let a finished call's tokens go after
``session_tokens_s``: memory then follows the sessions active lately, and a session that
comes back later reuses exactly the KV it would have reused with its tokens kept."""

from __future__ import annotations

import pytest

from engine.sim.engine import SimEngineConfig
from tests.engine.sim.sim_helpers import BS, QWEN, Clock, drain, make, output, req, tokens


def _continue_after(gap_s: float, keep_s: float | None) -> tuple[int, int, bool]:
    """Session "s" calls, waits ``gap_s`` (while session "t" finishes a call), and continues
    with a prompt that diverges at token 1000: (its cached tokens, its prefill tokens,
    whether s's record still held its tokens when it continued)."""
    clock = Clock()
    engine = make(clock=clock, session_tokens_s=keep_s)
    engine.activate(QWEN)
    prompt = tokens(5000)
    engine.add_request(req("c1", prompt, max_tokens=10, session="s"))
    _, first = drain(engine)
    clock.now += gap_s
    engine.add_request(req("t1", tokens(300, 90_000), max_tokens=2, session="t"))
    drain(engine)
    kept = bool(engine.sessions.records["s"].prompt_token_ids)
    assert engine.sessions.records["s"].block_hashes  # where its KV is: always kept
    full = prompt + output(first["c1"]) + tokens(2000, 50_000)
    changed = full[:1000] + [7] + full[1001:]
    engine.add_request(req("c2", full, max_tokens=1, session="s"))
    engine.add_request(req("c3", changed, max_tokens=1, session="u"))
    _, events = drain(engine)
    last = events["c2"][-1]
    return last.num_cached_tokens, events["c3"][-1].num_cached_tokens, kept


def test_tokens_go_after_the_horizon_and_reuse_is_the_same_either_way() -> None:
    within = _continue_after(gap_s=100.0, keep_s=600.0)
    after = _continue_after(gap_s=700.0, keep_s=600.0)
    forever = _continue_after(gap_s=700.0, keep_s=None)
    assert within[2] and forever[2] and not after[2]
    assert within[:2] == after[:2] == forever[:2] == (78 * BS, 15 * BS)


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
