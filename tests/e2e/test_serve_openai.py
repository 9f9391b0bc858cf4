"""The official `openai` client against a live `talaria serve` (subprocess, free ports, the
tiny models alone, `--tiny-only`, written into a temp TALARIA_CACHE): chat and completions, streaming and
not, usage counts, sessions through X-Session-ID; then SIGINT stops every process."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from serve_process import pid_alive, start_serve

pytestmark = pytest.mark.slow

MAX = 5


def test_openai_client_against_talaria_serve(serve_cache: Path) -> None:
    serve = start_serve(serve_cache)
    try:
        pids = serve.descendants()
        assert {pid for pid, _ in serve.instances.values()} <= pids
        client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0, timeout=60)
        assert {m.id for m in client.models.list().data} == {
            "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"}
        greedy = {"temperature": 0.0, "max_tokens": MAX, "extra_body": {"ignore_eos": True}}

        # A chat session of three calls, each prompt the previous one plus the reply and a
        # tool result; the continuations reuse the session's KV on the instance.
        messages = [{"role": "user", "content": "Fix the failing test in parser.py"}]
        prompt_tokens = []
        for turn in range(3):
            chat = client.chat.completions.create(
                model="tiny-qwen3", messages=messages, extra_headers={"X-Session-ID": "agent-7"},
                **greedy,
            )
            usage = chat.usage
            assert usage is not None and usage.completion_tokens == MAX
            assert usage.total_tokens == usage.prompt_tokens + MAX
            assert chat.choices[0].finish_reason == "length"
            if turn:
                assert usage.prompt_tokens > prompt_tokens[-1]
                assert usage.prompt_tokens_details is not None
                assert usage.prompt_tokens_details.cached_tokens >= 16
            prompt_tokens.append(usage.prompt_tokens)
            messages += [
                {"role": "assistant", "content": chat.choices[0].message.content or ""},
                {"role": "user", "content": f"Tool result {turn}: 2 tests still fail."},
            ]

        # Streaming chat gives the same greedy text as the non-streamed call.
        first = [{"role": "user", "content": "Fix the failing test in parser.py"}]
        plain = client.chat.completions.create(model="tiny-qwen3", messages=first, **greedy)
        text, usage = "", None
        for chunk in client.chat.completions.create(
            model="tiny-qwen3", messages=first, stream=True,
            stream_options={"include_usage": True}, **greedy,
        ):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert text == plain.choices[0].message.content
        assert usage is not None and usage.completion_tokens == MAX
        assert usage.prompt_tokens == plain.usage.prompt_tokens  # type: ignore[union-attr]

        # Completions, on the other models (each call switches the instance's model).
        for model in ("tiny-llama", "tiny-qwen3-moe"):
            done = client.completions.create(model=model, prompt="def parse_args(argv):",
                                              extra_headers={"X-Session-ID": f"c-{model}"},
                                              **greedy)
            assert done.usage is not None and done.usage.completion_tokens == MAX
            streamed = "".join(
                c.choices[0].text for c in client.completions.create(
                    model=model, prompt="def parse_args(argv):", stream=True, **greedy)
                if c.choices
            )
            assert streamed == done.choices[0].text

        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError):  # beyond any context (a max_tokens that is not,
            client.completions.create(model="tiny-llama", prompt="x" * 50, max_tokens=10**8)  # is clamped)
    finally:
        code = serve.stop()
    assert code == 0, serve.log()
    left = [pid for pid in pids if pid_alive(pid)]
    assert not left, f"processes left behind after SIGINT: {left}"
