"""The reasoning splitter (``router.api.reasoning``) on text alone: vLLM's ``qwen3`` and
``deepseek_r1`` semantics, any split of the text into stream pieces, what a stream holds back,
the parser a chat template calls for, and the config's checks."""

from __future__ import annotations

from typing import Any

import pytest

from router.api.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    ReasoningSplitter,
    Split,
    answer_splitter,
    detect_reasoning_parser,
    prompt_think_start,
    prompt_think_tag,
    reasoning_parser_for,
)
from router.app import RouterConfig
from talaria.serving.config import _REASONING_PARSERS, ConfigError, ServeConfig

CASES: list[tuple[str, str, str, str]] = [  # parser, answer, reasoning, content
    ("qwen3", "<think>\nPlan it.\n</think>\n\nThe answer.", "Plan it.\n", "The answer."),
    ("qwen3", "The answer.", "", "The answer."),  # thinking off: no <think> at the start
    ("qwen3", "  The <think>answer</think>.", "", "  The <think>answer</think>."),
    ("qwen3", "\n<think>Plan</think>Done", "Plan", "Done"),
    ("qwen3", "<think>Cut off while thinking", "Cut off while thinking", ""),
    ("qwen3", "<think>a</think>b</think>c", "a", "b</think>c"),  # one reasoning part, at the start
    ("qwen3", "<thin", "", "<thin"),
    ("qwen3", "", "", ""),
    ("deepseek_r1", "Plan it.\n</think>\n\nThe answer.", "Plan it.\n", "The answer."),
    ("deepseek_r1", "<think>\nPlan</think>The answer.", "Plan", "The answer."),  # <think> written again
    ("deepseek_r1", "All of it is reasoning", "All of it is reasoning", ""),
    ("deepseek_r1", "Plan </thi", "Plan </thi", ""),  # a partial close at the end is text
    ("deepseek_r1", "</think>Only content", "", "Only content"),
]


def split_whole(parser: str, text: str) -> Split:
    return ReasoningSplitter(parser).parse(text)


def split_pieces(parser: str, pieces: list[str]) -> tuple[Split, list[Split]]:
    splitter = ReasoningSplitter(parser)
    released = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    joined = Split("".join(s.reasoning for s in released), "".join(s.content for s in released))
    return joined, released


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_whole_answers_split_as_vllm_names_them(parser: str, text: str, reasoning: str, content: str) -> None:
    assert split_whole(parser, text) == Split(reasoning, content)


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_every_split_point_and_every_character_give_the_whole_answers_parts(
        parser: str, text: str, reasoning: str, content: str) -> None:
    """A stream agrees with the collected answer however its text is cut: in two at every
    position (so each tag is split at each of its characters), and one character at a time."""
    for i in range(len(text) + 1):
        assert split_pieces(parser, [text[:i], text[i:]])[0] == Split(reasoning, content), i
    joined, released = split_pieces(parser, list(text))
    assert joined == Split(reasoning, content)
    seen_content = False
    for piece in released:  # reasoning never follows content
        assert not (seen_content and piece.reasoning)
        seen_content = seen_content or bool(piece.content)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_stream_holds_back_only_what_may_begin_a_tag(parser: str) -> None:
    start = "" if parser == "deepseek_r1" else "<think>"
    splitter = ReasoningSplitter(parser)
    assert splitter.feed(start + "Let x be 3 <") == Split("Let x be 3 ", "")
    assert splitter.feed("/thi") == Split()  # "</thi" may begin </think>
    assert splitter.feed("ngs") == Split("</things", "")  # ... and then it cannot
    assert splitter.feed(" fit.</") == Split(" fit.", "")
    assert splitter.feed("think>") == Split()
    assert splitter.feed("\n\n") == Split()  # whitespace that begins the content is dropped
    assert splitter.feed("Yes") == Split("", "Yes")
    assert splitter.feed(" <think>no</think>") == Split("", " <think>no</think>")
    assert splitter.finish() == Split()


def test_a_qwen3_answer_waits_only_while_its_start_may_be_think() -> None:
    splitter = ReasoningSplitter("qwen3")
    assert splitter.feed("\n<thi") == Split()
    assert splitter.feed("s is it") == Split("", "\n<this is it")
    held = ReasoningSplitter("qwen3")
    assert held.feed("<thi") == Split() and held.finish() == Split("", "<thi")


def test_reasoning_tokens_count_the_feeds_made_while_reasoning() -> None:
    splitter = ReasoningSplitter("qwen3")
    for text in ("<think>", "Plan", "</think>", "\n\n", "Answer"):
        splitter.feed(text, tokens=1)
    assert splitter.reasoning_tokens == 3  # the closing tag's token among them
    plain = ReasoningSplitter("qwen3")
    plain.feed("<", tokens=1)
    plain.feed("b>bold", tokens=1)
    assert plain.reasoning_tokens == 0
    r1 = ReasoningSplitter("deepseek_r1")
    r1.feed("Plan", tokens=2)
    r1.feed("</think>Go", tokens=1)
    r1.feed("!", tokens=1)
    assert r1.reasoning_tokens == 3


def test_a_prefill_sets_where_the_answer_starts_and_a_forced_call_is_content() -> None:
    assert ReasoningSplitter("qwen3", prefill="<think>\nSo").parse(" far</think>ok") == Split(" far", "ok")
    assert ReasoningSplitter("qwen3", prefill="Sure").parse("<think>x</think>") == Split("", "<think>x</think>")
    assert ReasoningSplitter("deepseek_r1", prefill="Hmm").parse(", so</think>ok") == Split(", so", "ok")
    forced = ReasoningSplitter("deepseek_r1", forced_content=True)
    assert forced.parse('{"name": "f"}</tool_call>') == Split("", '{"name": "f"}</tool_call>')


def test_the_tag_a_prompt_ends_with_sets_where_the_answer_starts_under_either_parser() -> None:
    off, opened = "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_start|>assistant\n<think>\n"
    assert [prompt_think_tag(p) for p in (off, opened, "<|im_start|>assistant\n", "</think> said")] == [
        THINK_CLOSE, THINK_OPEN, None, None]
    for parser in ("qwen3", "deepseek_r1"):
        assert answer_splitter(parser, THINK_CLOSE).parse("All answer.") == Split("", "All answer.")
        assert answer_splitter(parser, THINK_OPEN).parse("Plan</think>Go") == Split("Plan", "Go")
        assert answer_splitter(parser, None).parse("Go") == ReasoningSplitter(parser).parse("Go")
    assert answer_splitter("qwen3", THINK_OPEN, prefill="So").parse(" far</think>ok") == Split(" far", "ok")


def test_where_the_think_tags_a_prompt_ends_with_begin() -> None:
    """What a later turn does not repeat: the empty block thinking off writes (Qwen3's), the
    ``</think>`` alone (DeepSeek-V3.1's), the opened ``<think>`` (Qwen3.5's, R1's)."""
    head = "<|im_start|>assistant\n"
    for tail in ("<think>\n\n</think>\n\n", "</think>", "<think>\n", "<think>"):
        assert prompt_think_start(head + tail) == len(head)
    assert prompt_think_start(head) is None and prompt_think_start("a</think>b") is None
    assert prompt_think_start("<think>x</think>") == len("<think>x")  # not an empty block


QWEN3_TEMPLATE = ("{%- for m in messages %}{%- if m.role == 'assistant' %}{{- m.content.split('</think>')[-1] }}"
                  "{%- else %}{{- m.content }}{%- endif %}{%- endfor %}"
                  "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


class FakeTokenizer:
    def __init__(self, template: str, generation: str) -> None:
        self.chat_template = template
        self.generation = generation

    def apply_chat_template(self, messages: Any, tokenize: bool, add_generation_prompt: bool) -> str:
        return "<|im_start|>user\nhi<|im_end|>\n" + self.generation


def test_the_chat_template_picks_the_parser_and_the_config_overrides_it() -> None:
    assert detect_reasoning_parser(None, None) is None
    assert detect_reasoning_parser("{{ messages }}<|im_start|>assistant\n", "<|im_start|>assistant\n") is None
    assert detect_reasoning_parser(QWEN3_TEMPLATE, "<|im_start|>assistant\n") == "qwen3"
    assert detect_reasoning_parser(QWEN3_TEMPLATE + "<think>\n", "<|im_start|>assistant\n<think>\n") == "deepseek_r1"
    qwen3 = FakeTokenizer(QWEN3_TEMPLATE, "<|im_start|>assistant\n")
    thinking_only = FakeTokenizer(QWEN3_TEMPLATE, "<|im_start|>assistant\n<think>\n")
    plain = FakeTokenizer("{{ messages }}", "<|im_start|>assistant\n")
    assert reasoning_parser_for(None, qwen3) == "qwen3"
    assert reasoning_parser_for(None, thinking_only) == "deepseek_r1"
    assert reasoning_parser_for(None, plain) is None
    assert reasoning_parser_for("none", qwen3) is None
    assert reasoning_parser_for("deepseek_r1", plain) == "deepseek_r1"


def test_an_unknown_parser_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"reasoning_parsers\['m'\] must be one of \['deepseek_r1', 'none', 'qwen3'\], "
                                         "got 'qwen'"):
        RouterConfig(models={"m": "/x"}, instances={}, reasoning_parsers={"m": "qwen"})
    with pytest.raises(ValueError, match="reasoning_parsers names models not in the catalog: .'other'."):
        RouterConfig(models={"m": "/x"}, instances={}, reasoning_parsers={"other": "qwen3"})
    with pytest.raises(ConfigError, match=r"\[models.m\].reasoning_parser must be one of "
                                          r"\['deepseek_r1', 'none', 'qwen3'\], got 'r1'"):
        ServeConfig.from_dict({"models": {"m": {"path": "/x", "reasoning_parser": "r1"}}})
    config = ServeConfig.from_dict({"models": {"m": {"path": "/x", "reasoning_parser": "deepseek_r1"}}})
    assert config.models["m"].reasoning_parser == "deepseek_r1"
    from router.api.reasoning import REASONING_OFF, REASONING_PARSERS
    assert sorted(_REASONING_PARSERS) == sorted([*REASONING_PARSERS, REASONING_OFF])  # the serve config's copy
