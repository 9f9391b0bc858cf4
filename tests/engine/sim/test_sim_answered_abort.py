"""An answered abort (``abort(..., keep_session=True)``: its caller had the answer) keeps the
session's KV in the simulated engine as a finished request's: the session's record is its
prefix, so ``session_kv_tokens`` reports it and an offload before a switch copies it."""

from __future__ import annotations

from tests.engine.sim.sim_helpers import BS, GLM, QWEN, make, req, tokens


def _answered_mid_decode(host_kv_bytes: int = 0):  # type: ignore[no-untyped-def]
    engine = make(host_kv_bytes=host_kv_bytes)
    engine.activate(QWEN)
    engine.add_request(req("c1", tokens(5000), max_tokens=100, session="s"))
    while not any(e.new_token_ids for e in engine.step().events):
        pass
    for _ in range(8):
        engine.step()
    engine.abort("c1", keep_session=True)
    engine.step()  # the abort's event
    return engine


def test_an_answered_abort_reports_the_session_kv() -> None:
    engine = _answered_mid_decode()
    assert engine.session_kv_tokens("s")[0] >= 5000 // BS * BS


def test_an_answered_abort_offloads_with_the_session_at_a_switch() -> None:
    engine = _answered_mid_decode(host_kv_bytes=10**12)
    engine.offload_kv(None)
    engine.activate(GLM)
    assert engine.session_kv_tokens("s")[1] >= 5000 // BS * BS
