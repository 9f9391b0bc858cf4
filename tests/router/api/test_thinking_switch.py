"""A request switches a reasoning model's thinking off (and on), over HTTP, on the tiny models'
tokenizer with three hand-written templates that read the switch as real ones do: Qwen3's
(``enable_thinking`` off: an empty ``<think>\\n\\n</think>\\n\\n`` after the generation prompt;
on: the model writes ``<think>`` itself, parser ``qwen3``), one that opens ``<think>`` in the
prompt (Qwen3.5's; the same empty block when off, parser ``deepseek_r1``), and one that thinks
only when ``thinking`` is set (DeepSeek-V3.1's). Thinking off (chat ``chat_template_kwargs`` or
``reasoning_effort``, Anthropic ``thinking`` absent or disabled, Responses ``reasoning.effort``
``none`` / ``minimal``), the prompt is rendered so and the whole answer is content under either
parser; a template that does not read the switch keeps the model thinking, its reasoning split
as before."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import anthropic
import pytest
from aiohttp.test_utils import TestClient
from api_helpers import scripted, serve, sse
from openai.types.responses import Response
from router_fakes import ScriptedInstance

from router.tokenization import ModelTokenizer

REASONING = "The user greets me; I say hello back.\n"
CONTENT = "Hello there."
USER = [{"role": "user", "content": "Hi"}]
OFF = {"enable_thinking": False}
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # what a template writes with thinking off
TINY_GENERATION = "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
SWITCH = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
GENERATIONS = {
    "qwen3": "{{- '<|im_start|>assistant\\n' }}" + SWITCH + "{%- endif %}{%- endif %}",
    "opens_think": "{{- '<|im_start|>assistant\\n' }}" + SWITCH + "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}",
}
# DeepSeek-V3.1's: thinking off unless the request sets ``thinking``; on, <think> opens in the prompt
THINKING_KEY = ("{{- '<|im_start|>assistant\\n' }}{%- if thinking is defined and thinking %}{{- '<think>' }}"
                "{%- else %}{{- '</think>' }}{%- endif %}{%- endif %}")
# what each model writes when it thinks (the second's template opened <think> for it)
THOUGHT = {"qwen3": f"<think>\n{REASONING}</think>\n\n{CONTENT}", "opens_think": f"{REASONING}</think>\n\n{CONTENT}"}


def with_generation(tok: ModelTokenizer, generation: str) -> ModelTokenizer:
    """The tiny tokenizer with ``generation`` as its chat template's generation prompt."""
    hf = copy.deepcopy(tok.tokenizer)
    hf.chat_template = (tok.chat_template or "").replace(TINY_GENERATION, generation)
    assert hf.chat_template != tok.chat_template
    return ModelTokenizer("tiny", hf, 4096)


@pytest.fixture(scope="module", params=sorted(GENERATIONS))
def switch(request: pytest.FixtureRequest, tiny_tokenizer: ModelTokenizer) -> tuple[str, ModelTokenizer]:
    """(the template's kind, the tiny tokenizer with its generation prompt)."""
    return request.param, with_generation(tiny_tokenizer, GENERATIONS[request.param])


def rendered(tok: ModelTokenizer, **kwargs: Any) -> str:
    """The prompt's text as transformers renders it (the oracle, apart from the router's code)."""
    text: str = tok.tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **kwargs)
    return text


def prompt_text(tok: ModelTokenizer, instance: ScriptedInstance, i: int = 0) -> str:
    text: str = tok.tokenizer.decode(instance.calls[i].prompt_token_ids, skip_special_tokens=False)
    return text


async def post(client: TestClient, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    resp = await client.post(path, json={"model": "tiny", **body})
    assert resp.status == status, await resp.text()
    data: dict[str, Any] = await resp.json()
    return data


async def test_chat_template_kwargs_switch_thinking_off_and_the_answer_is_all_content(
        switch: tuple[str, ModelTokenizer]) -> None:
    kind, tok = switch
    instance = scripted(tok, CONTENT, CONTENT, THOUGHT[kind])
    async with serve(tok, {"i0": instance}) as client:
        data = await post(client, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": OFF})
        chunks = await sse(await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": USER, "chat_template_kwargs": OFF, "stream": True}))
        thinking = await post(client, "/v1/chat/completions", {"messages": USER})
    assert rendered(tok, enable_thinking=False).endswith(CLOSED) and not rendered(tok).endswith(CLOSED)
    assert prompt_text(tok, instance, 0) == prompt_text(tok, instance, 1) == rendered(tok, enable_thinking=False)
    assert prompt_text(tok, instance, 2) == rendered(tok)
    assert data["choices"][0]["message"] == {"role": "assistant", "content": CONTENT, "reasoning": None,
                                             "reasoning_content": None}
    assert data["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    deltas = [c["choices"][0]["delta"] for c in chunks if c != "[DONE]" and c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == CONTENT
    assert not any(d.get("reasoning") for d in deltas)
    message = thinking["choices"][0]["message"]  # not switched off: thinks as before
    assert (message["reasoning_content"], message["content"]) == (REASONING, CONTENT)


async def test_a_template_that_does_not_read_the_switch_keeps_the_model_thinking(
        tiny_tokenizer: ModelTokenizer) -> None:
    """Asked not to think, a model whose template ignores ``enable_thinking`` thinks anyway:
    its ``<think>`` text is still its reasoning, never the answer's content."""
    answer = f"<think>\n{REASONING}</think>\n\n{CONTENT}"
    instance = scripted(tiny_tokenizer, answer)
    async with serve(tiny_tokenizer, {"i0": instance}, reasoning_parsers={"tiny": "qwen3"}) as client:
        data = await post(client, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": OFF})
    assert prompt_text(tiny_tokenizer, instance) == rendered(tiny_tokenizer)
    message = data["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (REASONING, CONTENT)


async def test_any_other_key_reaches_the_template(tiny_tokenizer: ModelTokenizer) -> None:
    hf = copy.deepcopy(tiny_tokenizer.tokenizer)
    hf.chat_template = (tiny_tokenizer.chat_template or "") + "{%- if house_style is defined %}{{- house_style }}{%- endif %}"
    tok = ModelTokenizer("tiny", hf, 4096)
    instance = scripted(tok, CONTENT)
    async with serve(tok, {"i0": instance}) as client:
        await post(client, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"house_style": "terse"}})
    assert prompt_text(tok, instance).endswith("<|im_start|>assistant\nterse")


@pytest.mark.parametrize(("extra", "param", "needle"), [
    ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", "set by the server"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "set by the server"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt",
     "set by the server"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize", "set by the server"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs.chat_template",
     "set by the server"),
    ({"chat_template_kwargs": {"bos_token": "<s>"}}, "chat_template_kwargs.bos_token", "set by the server"),
    ({"enable_thinking": False}, "enable_thinking", "unsupported field(s): enable_thinking"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "reasoning_effort must be one of"),
    ({"reasoning_effort": ["none"]}, "reasoning_effort", "reasoning_effort must be one of"),
])
async def test_chat_template_kwargs_that_cannot_be_passed_are_refused_by_name(
        tiny_tokenizer: ModelTokenizer, extra: dict[str, Any], param: str, needle: str) -> None:
    instance = scripted(tiny_tokenizer, CONTENT)
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        error = (await post(client, "/v1/chat/completions", {"messages": USER, **extra}, 400))["error"]
        await post(client, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": None})
    assert error["param"] == param and needle in error["message"]
    assert len(instance.calls) == 1  # only the one with chat_template_kwargs null, as absent


def test_every_argument_transformers_renders_with_is_refused() -> None:
    """The refused keys hold every named argument of ``apply_chat_template`` in the installed
    transformers (a new one there fails this test) and the special tokens it passes."""
    from transformers import PreTrainedTokenizerBase

    from router.api.template_kwargs import RENDERER_ARGUMENTS

    signature = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    named = {p.name for p in signature if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}
    assert named | set(PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES) <= RENDERER_ARGUMENTS
    assert {"messages", "conversation", "tools"} <= RENDERER_ARGUMENTS
    assert not {"enable_thinking", "thinking"} & RENDERER_ARGUMENTS


async def test_chat_reasoning_effort_none_switches_thinking_off_and_chat_template_kwargs_win(
        switch: tuple[str, ModelTokenizer]) -> None:
    kind, tok = switch
    instance = scripted(tok, CONTENT, THOUGHT[kind], THOUGHT[kind])
    async with serve(tok, {"i0": instance}) as client:
        off = await post(client, "/v1/chat/completions", {"messages": USER, "reasoning_effort": "none"})
        await post(client, "/v1/chat/completions", {"messages": USER, "reasoning_effort": "high"})
        await post(client, "/v1/chat/completions", {"messages": USER, "reasoning_effort": "none",
                                                   "chat_template_kwargs": {"enable_thinking": True}})
    assert prompt_text(tok, instance, 0) == rendered(tok, enable_thinking=False)
    assert prompt_text(tok, instance, 1) == prompt_text(tok, instance, 2) == rendered(tok)
    assert off["choices"][0]["message"]["content"] == CONTENT


async def test_the_tag_the_prompt_ends_with_decides_where_the_answer_starts(tiny_tokenizer: ModelTokenizer) -> None:
    """A template whose default prompt opens no ``<think>`` gets ``qwen3`` (DeepSeek-V3.1's,
    which reads ``thinking``), yet switched on it opens ``<think>`` in the prompt: the answer
    then begins inside its reasoning; off, it writes ``</think>``: the answer is content."""
    tok = with_generation(tiny_tokenizer, THINKING_KEY)
    instance = scripted(tok, THOUGHT["opens_think"], CONTENT)
    async with serve(tok, {"i0": instance}) as client:
        on = await post(client, "/v1/chat/completions", {"messages": USER, "reasoning_effort": "high"})
        off = await post(client, "/v1/chat/completions", {"messages": USER})
    assert prompt_text(tok, instance, 0).endswith("<|im_start|>assistant\n<think>")
    assert prompt_text(tok, instance, 1).endswith("<|im_start|>assistant\n</think>")
    message = on["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (REASONING, CONTENT)
    assert off["choices"][0]["message"] == {"role": "assistant", "content": CONTENT, "reasoning": None,
                                            "reasoning_content": None}


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}])
async def test_anthropic_without_thinking_renders_it_off_and_the_answer_is_its_text(
        switch: tuple[str, ModelTokenizer], thinking: dict[str, Any] | None) -> None:
    """Anthropic's default is no extended thinking: the model is asked not to think (it
    spends no tokens on hidden thinking), and its whole answer is the text."""
    _, tok = switch
    body: dict[str, Any] = {"messages": USER, "max_tokens": 100, **({"thinking": thinking} if thinking else {})}
    instance = scripted(tok, CONTENT)
    async with serve(tok, {"i0": instance}) as client:
        reply = await post(client, "/v1/messages", body)
        counted = await post(client, "/v1/messages/count_tokens", body)
    assert prompt_text(tok, instance) == rendered(tok, enable_thinking=False)
    assert counted == {"input_tokens": len(instance.calls[0].prompt_token_ids)}
    assert reply["content"] == [{"type": "text", "text": CONTENT}]
    assert reply["stop_reason"] == "end_turn"


@pytest.mark.parametrize("kind", ["enabled", "adaptive"])
async def test_anthropic_thinking_enabled_renders_it_on_and_shows_it(
        switch: tuple[str, ModelTokenizer], kind: str) -> None:
    name, tok = switch
    thinking: Any = {"type": "enabled", "budget_tokens": 1024} if kind == "enabled" else {"type": "adaptive"}
    async with serve(tok, {"i0": scripted(tok, THOUGHT[name], THOUGHT[name])}) as http:
        client = anthropic.AsyncAnthropic(base_url=str(http.server.make_url("/")), api_key="x", max_retries=0)
        try:
            reply = await client.messages.create(model="tiny", max_tokens=200, messages=USER, thinking=thinking)
            async with client.messages.stream(model="tiny", max_tokens=200, messages=USER,
                                              thinking=thinking) as stream:
                streamed = await stream.get_final_message()
        finally:
            await client.close()
    for message in (reply, streamed):
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
            ("thinking", REASONING), ("text", CONTENT)]


async def test_anthropic_thinking_switches_on_a_template_that_thinks_only_when_asked(
        tiny_tokenizer: ModelTokenizer) -> None:
    """DeepSeek-V3.1's template does not think unless ``thinking`` is set: enabled thinking
    sets it (the prompt opens ``<think>``), and the thinking comes back as its block."""
    tok = with_generation(tiny_tokenizer, THINKING_KEY)
    instance = scripted(tok, THOUGHT["opens_think"], CONTENT)
    async with serve(tok, {"i0": instance}) as client:
        on = await post(client, "/v1/messages", {"messages": USER, "max_tokens": 100,
                                                 "thinking": {"type": "enabled", "budget_tokens": 1024}})
        off = await post(client, "/v1/messages", {"messages": USER, "max_tokens": 100})
    assert prompt_text(tok, instance, 0).endswith("<|im_start|>assistant\n<think>")
    assert prompt_text(tok, instance, 1).endswith("<|im_start|>assistant\n</think>")
    assert on["content"] == [{"type": "thinking", "thinking": REASONING, "signature": ""},
                             {"type": "text", "text": CONTENT}]
    assert off["content"] == [{"type": "text", "text": CONTENT}]


@pytest.mark.parametrize("effort", ["none", "minimal"])
async def test_responses_effort_none_or_minimal_switches_thinking_off(
        switch: tuple[str, ModelTokenizer], effort: str) -> None:
    kind, tok = switch
    instance = scripted(tok, CONTENT, THOUGHT[kind])
    async with serve(tok, {"i0": instance}) as client:
        off = await post(client, "/v1/responses", {"input": "Hi", "reasoning": {"effort": effort}})
        on = await post(client, "/v1/responses", {"input": "Hi", "reasoning": {"effort": "medium", "summary": "auto"}})
    assert prompt_text(tok, instance, 0) == rendered(tok, enable_thinking=False)
    assert prompt_text(tok, instance, 1) == rendered(tok)
    assert [i["type"] for i in off["output"]] == ["message"]
    assert off["output"][0]["content"][0]["text"] == CONTENT
    assert off["reasoning"]["effort"] == effort
    Response.model_validate(off)
    assert [i["type"] for i in on["output"]] == ["reasoning", "message"]
    assert on["reasoning"]["effort"] == "medium"


async def test_responses_refuses_an_unknown_effort_by_name(tiny_tokenizer: ModelTokenizer) -> None:
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, CONTENT)}) as client:
        error = (await post(client, "/v1/responses", {"input": "Hi", "reasoning": {"effort": "extreme"}}, 400))["error"]
    assert error["param"] == "reasoning.effort" and "must be one of" in error["message"]


async def _conversation(client: TestClient, path: str, turns: list[dict[str, Any]],
                        headers: dict[str, str] | None = None, first: str = "Hi") -> list[str]:
    """One conversation of ``len(turns)`` calls (naming no session unless ``headers`` do), each
    with its turn's extra fields, every answer and a tool-like result sent back; the session
    each call was put in."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
    sessions = []
    for n, extra in enumerate(turns):
        resp = await client.post(path, headers=headers,
                                 json={"model": "tiny", "messages": messages, "max_tokens": 100, **extra})
        assert resp.status == 200, await resp.text()
        data = await resp.json()
        sessions.append(resp.headers["X-Session-ID"])
        text = (data["choices"][0]["message"]["content"] if "choices" in data
                else "".join(b["text"] for b in data["content"] if b["type"] == "text"))
        messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": f"result {n}"}]
    return sessions


@pytest.mark.parametrize("turns", [
    pytest.param([{"chat_template_kwargs": OFF}] * 3, id="off"),
    pytest.param([{}] * 3, id="on"),
    pytest.param([{}, {"reasoning_effort": "none"}, {}, {"reasoning_effort": "none"}], id="on-off-on-off"),
])
async def test_a_conversation_naming_no_session_is_one_inferred_session_whatever_its_thinking(
        switch: tuple[str, ModelTokenizer], turns: list[dict[str, Any]]) -> None:
    """A call that names no session joins the one whose last prompt its own repeats. A think
    block the template writes after the generation prompt (an empty one with thinking off;
    ``<think>`` opened with it on, Qwen3.5's) is in no later turn's rendering of that answer:
    the next prompt repeats the last one but for it, and must still join its session (it
    started a new session per call, each a tentative first call: no reservation, ever)."""
    kind, tok = switch
    answers = [CONTENT if "chat_template_kwargs" in t or "reasoning_effort" in t else THOUGHT[kind] for t in turns]
    instance = scripted(tok, *answers)
    async with serve(tok, {"i0": instance}) as client:
        sessions = await _conversation(client, "/v1/chat/completions", turns)
    assert sessions == [sessions[0]] * len(turns)


async def test_an_anthropic_conversation_without_thinking_is_one_inferred_session(
        switch: tuple[str, ModelTokenizer]) -> None:
    """Anthropic's default, no ``thinking``, renders every prompt with thinking off."""
    _, tok = switch
    instance = scripted(tok, CONTENT)
    async with serve(tok, {"i0": instance}) as client:
        sessions = await _conversation(client, "/v1/messages", [{}] * 3)
    assert sessions == [sessions[0]] * 3


@pytest.mark.parametrize(("path", "turn", "first"), [
    pytest.param("/v1/chat/completions", {"chat_template_kwargs": OFF}, "Hi", id="chat-short"),
    pytest.param("/v1/messages", {}, "Hi", id="anthropic-short"),
    pytest.param("/v1/messages", {"messages": None}, "Fix the failing test in the tiny model. " * 8,
                 id="anthropic-prefill"),
])
async def test_a_named_sessions_calls_with_thinking_off_stay_on_its_main_chain(
        switch: tuple[str, ModelTokenizer], path: str, turn: dict[str, Any], first: str) -> None:
    """A named session's call joins the chain (branch) whose last prompt it repeats, all of
    it under one block, else all its full blocks but perhaps the last. Thinking off, the empty
    think block (and a prefill after it) is in no later prompt: a short prompt, or a prefill
    longer than a block's tail, made each call a new branch, its KV and reservation under
    ``<session>#<n>`` as if a side call, and every call tentative after the first."""
    _, tok = switch
    instance = scripted(tok, CONTENT)
    prefill = "Sure, here is the plan for the fix in three steps, then the patch itself:"
    turns = [dict(turn) for _ in range(3)]
    for t in turns:
        t.pop("messages", None)
    async with serve(tok, {"i0": instance}) as client:
        if "messages" in turn:  # the client prefills each answer: a final assistant turn
            messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
            for n in range(3):
                body = {"model": "tiny", "max_tokens": 100,
                        "messages": [*messages, {"role": "assistant", "content": prefill}]}
                resp = await client.post(path, headers={"x-session-id": "s1"}, json=body)
                assert resp.status == 200, await resp.text()
                text = "".join(b["text"] for b in (await resp.json())["content"] if b["type"] == "text")
                messages = [*messages, {"role": "assistant", "content": prefill + text},
                            {"role": "user", "content": f"result {n}"}]
        else:
            await _conversation(client, path, turns, {"x-session-id": "s1"}, first)
    assert [c.session_id for c in instance.calls] == ["s1"] * 3
    assert [c.last_call for c in instance.calls] == [False] * 3
