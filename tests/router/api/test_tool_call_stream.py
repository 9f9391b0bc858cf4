"""Tool calls streamed piece by piece (``AnswerParser.feed``): a call announced once its name
is known, its arguments sent as the model writes them, and the pieces joined exactly the
arguments the collected answer (``AnswerParser.parse``) gives for the same text."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.api.answer_parser import (
    AnswerItem,
    AnswerParser,
    ToolCall,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from router.api.tool_calls import TOOL_FORMATS

HERMES = TOOL_FORMATS["hermes"]
WRITE = '{"name": "write", "arguments": {"path": "a.py", "text": "def f():\\n    return {\\"a\\": [1, 2]}\\n"}}'
TWO_CALLS = (
    "I'll check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments":{"city":"K\\u00f6ln <3", "days": [1, 2.5e3]}}\n</tool_call>'
)
TEXTS = [
    TWO_CALLS,
    TWO_CALLS + "\nand then some text",
    f"Writing it.\n<tool_call>\n{WRITE}\n</tool_call>",
    "plain answer, no calls  ",
    "a <tool_ call> lookalike <tool_call",
    '<tool_call>{"name": "f"}</tool_call>x',
    '<tool_call>{"arguments": {"a": 1}, "name": "late"}</tool_call>',  # not canonical: whole at its end
    '<tool_call>{"name": "enc", "arguments": "{\\"a\\": 1}"}</tool_call>',  # string arguments: whole
    '<tool_call>{"name": "f", "arguments": {"x": }}</tool_call> after',  # malformed once announced
    '<tool_call>{"name": "f", "arguments": {"x": "</tool_call>"}}</tool_call>',  # the close inside a string
    'ok <tool_call>{"name": "f", "argu',  # cut short before the arguments began
    'ok <tool_call>{"name": "f", "arguments": {"a": 1',  # cut short inside them
]


def stream(text: str, cuts: list[int], parser: AnswerParser | None = None) -> list[AnswerItem]:
    parser = parser or AnswerParser(HERMES)
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    items: list[AnswerItem] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        items += parser.feed(text[a:b])
    return items + parser.finish()


def summary(items: list[AnswerItem]) -> tuple[str, list[tuple[str, str, str]]]:
    """Content text and (name, joined deltas, state) per call: what a client rebuilds."""
    text = "".join(i for i in items if isinstance(i, str))
    starts = [i for i in items if isinstance(i, ToolCallStart)]
    ends = [i.call for i in items if isinstance(i, ToolCallEnd)]
    assert [s.index for s in starts] == [c.index for c in ends] == list(range(len(ends)))
    assert [s.id for s in starts] == [c.id for c in ends]
    calls = []
    for call in ends:
        joined = "".join(i.arguments for i in items if isinstance(i, ToolCallDelta) and i.index == call.index)
        assert joined == call.arguments
        calls.append((call.name, joined, call.state))
    return text, calls


def whole(text: str) -> tuple[str, list[tuple[str, str, str]]]:
    items = AnswerParser(HERMES).parse(text)
    return ("".join(i for i in items if isinstance(i, str)),
            [(c.name, c.arguments, c.state) for c in items if isinstance(c, ToolCall)])


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(min_value=0, max_value=10_000), max_size=14))
def test_the_stream_joins_to_the_collected_answer_however_it_is_split(text: str, cuts: list[int]) -> None:
    streamed = summary(stream(text, cuts))
    assert streamed == summary(stream(text, []))  # however the text is split
    if all(state == "complete" for _, _, state in streamed[1]):
        assert streamed == whole(text)  # the arguments joined are the collected answer's, exactly


def test_what_a_stream_ends_with_when_an_announced_call_breaks() -> None:
    # A collected answer reads each of these as text (as before); a stream already announced the call.
    malformed = AnswerParser(HERMES)
    items = stream(TEXTS[8], [])
    assert summary(items) == ("after", [("f", '{"x": ', "malformed")])  # the rest of the call is dropped
    assert whole(TEXTS[8]) == (TEXTS[8], [])
    malformed.feed(TEXTS[8][:30])
    assert malformed.failure() is None
    malformed.feed(TEXTS[8][30:])
    assert malformed.failure() == ("the model's tool call 0 ('f') broke off after it was streamed: its text "
                                   "stopped being valid JSON or its closing tag came early")
    # The first closing tag ends a call (as in a collected answer): here it came early.
    assert summary(stream(TEXTS[9], [])) == ('"}}</tool_call>', [("f", '{"x": "', "malformed")])

    for reason, failure in [("length", None), ("stop", "the answer ended inside tool call 0 ('f') after it was streamed")]:
        cut = AnswerParser(HERMES)
        assert summary(stream(TEXTS[11], [], cut)) == ("ok", [("f", '{"a": 1', "cut_short")])
        assert cut.failure(reason) == failure
        assert cut.finish_reason(reason) == reason  # never tool_calls with a call unfinished
    assert summary(stream(TEXTS[10], [])) == whole(TEXTS[10]) == (TEXTS[10], [])  # never announced: text


def test_an_answer_cut_inside_a_whole_call_s_closing_tag_ends_the_call_as_without_the_tag() -> None:
    """The call's JSON closed, then the answer ended (its token limit, a stop string) part
    way into the closing tag: the call is whole, as when the answer ends before the tag,
    streamed and collected; the partial tag is no character that breaks its JSON."""
    for tail in ("", "\n", "\n<", "\n</tool_", "</tool_call"):
        text = f'ok <tool_call>\n{{"name": "f", "arguments": {{"a": 1}}}}{tail}'
        for cut in range(len(text) + 1):
            parser = AnswerParser(HERMES)
            assert summary(stream(text, [cut], parser)) == whole(text) == ("ok", [("f", '{"a": 1}', "complete")])
            assert parser.failure("length") is None and parser.finish_reason("length") == "tool_calls"


def test_argument_pieces_arrive_before_the_closing_tag() -> None:
    """Fed a character at a time, as tokens come: the call starts once its arguments object
    opens, and every piece of them is out before the closing tag is written."""
    parser = AnswerParser(HERMES)
    text = f"Writing it.\n<tool_call>\n{WRITE}\n</tool_call>"
    close = text.index("</tool_call>")
    seen: list[tuple[int, AnswerItem]] = []
    for at, char in enumerate(text):
        seen += [(at, item) for item in parser.feed(char)]
    seen += [(len(text), item) for item in parser.finish()]
    (start_at, start), = [(at, i) for at, i in seen if isinstance(i, ToolCallStart)]
    assert start.name == "write" and text[start_at] == "{" and text[:start_at + 1].endswith('"arguments": {')
    deltas = [(at, i) for at, i in seen if isinstance(i, ToolCallDelta)]
    assert len(deltas) > 40 and all(at < close for at, _ in deltas)
    assert "".join(i.arguments for _, i in deltas) == json.dumps(json.loads(WRITE)["arguments"])
    (end_at, end), = [(at, i) for at, i in seen if isinstance(i, ToolCallEnd)]
    assert end_at == close + len("</tool_call>") - 1 and end.call.state == "complete"


def test_a_forced_call_streams_from_its_first_brace_and_a_second_is_dropped_when_not_parallel() -> None:
    parser = AnswerParser(HERMES, function="get_weather", parallel=False)
    first = parser.feed(" {")
    assert [type(i) for i in first] == [ToolCallStart, ToolCallDelta] and first[1] == ToolCallDelta(0, "{")
    rest = parser.feed('"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {"b": 2}}</tool_call>')
    rest += parser.finish()
    assert summary(first + rest) == ("", [("get_weather", '{"city": "Paris"}', "complete")])
    assert parser.dropped_calls == 1 and parser.finish_reason("stop") == "tool_calls"


def test_random_damage_never_splits_differently_and_agrees_whenever_no_call_broke() -> None:
    rng = random.Random(7)
    for _ in range(400):
        text = list(rng.choice(TEXTS[:3]))
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(text))
            if rng.random() < 0.5:
                del text[at]
            else:
                text.insert(at, rng.choice('{}[]",: \n<>/x1\\'))
        damaged = "".join(text)
        cuts = [rng.randrange(len(damaged) + 1) for _ in range(rng.randrange(12))]
        streamed = summary(stream(damaged, cuts))
        assert streamed == summary(stream(damaged, []))
        if all(state == "complete" for _, _, state in streamed[1]):
            assert streamed == whole(damaged), damaged


def test_argument_pieces_are_held_to_a_least_length_and_all_out_when_the_object_closes() -> None:
    """With ``min_delta_chars``, a character at a time still gives the same arguments, in
    pieces of that length or more but the last, which goes out as the arguments object
    closes (before the closing tag); a call cut short sends what it held at its end."""
    text = f"Writing it.\n<tool_call>\n{WRITE}\n</tool_call>"
    arguments = json.dumps(json.loads(WRITE)["arguments"])
    parser = AnswerParser(HERMES, min_delta_chars=16)
    seen: list[tuple[int, AnswerItem]] = []
    for at, char in enumerate(text):
        seen += [(at, item) for item in parser.feed(char)]
    seen += [(len(text), item) for item in parser.finish()]
    deltas = [(at, i.arguments) for at, i in seen if isinstance(i, ToolCallDelta)]
    assert "".join(d for _, d in deltas) == arguments
    assert len(deltas) == -(-len(arguments) // 16) and all(len(d) == 16 for _, d in deltas[:-1])
    assert deltas[-1][0] == text.index(arguments) + len(arguments) - 1  # at the object's "}"
    cut = AnswerParser(HERMES, min_delta_chars=1000)
    items = cut.feed(text[: text.index(arguments) + 20]) + cut.finish()
    assert [i.arguments for i in items if isinstance(i, ToolCallDelta)] == [arguments[:20]]
    assert cut.calls[0].state == "cut_short"
