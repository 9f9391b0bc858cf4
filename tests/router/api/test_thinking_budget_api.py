"""A thinking budget reaches the instance's call: Anthropic's ``thinking.budget_tokens`` (when
enabled, an integer >= 0; anything else caps nothing, as before) and chat's
``thinking_token_budget`` (vLLM's; a bad value is a 400 naming it) set the call's
``thinking_budget``, with the ids of ``</think>`` in the model's vocabulary (its own token when
it has one, else its encoding) and where the thinking starts: at once when the prompt (or a
prefill) opened ``<think>``, else after the model writes it. An answer that starts as content
(thinking switched off, a prefill past ``</think>``) or a model without a reasoning parser
gets no budget. The tokenizer is the tiny models', with the generation prompts of
``test_thinking_switch``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from api_helpers import scripted, serve
from test_thinking_switch import CONTENT, GENERATIONS, OFF, USER, post, with_generation

from router.tokenization import ModelTokenizer
from talaria.protocol import SamplingParams

ENABLED = {"type": "enabled", "budget_tokens": 1024}


def with_think_tokens(tok: ModelTokenizer) -> ModelTokenizer:
    """``tok`` with ``<think>`` and ``</think>`` as tokens of their own, as in Qwen3's vocabulary."""
    hf = copy.deepcopy(tok.tokenizer)
    hf.add_tokens(["<think>", "</think>"])
    return ModelTokenizer("tiny", hf, 4096)


def encoded(tok: ModelTokenizer, text: str) -> list[int]:
    ids: list[int] = tok.tokenizer.encode(text, add_special_tokens=False)
    return ids


async def sent(tok: ModelTokenizer, path: str, body: dict[str, Any], **config: Any) -> SamplingParams:
    """The sampling settings of the call one request sends to its instance."""
    instance = scripted(tok, CONTENT)
    async with serve(tok, {"i0": instance}, **config) as client:
        await post(client, path, body)
    params: SamplingParams = instance.calls[0].params
    return params


@pytest.mark.parametrize("own_tokens", [False, True])
@pytest.mark.parametrize("kind", sorted(GENERATIONS))
async def test_anthropic_budget_tokens_reach_the_call_with_the_end_of_thinking_ids(
        tiny_tokenizer: ModelTokenizer, kind: str, own_tokens: bool) -> None:
    tok = with_generation(tiny_tokenizer, GENERATIONS[kind])
    tok = with_think_tokens(tok) if own_tokens else tok
    params = await sent(tok, "/v1/messages", {"messages": USER, "max_tokens": 2048, "thinking": ENABLED})
    hf = tok.tokenizer
    assert params.thinking_budget == 1024
    assert hf.decode(params.thinking_end_ids) == "</think>"
    if own_tokens:
        assert params.thinking_end_ids == [hf.convert_tokens_to_ids("</think>")] == [len(hf) - 1]
    else:
        assert params.thinking_end_ids == encoded(tok, "</think>") and len(params.thinking_end_ids) > 1
    opened = kind == "opens_think"  # its prompt opened <think>: the answer starts inside it
    assert params.thinking_from_start is opened
    assert params.thinking_start_ids == ([] if opened else
                                         [len(hf) - 2] if own_tokens else encoded(tok, "<think>"))


@pytest.mark.parametrize("thinking", [
    None, {"type": "disabled"}, {"type": "adaptive"}, {"type": "enabled"},
    {"type": "enabled", "budget_tokens": "lots"}, {"type": "enabled", "budget_tokens": -5},
    {"type": "enabled", "budget_tokens": True}, {"type": "enabled", "budget_tokens": 10.5},
    {"type": "disabled", "budget_tokens": 1024},
])
async def test_anthropic_without_a_readable_enabled_budget_caps_nothing(
        tiny_tokenizer: ModelTokenizer, thinking: dict[str, Any] | None) -> None:
    tok = with_generation(tiny_tokenizer, GENERATIONS["opens_think"])
    body: dict[str, Any] = {"messages": USER, "max_tokens": 100, **({"thinking": thinking} if thinking else {})}
    params = await sent(tok, "/v1/messages", body)
    assert params.thinking_budget is None and not params.thinking_end_ids


@pytest.mark.parametrize(("prefill", "budgeted", "inside"), [
    ("<think>Let me see", True, True),  # the answer continues the opened thinking
    ("  ", True, False),  # whitespace: the model may still open it
    ("<think>Done.</think>", False, False),  # the thinking is over: content
    ("Sure", False, False),  # qwen3: an answer that did not open <think> is content
])
async def test_an_anthropic_prefill_sets_where_the_thinking_starts(
        tiny_tokenizer: ModelTokenizer, prefill: str, budgeted: bool, inside: bool) -> None:
    tok = with_generation(tiny_tokenizer, GENERATIONS["qwen3"])
    messages = [*USER, {"role": "assistant", "content": prefill}]
    params = await sent(tok, "/v1/messages", {"messages": messages, "max_tokens": 2048, "thinking": ENABLED})
    assert params.thinking_budget == (1024 if budgeted else None)
    assert params.thinking_from_start is inside


async def test_chat_thinking_token_budget_caps_the_thinking_unless_it_is_switched_off(
        tiny_tokenizer: ModelTokenizer) -> None:
    tok = with_generation(tiny_tokenizer, GENERATIONS["opens_think"])
    on = await sent(tok, "/v1/chat/completions", {"messages": USER, "thinking_token_budget": 0})
    off = await sent(tok, "/v1/chat/completions", {"messages": USER, "thinking_token_budget": 5,
                                                   "chat_template_kwargs": OFF})
    unset = await sent(tok, "/v1/chat/completions", {"messages": USER, "thinking_token_budget": None})
    unlimited = await sent(tok, "/v1/chat/completions", {"messages": USER, "thinking_token_budget": -1})
    assert (on.thinking_budget, on.thinking_end_ids, on.thinking_from_start) == (0, encoded(tok, "</think>"), True)
    assert off.thinking_budget is None and unset.thinking_budget is None
    assert unlimited.thinking_budget is None  # vLLM's -1: unlimited


async def test_a_model_without_a_reasoning_parser_gets_no_budget(tiny_tokenizer: ModelTokenizer) -> None:
    tok = with_generation(tiny_tokenizer, GENERATIONS["opens_think"])
    chat = await sent(tok, "/v1/chat/completions", {"messages": USER, "thinking_token_budget": 5},
                      reasoning_parsers={"tiny": "none"})
    messages = await sent(tok, "/v1/messages", {"messages": USER, "max_tokens": 2048, "thinking": ENABLED},
                          reasoning_parsers={"tiny": "none"})
    assert chat.thinking_budget is None and messages.thinking_budget is None


@pytest.mark.parametrize("value", [-2, "5", True, 1.5, [5]])
async def test_a_bad_chat_thinking_token_budget_is_refused_by_name(
        tiny_tokenizer: ModelTokenizer, value: Any) -> None:
    instance = scripted(tiny_tokenizer, CONTENT)
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        error = (await post(client, "/v1/chat/completions",
                            {"messages": USER, "thinking_token_budget": value}, 400))["error"]
    assert error["param"] == "thinking_token_budget" and "integer >= 0" in error["message"]
    assert not instance.calls
