"""A custom tool's input (Codex's ``apply_patch``) decoded from its call's arguments as they
stream: the same string however the arguments are split, whole at the end otherwise."""

from __future__ import annotations

import asyncio
import json

import pytest
from api_helpers import named_events, scripted, serve
from hypothesis import given, settings
from hypothesis import strategies as st

from router.api.responses_tools import CustomInputStream, custom_input
from router.tokenization import ModelTokenizer

STYLES = [{}, {"ensure_ascii": False}, {"indent": 2}, {"separators": (",", ":")}]


def decode(raw: str, cuts: list[int]) -> tuple[CustomInputStream, str]:
    stream = CustomInputStream()
    bounds = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    return stream, "".join(stream.feed(raw[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",))), st.sampled_from(STYLES),
       st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_the_input_string_is_decoded_piece_by_piece(value: str, style: dict[str, object], cuts: list[int]) -> None:
    raw = json.dumps({"input": value, "then": [1]}, **style)
    stream, text = decode(raw, cuts)
    assert text == value == custom_input(raw) and stream.rest(value) == ""


def test_escapes_split_anywhere_and_surrogate_pairs() -> None:
    raw = '{ "input" :\n "a\\n\\"b\\\\ \\u00e9 \\ud83d\\ude00 \\ud83d!"}'
    want = json.loads(raw)["input"].replace("\ud83d!", "\ufffd!")  # a lone half: see below
    assert want == 'a\n"b\\ é 😀 \ufffd!'
    for cut in range(len(raw) + 1):
        assert decode(raw, [cut])[1] == want


@pytest.mark.parametrize("raw", ['{"patch": "x"}', '{"inputs": "x"}', '{"input": 3}', '{"a": 1, "input": "x"}'])
def test_other_shapes_go_out_whole_at_the_end(raw: str) -> None:
    stream, text = decode(raw, list(range(len(raw))))
    assert text == "" and stream.rest(custom_input(raw)) == custom_input(raw)


LONE = '{"input": "a\\ud83d! \\ude00 b\\ud83d"}'  # halves of surrogate pairs, alone


def test_a_lone_surrogate_is_the_replacement_character_streamed_or_whole() -> None:
    """JSON lets a string hold half a surrogate pair; no client can be sent one (UTF-8 has
    none), so the input has U+FFFD there, streamed and whole alike."""
    want = "a\ufffd! \ufffd b\ufffd"
    for cut in range(len(LONE) + 1):
        stream, text = decode(LONE, [cut])
        assert text + stream.rest(want) == want
    assert custom_input(LONE) == want


async def test_a_streamed_input_with_a_lone_surrogate_ends_as_any_other(tiny_tokenizer: ModelTokenizer) -> None:
    call = f'<tool_call>\n{{"name": "apply_patch", "arguments": {LONE}}}\n</tool_call>'
    tools = [{"type": "custom", "name": "apply_patch", "description": "Edit files with a patch."}]
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, call)}) as client:
        resp = await client.post("/v1/responses", json={"model": "tiny", "input": "x", "stream": True, "tools": tools})
        events = named_events(await asyncio.wait_for(resp.text(), 10))
    deltas = [d["delta"] for n, d in events if n == "response.custom_tool_call_input.delta"]
    (done,) = [d for n, d in events if n == "response.custom_tool_call_input.done"]
    assert events[-1][0] == "response.completed"
    assert "".join(deltas) == done["input"] == "a\ufffd! \ufffd b\ufffd"
