"""Reasoning in an answer: the text a thinking model writes between ``<think>`` and
``</think>`` before its answer, split from the answer as vLLM's ``--reasoning-parser`` does.

Two parsers, named as vLLM names them (:data:`REASONING_PARSERS`):
- ``qwen3``: an answer that begins with ``<think>`` (after whitespace) reasons until
  ``</think>``; one that does not is all content (Qwen3 with thinking switched off);
- ``deepseek_r1``: the chat template opened ``<think>`` in the prompt, so the answer begins
  inside its reasoning (a ``<think>`` it writes again there is dropped) until ``</think>``.
Under either, an answer that never writes ``</think>`` (cut by its token limit or a stop
string, or ended by the model) is all reasoning. There is one reasoning part, at the start:
a ``<think>`` later in the answer is content, as is everything after the first ``</think>``.

Invariants of :class:`ReasoningSplitter` (one per answer):
- the tags never reach either part; whitespace that begins the reasoning or the content after
  ``</think>`` is dropped, all other text is kept as written;
- a stream holds back only what could still begin a tag: at the answer's start (``qwen3``) a
  prefix of ``<think>`` and the whitespace before it, inside the reasoning a suffix that may
  begin ``</think>``; it is released as soon as the next text shows it cannot;
- fed in any pieces, the parts joined are the same as for the whole answer fed at once, so a
  stream and a collected answer agree;
- reasoning is released before any content, so a piece's reasoning always precedes its content.

Where one request's answer starts, the tag its rendered prompt ends with decides, whatever the
parser (:func:`prompt_think_tag`, :func:`answer_splitter`): after ``</think>`` the answer is all
content (a request that switched thinking off, ``router.api.template_kwargs``: Qwen3's,
Qwen3.5's, GLM-4.5's templates write an empty ``<think>\n\n</think>\n\n``, DeepSeek-V3.1's a
``</think>``; vLLM's ``prompt_is_reasoning_end``); after ``<think>`` it begins inside its
reasoning, as under ``deepseek_r1`` (DeepSeek-V3.1's template switched on). A prompt that ends
with neither leaves the parser's rule; a template that does not read the switch renders as
before, and the model's thinking is split as before.

The model's chat template decides the default (:func:`detect_reasoning_parser`); the serve
config's ``reasoning_parser`` (``"none"`` among its values) overrides it.

A thinking budget (:func:`thinking_budget_fields`) is enforced by the engine
(``engine.thinking_budget``): the splitter's start tells it where the thinking starts (at
once, or after the model writes ``<think>``) and that an answer starting as content has none.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "REASONING_OFF",
    "REASONING_PARSERS",
    "THINK_CLOSE",
    "THINK_OPEN",
    "ReasoningSplitter",
    "Split",
    "answer_splitter",
    "check_reasoning_settings",
    "detect_reasoning_parser",
    "prompt_think_start",
    "prompt_think_tag",
    "reasoning_parser_for",
    "thinking_budget_fields",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_OFF = "none"  # the config value that turns a detected parser off
# name -> whether the answer begins inside the reasoning (the template opened <think>)
REASONING_PARSERS: dict[str, bool] = {"qwen3": False, "deepseek_r1": True}

# Phases of an answer: whether it opens with <think> (qwen3), an optional repeated <think>
# (deepseek_r1), inside the reasoning, just after </think>, content.
_START, _OPENING, _REASONING, _AFTER, _CONTENT = range(5)


@dataclass
class Split:
    """What one feed released: reasoning text, then content text."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """One answer's text -> its reasoning and its content (see the module's invariants).

    ``reasoning_tokens`` counts the tokens of the feeds made while the answer reasoned, the
    one that closed the reasoning included (per feed: an event's tokens go to one side)."""

    tags = (THINK_OPEN, THINK_CLOSE)

    def __init__(self, parser: str, prefill: str = "", forced_content: bool = False) -> None:
        """``prefill``: text written after the generation prompt that the answer continues
        (read here to know where the answer starts, never released); ``forced_content``: the
        answer starts as content whatever the parser (a tool call the prompt opened)."""
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose from {sorted(REASONING_PARSERS)}")
        self.parser = parser
        self._phase = _CONTENT if forced_content else _OPENING if REASONING_PARSERS[parser] else _START
        self._held = ""
        self._began = False  # the reasoning has had text other than whitespace
        self._pending_tokens = 0  # tokens fed while a qwen3 answer's start is undecided
        self.reasoning_tokens = 0
        if prefill and not forced_content:
            self.feed(prefill)
            self._held, self.reasoning_tokens, self._pending_tokens = "", 0, 0

    @property
    def reasoning_ended(self) -> bool:
        """Every later text is content (the reasoning closed, or the answer had none)."""
        return self._phase in (_AFTER, _CONTENT)

    @property
    def reasoning_open(self) -> bool:
        """The answer is inside its reasoning now (at the start: the prompt or prefill opened it)."""
        return self._phase in (_OPENING, _REASONING)

    def feed(self, text: str, tokens: int = 0) -> Split:
        """The answer's next text (``tokens``: how many tokens it came from)."""
        if self._phase == _START:
            self._pending_tokens += tokens
        elif self._phase in (_OPENING, _REASONING):
            self.reasoning_tokens += tokens
        self._held += text
        return self._run(final=False)

    def finish(self) -> Split:
        """The answer ended: release what was held (a partial tag is text after all)."""
        return self._run(final=True)

    def parse(self, text: str) -> Split:
        """A whole answer at once."""
        head, tail = self.feed(text), self.finish()
        return Split(head.reasoning + tail.reasoning, head.content + tail.content)

    def _run(self, final: bool) -> Split:
        out = Split()
        while True:
            phase, held = self._phase, self._held
            if phase in (_START, _OPENING):
                body = held.lstrip()
                if body.startswith(THINK_OPEN):
                    self._held, self._phase = body[len(THINK_OPEN):], _REASONING
                    self.reasoning_tokens += self._pending_tokens
                elif THINK_OPEN.startswith(body) and not final:
                    return out  # nothing yet, or a partial <think>: undecided
                else:
                    self._phase = _CONTENT if phase == _START else _REASONING
            elif phase == _REASONING:
                if not self._began:
                    held = self._held = held.lstrip()
                    if not held:
                        return out
                    self._began = True
                end = held.find(THINK_CLOSE)
                if end >= 0:
                    out.reasoning += held[:end]
                    self._held, self._phase = held[end + len(THINK_CLOSE):], _AFTER
                    continue
                keep = 0 if final else _partial_suffix(held, THINK_CLOSE)
                out.reasoning += held[: len(held) - keep]
                self._held = held[len(held) - keep:]
                return out
            elif phase == _AFTER:
                self._held = held.lstrip()
                if not self._held:
                    return out
                self._phase = _CONTENT
            else:
                out.content += held
                self._held = ""
                return out


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def prompt_think_tag(prompt: str) -> str | None:
    """The think tag a rendered chat prompt (before any prefill) ends with, if any: ``</think>``
    when its template wrote the thinking as done, ``<think>`` when it opened it."""
    end = prompt.rstrip()
    return next((tag for tag in (THINK_CLOSE, THINK_OPEN) if end.endswith(tag)), None)


def prompt_think_start(prompt: str) -> int | None:
    """Where the think tags a rendered chat prompt ends with begin (None: it ends with
    none): its ``<think>``, its ``</think>``, or the ``<think>`` of the empty block it ends
    with. A later turn renders that answer without them (or otherwise), so a conversation's
    next prompt repeats this one only up to there (``router.sessions.inference``)."""
    end = prompt.rstrip()
    tag = prompt_think_tag(end)
    if tag is None:
        return None
    start = len(end) - len(tag)
    before = end[:start].rstrip()
    if tag == THINK_CLOSE and before.endswith(THINK_OPEN):
        start = len(before) - len(THINK_OPEN)
    return start


def answer_splitter(parser: str, prompt_tag: str | None, prefill: str = "",
                    forced_content: bool = False) -> ReasoningSplitter:
    """One answer's splitter under ``parser``, its start set by ``prompt_tag`` (the tag its
    prompt ends with): after ``</think>`` content, after ``<think>`` inside the reasoning."""
    if prompt_tag == THINK_OPEN:
        parser = "deepseek_r1"
    return ReasoningSplitter(parser, prefill, forced_content or prompt_tag == THINK_CLOSE)


async def thinking_budget_fields(budget: int | None, splitter: ReasoningSplitter | None,
                                 tag_ids: Callable[[], Awaitable[Mapping[str, list[int]]]]) -> dict[str, Any]:
    """The sampling fields that cap a new answer's thinking at ``budget`` tokens (none when
    there is no budget, no reasoning to split, or the answer starts as content): the ids of
    ``</think>`` forced to end it, and where it starts, read from ``splitter`` (inside the
    reasoning: at once; else after the ids of ``<think>``). ``tag_ids``: each tag's ids, asked
    for only when a budget applies."""
    if budget is None or splitter is None or splitter.reasoning_ended:
        return {}
    ids, inside = await tag_ids(), splitter.reasoning_open
    return {"thinking_budget": budget, "thinking_end_ids": list(ids[THINK_CLOSE]),
            "thinking_from_start": inside, "thinking_start_ids": [] if inside else list(ids[THINK_OPEN])}


_PROBE = [{"role": "user", "content": "hi"}]


def detect_reasoning_parser(chat_template: str | None, generation_prompt: str | None) -> str | None:
    """The parser a chat template calls for, or None. A template that handles ``</think>``
    (Qwen3's, QwQ's, DeepSeek-R1's strip it from earlier turns) is a thinking model's:
    ``deepseek_r1`` when its generation prompt (``generation_prompt``: a one-message
    conversation rendered with it) ends inside an opened ``<think>`` (DeepSeek-R1, QwQ,
    Qwen3's thinking-only releases), else ``qwen3`` (the model writes ``<think>`` itself)."""
    if not chat_template or THINK_CLOSE not in chat_template:
        return None
    if generation_prompt is not None and generation_prompt.rstrip().endswith(THINK_OPEN):
        return "deepseek_r1"
    return "qwen3"


def check_reasoning_settings(settings: dict[str, str], models: Any) -> None:
    """ValueError naming the first model (not in ``models``) or value that cannot be used."""
    unknown = sorted(set(settings) - set(models))
    if unknown:
        raise ValueError(f"reasoning_parsers names models not in the catalog: {unknown}")
    allowed = sorted([*REASONING_PARSERS, REASONING_OFF])
    for model, name in settings.items():
        if name not in allowed:
            raise ValueError(f"reasoning_parsers[{model!r}] must be one of {allowed}, got {name!r}")


def reasoning_parser_for(setting: str | None, tokenizer: Any) -> str | None:
    """A model's reasoning parser: the config's ``setting`` (``"none"``: off), else the one
    its chat template calls for (``tokenizer``: its transformers tokenizer)."""
    if setting is not None:
        return None if setting == REASONING_OFF else setting
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or THINK_CLOSE not in template:
        return None
    try:
        prompt = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that refuses the probe: judge it by its text alone
        prompt = None
    return detect_reasoning_parser(template, prompt if isinstance(prompt, str) else None)
