"""Anthropic's ``thinking.budget_tokens`` through the whole stack: the router (a template that
opens ``<think>`` in the prompt, parser ``deepseek_r1``) sends the budget and the ids of
``</think>`` in the tiny vocabulary (several tokens: it has no token of its own), an instance
on the real multi-model engine forces them after the budget's tokens, and the router splits
the answer there: the thinking block is the budget's tokens, the text what follows."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anthropic
from aiohttp.test_utils import TestServer
from real_engine import LLAMA, real_engine

from engine.models.tiny import CHAT_TEMPLATE, build_tokenizer
from router.app import RouterConfig, create_app
from router.instances.inprocess import InProcessClient
from router.tokenization import ModelTokenizer
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.protocol import CallEvent, CallRequest

GENERATION = "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
BUDGET = 4


class Recording(InProcessClient):
    """The in-process client, keeping each call and the tokens it was answered with."""

    calls: list[CallRequest]
    tokens: list[int]

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.calls, self.tokens = [call], []
        async for event in super().submit(call):
            self.tokens.extend(event.token_ids)
            yield event


def opening_tokenizer() -> ModelTokenizer:
    hf = build_tokenizer(512)
    assert CHAT_TEMPLATE.rstrip().endswith(GENERATION)
    hf.chat_template = CHAT_TEMPLATE.rstrip().removesuffix(GENERATION) + (
        "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
    return ModelTokenizer(LLAMA, hf, 4096)


async def test_the_thinking_block_ends_where_the_engine_forced_the_end(tiny_models: dict[str, Path]) -> None:
    tok = opening_tokenizer()
    inst = Instance("i", real_engine(tiny_models), PolicyConfig())
    client = Recording("i", inst)
    config = RouterConfig(models={LLAMA: "/unused"}, instances={"i": ""}, poll_interval_s=None,
                          reasoning_parsers={LLAMA: "deepseek_r1"})
    server = TestServer(create_app(config, {"i": client}, {LLAMA: tok}))
    await inst.start()
    await server.start_server()
    claude = anthropic.AsyncAnthropic(base_url=str(server.make_url("/")).rstrip("/"), api_key="x", max_retries=0)
    try:
        reply = await claude.messages.create(
            model=LLAMA, max_tokens=12, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Think a little"}],
            thinking={"type": "enabled", "budget_tokens": BUDGET})
    finally:
        await claude.close()
        await server.close()
        await inst.stop()
    end = (await tok.think_tag_ids())["</think>"]
    tokens = client.tokens
    assert len(end) > 1 and client.calls[0].params.thinking_end_ids == end
    assert tokens[BUDGET:BUDGET + len(end)] == end  # forced right after the budget's tokens
    thought, after = tok.decode(tokens[:BUDGET]), tok.decode(tokens[BUDGET + len(end):])
    assert thought.strip() and "</think>" not in thought
    blocks = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content]
    assert blocks == [("thinking", thought.lstrip()), ("text", after.lstrip())]
    assert reply.usage.output_tokens == len(tokens)
