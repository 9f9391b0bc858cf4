"""Agents' APIs against a live `talaria serve` on the tiny models (real engines, random
weights): tools through the chat template with the openai client, the Messages API with the
anthropic client, agents' session headers and sessions inferred from prompts. A random model
writes no valid tool call, so forced calls come back as text, never as an error."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest
from serve_process import start_serve

from engine.models.tiny import CHAT_TEMPLATE
from router.app import CONFIG_KEY
from talaria.cli import _router_app
from talaria.paths import default_models_dir, ensure_tiny_models
from talaria.serving.config import ConfigError, load_serve_config

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
GREEDY = {"temperature": 0.0, "max_tokens": 6}


def test_a_catalog_written_before_tools_gets_the_current_template(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TALARIA_CACHE", str(tmp_path))
    paths = ensure_tiny_models()
    old = paths["tiny-llama"] / "chat_template.jinja"
    old.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    weights = sorted(p.stat().st_mtime_ns for p in default_models_dir().glob("*/*.safetensors"))
    ensure_tiny_models()
    assert old.read_text() == CHAT_TEMPLATE
    assert sorted(p.stat().st_mtime_ns for p in default_models_dir().glob("*/*.safetensors")) == weights

    # The serve config names the router's session headers, inference and a model's tool format.
    toml = tmp_path / "serve.toml"
    toml.write_text(f'[router]\ninfer_sessions = false\nsession_headers = ["x-my-session"]\n'
                    f'max_tokens_overflow = "refuse"\n'
                    f'[models.m]\npath = "{paths["tiny-llama"]}"\ntool_format = "hermes"\n'
                    f'max_tokens_overflow = "clamp"\n')
    config = load_serve_config(toml)
    router = _router_app(config, {"i0": "http://127.0.0.1:1"})[CONFIG_KEY]
    assert router.session_headers.session == ("x-my-session",) and not router.infer_sessions
    assert router.tool_formats == {"m": "hermes"}
    assert router.overflow_rule("m") == "clamp" and router.max_tokens_overflow == "refuse"
    toml.write_text('[router]\nmax_tokens_overflow = "truncate"\n')
    with pytest.raises(ConfigError, match="max_tokens_overflow"):
        load_serve_config(toml)
    toml.write_text('[router]\nsession_headers = "x-one"\n')
    with pytest.raises(ConfigError, match="session_headers"):
        load_serve_config(toml)


@pytest.mark.slow
def test_agents_against_talaria_serve(serve_cache: Path) -> None:
    serve = start_serve(serve_cache)
    try:
        client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Read parser.py"}]
        for choice in ("auto", "required", {"type": "function", "function": {"name": "read_file"}}):
            reply = client.chat.completions.create(model="tiny-qwen3", messages=messages, tools=TOOLS,
                                                   tool_choice=choice, **GREEDY)
            message = reply.choices[0].message
            for call in message.tool_calls or []:
                assert isinstance(json.loads(call.function.arguments), dict)
            assert message.tool_calls or message.content is not None

        # Sessions inferred: the second call extends the first (its prompt + answer + a result).
        first = client.chat.completions.with_raw_response.create(model="tiny-qwen3", messages=messages, **GREEDY)
        answer = first.parse().choices[0].message.content or ""
        more = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and now?"}]
        second = client.chat.completions.with_raw_response.create(model="tiny-qwen3", messages=more, **GREEDY)
        session = first.headers["x-session-id"]
        assert session.startswith("inferred-") and second.headers["x-session-id"] == session
        assert (second.parse().usage.prompt_tokens_details.cached_tokens or 0) >= 16

        root = serve.url.removesuffix("/v1")
        claude = anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0, timeout=60)
        headers = {"x-claude-code-session-id": "cc-1"}
        msg = claude.messages.with_raw_response.create(
            model="tiny-llama", max_tokens=6, system="You are terse.",
            messages=[{"role": "user", "content": "Fix the bug"}], extra_headers=headers)
        assert msg.headers["x-session-id"] == "cc-1"
        parsed = msg.parse()
        assert parsed.stop_reason in ("end_turn", "max_tokens") and parsed.usage.output_tokens <= 6
        with claude.messages.stream(model="tiny-llama", max_tokens=6, messages=[
                {"role": "user", "content": "Fix the bug"}], tools=[{
                    "name": "read_file", "input_schema": TOOLS[0]["function"]["parameters"]}],
                tool_choice={"type": "any"}, extra_headers=headers) as stream:
            final = stream.get_final_message()
        assert final.content and final.stop_reason in ("tool_use", "max_tokens", "end_turn")
        counted = claude.messages.count_tokens(model="tiny-llama", system="You are terse.",
                                               messages=[{"role": "user", "content": "Fix the bug"}])
        assert counted.input_tokens == parsed.usage.input_tokens + (parsed.usage.cache_read_input_tokens or 0)
    finally:
        code = serve.stop()
    assert code == 0, serve.log()
