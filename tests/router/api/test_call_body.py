"""The tool-call body scanner: strict JSON checked as it arrives, the arguments object's raw
text found in it, the same however the body is split."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.api.call_body import CallBodyScanner

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
STYLES = [{}, {"ensure_ascii": False}, {"indent": 2}, {"separators": (",", ":")}, {"indent": "\t", "ensure_ascii": False}]


def scan(body: str, cuts: list[int] | None = None) -> tuple[CallBodyScanner, str]:
    """Scan ``body`` cut at ``cuts``; the scanner and the arguments text it returned."""
    scanner = CallBodyScanner()
    bounds = sorted({c % (len(body) + 1) for c in cuts or []} | {0, len(body)})
    pieces = [scanner.feed(body[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return scanner, "".join(pieces)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=5), st.sampled_from(STYLES),
       st.sampled_from(["arguments", "parameters"]), st.sampled_from(["", " ", "\n  "]),
       st.lists(st.integers(min_value=0, max_value=10_000), max_size=10))
def test_a_valid_body_gives_its_arguments_text_as_written(
    arguments: dict[str, Any], style: dict[str, Any], key: str, space: str, cuts: list[int],
) -> None:
    raw = json.dumps(arguments, **style)
    body = f'{space}{{"name":{space}"write_file", "{key}": {raw}{space}}}{space}'
    scanner, text = scan(body, cuts)
    assert scanner.complete and scanner.name == "write_file"
    assert text == raw and json.loads(text) == arguments


@pytest.mark.parametrize(("body", "broken_at", "released"), [
    ('{"name": "f", "arguments": {"x": }}', 33, '{"x": '),
    ('{"name": "f", "arguments": {"x": NaN}}', 33, '{"x": '),  # Python's json takes NaN; clients do not
    ('{"name": "f", "arguments": {"x": 01}}', 34, '{"x": 0'),
    ('{"name": "f", "arguments": {"x": "a\nb"}}', 35, '{"x": "a'),  # a raw newline in a string
    ('{"name": "f", "arguments": {"x": "\\q"}}', 35, '{"x": "\\'),
    ('{"name": "f", "arguments": {"a": [1,]}}', 36, '{"a": [1,'),
    ('{"name": "f", "arguments": {"a": 1}} x', 37, '{"a": 1}'),  # text after the object
    ('{"name": "f", "arguments": {"a": 1}, "name": "g"}', 42, '{"a": 1}'),  # the call named twice
    ('{"name": "f", "arguments": {"a": 1}, "arguments": {}}', 47, '{"a": 1}'),
])
def test_a_committed_body_breaks_where_it_stops_being_json(body: str, broken_at: int, released: str) -> None:
    scanner, text = scan(body)
    assert scanner.canonical and not scanner.complete
    assert (scanner.broken_at, text) == (broken_at, released)
    assert scan(body, list(range(len(body))))[1] == released  # a character at a time


@pytest.mark.parametrize("body", [
    '{"arguments": {}, "name": "f"}',  # name second
    '{"name": "", "arguments": {}}',  # no name
    '{"name": 3, "arguments": {}}',
    '{"name": "f", "arguments": "{}"}',  # string arguments: parsed whole
    '{"name": "f"}',
    '{"name": "f", "id": 1, "arguments": {}}',
    '[{"name": "f", "arguments": {}}]',
    'not json',
])
def test_other_shapes_are_left_to_the_whole_body(body: str) -> None:
    scanner, text = scan(body)
    assert scanner.canonical is False and text == "" and scanner.broken_at is None


def test_a_body_cut_short_is_a_prefix_of_its_arguments() -> None:
    scanner, text = scan('{"name": "f", "parameters": {"path": "a.py", "text": "def f():\\n')
    assert scanner.canonical and not scanner.done and scanner.broken_at is None
    assert text == '{"path": "a.py", "text": "def f():\\n'
    extra, more = scan('{"name": "f", "arguments": {"a": 1}, "id": "x"}')
    assert extra.complete and more == '{"a": 1}'  # other members after the arguments are allowed
