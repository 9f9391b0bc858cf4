"""The tool-call parser: Hermes/Qwen ``<tool_call>`` blocks found in streamed text, the same
calls however the text is split, malformed calls returned as text; the tiny models' chat
template rendering tools and tool turns."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from router.api.answer_parser import AnswerParser, ToolCall
from router.api.tool_calls import (
    TOOL_FORMATS,
    HermesToolParser,
    ParsedToolCall,
    ToolOutput,
    detect_tool_format,
)
from router.tokenization import ModelTokenizer

TWO_CALLS = (
    "I'll check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln <3"}}\n</tool_call>'
)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & here",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _feed(text: str, cuts: list[int] | None = None) -> ToolOutput:
    """Feed ``text`` cut at ``cuts`` (None: whole), then finish; merged output."""
    parser = HermesToolParser()
    out = ToolOutput()
    bounds = sorted({c % (len(text) + 1) for c in cuts or []} | {0, len(text)})
    for a, b in zip(bounds, bounds[1:], strict=False):
        for item in parser.feed(text[a:b]).items:
            out.add_text(item) if isinstance(item, str) else out.items.append(item)
    for item in parser.finish().items:
        out.add_text(item) if isinstance(item, str) else out.items.append(item)
    return out


def test_text_and_parallel_calls() -> None:
    out = _feed(TWO_CALLS)
    assert out.text == "I'll check both."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Köln <3"})]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
       st.sampled_from([TWO_CALLS, "plain answer, no calls  ", "a <tool_ call> lookalike <tool_call",
                        TWO_CALLS + "\nand then some text", '<tool_call>{"name": "f"}</tool_call>x']))
def test_any_split_gives_the_whole_text_answer(cuts: list[int], text: str) -> None:
    assert _feed(text, cuts).items == _feed(text).items


def test_content_is_released_before_the_call_closes() -> None:
    parser = HermesToolParser()
    assert parser.feed("Let me look").items == ["Let me look"]
    assert parser.feed(" it up.\n<tool_").items == [" it up."]  # "\n<tool_" held: may open a call
    assert parser.feed('call>\n{"name": "f", "arguments": {}}').items == []
    assert parser.feed("\n</tool_call>").items == [ParsedToolCall("f", "{}")]
    assert parser.finish().items == []


def test_malformed_calls_come_back_as_text() -> None:
    bad_json = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>'
    assert _feed(bad_json).items == [bad_json]
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert _feed(no_name).items == [no_name]
    not_object_args = '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
    assert _feed(not_object_args).items == [not_object_args]
    cut_short = 'ok <tool_call>{"name": "f", "argu'  # the answer ended mid-call (max_tokens)
    assert _feed(cut_short).items == [cut_short]


def test_a_final_call_left_open_still_counts_and_string_arguments_are_decoded() -> None:
    out = _feed('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert out.calls == [ParsedToolCall("f", '{"a": 1}')] and out.text == ""


def test_forced_function_prefix_and_parallel_off() -> None:
    fmt = TOOL_FORMATS["hermes"]
    answer = AnswerParser(fmt, function="get_weather", parallel=False, id_prefix="toolu_")
    assert answer.prefill == '<tool_call>\n{"name": "get_weather", "arguments":'
    items = answer.parse(' {"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "g"}</tool_call>')
    assert len(items) == 1 and isinstance(items[0], ToolCall)
    assert items[0].id.startswith("toolu_") and items[0].arguments_object() == {"city": "Paris"}
    assert answer.dropped_calls == 1 and answer.finish_reason("length") == "tool_calls"
    required = AnswerParser(fmt, any_call=True)
    assert required.prefill == "<tool_call>\n"
    assert required.parse("not json at all") == ["<tool_call>\nnot json at all"]
    assert required.finish_reason("stop") == "stop"


def test_tiny_template_renders_tools_and_tool_turns(tiny_tokenizer: ModelTokenizer) -> None:
    assert detect_tool_format(tiny_tokenizer.chat_template) == "hermes"
    assert detect_tool_format("{{ messages }}") is None
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    then = first + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ]
    text = tiny_tokenizer.tokenizer.apply_chat_template(
        then, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": ' \
           '"Weather <now> & here"' in text  # transformers' tojson: key order kept, no escaping
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>" in text
    # Each call's prompt extends the previous call's, token for token.
    before = tiny_tokenizer.encode_chat(first, [WEATHER_TOOL])
    after = tiny_tokenizer.encode_chat(then, [WEATHER_TOOL])
    assert after[: len(before)] == before
    forced = tiny_tokenizer.encode_chat(first, [WEATHER_TOOL], TOOL_FORMATS["hermes"].forced_prefix("get_weather"))
    assert after[: len(forced)] == forced
    plain = tiny_tokenizer.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_long_call_fed_a_character_at_a_time_is_the_same_call() -> None:
    text = '<tool_call>{"name": "write", "arguments": {"text": "' + "x</tool_cal" * 400 + '"}}</tool_call> ok'
    whole = _feed(text)
    assert [c.name for c in whole.calls] == ["write"] and whole.text == "ok"
    assert _feed(text, list(range(len(text)))).items == whole.items


def test_half_a_surrogate_pair_in_arguments_reaches_a_client_as_u_fffd() -> None:
    """JSON may escape half a surrogate pair; no client can be sent one (orjson refuses it,
    so the answer was a 500). A call's arguments object and a re-written arguments text
    carry U+FFFD for it, a whole pair stays the character it encodes."""
    import orjson
    whole = ParsedToolCall("f", '{"a": ["x\\ud83d", {"\\udc00k": "\\ud83d\\ude00"}]}')
    assert orjson.dumps(whole.arguments_object())  # it raised
    assert whole.arguments_object() == {"a": ["x\ufffd", {"\ufffdk": "\U0001F600"}]}
    out = _feed('<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"\\\\ud83d!\\"}"}</tool_call>')
    assert out.calls == [ParsedToolCall("f", '{"a": "\ufffd!"}')]
    assert orjson.dumps(out.calls[0].arguments)
