"""An answered call (its answer whole before its call ended: a stop string, a settled tool
call) counts as a finished call in the router's token metrics, its cached prompt tokens too:
the instance reported them with its first tokens, and the router's cache-hit counters would
otherwise lose every such call."""

from __future__ import annotations

from api_helpers import chat_body, reply, serve
from router_fakes import FakeInstance

from router.app import CORE_KEY
from router.tokenization import ModelTokenizer


async def test_an_answered_call_counts_its_cached_prompt_tokens(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer), cached_tokens=16, restored_tokens=0)
    async with serve(tokenizer, {"a": a}) as client:
        for stream in (False, True):
            resp = await client.post("/v1/chat/completions", json=chat_body(stop=[" is"], stream=stream))
            assert resp.status == 200
            await resp.read()
        metrics = client.app[CORE_KEY].metrics
    assert a.answered == [c.call_id for c in a.calls]
    assert metrics.requests.get(model="tiny", instance="a", outcome="ok") == 2
    assert metrics.prompt_tokens.get(model="tiny") == 2 * len(a.calls[0].prompt_token_ids)
    assert metrics.cached_tokens.get(model="tiny") == 2 * 16
    assert 0 < metrics.completion_tokens.get(model="tiny") < 2 * len(reply(tokenizer))
