"""A request's thinking budget: the end of its thinking forced once it has thought enough.

A reasoning model thinks between a start and an end sequence of tokens (``<think>`` and
``</think>``). With ``SamplingParams.thinking_budget`` set to N, once the answer has written N
tokens inside its thinking without ending it, its next tokens are ``thinking_end_ids``, one
per step, whatever the model would have sampled; then sampling goes on as before. This is
what vLLM's ``thinking_token_budget`` and SGLang's thinking-budget logit processor do.

Where the thinking starts: at the answer's first token when ``thinking_from_start`` (the
prompt opened it), else right after the answer opens with ``thinking_start_ids``; an answer
that opens with anything else (whitespace included) is content and is never capped, as
``router.api.reasoning`` reads it (qwen3). The start and end sequences themselves are not
counted; tokens of a partly written natural end are, and a budget spent inside one forces
only the rest of it. The first complete ``thinking_end_ids``
the model writes itself ends the thinking, and nothing is forced after it: an answer thinks
once, as ``router.api.reasoning`` splits it. A start sequence written later in the answer
starts nothing. Tokens of the prompt (a prefill inside the thinking) are not counted.

:class:`ThinkingBudget` is one request's state, fed every output token in order
(``Request.append_token``); :func:`forced_tokens` gives the model runner, per sampling row,
the token it must take instead of sampling (None: sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

__all__ = ["ThinkingBudget", "forced_tokens"]


class _Phase(Enum):
    WAITING = "waiting"  # for the start sequence
    THINKING = "thinking"
    CLOSING = "closing"  # writing the forced end sequence
    DONE = "done"


@dataclass
class ThinkingBudget:
    """One answer's thinking: how many tokens it has thought, and what it must write next."""

    budget: int
    start_ids: list[int]
    end_ids: list[int]
    phase: _Phase = _Phase.WAITING
    thought: int = 0  # tokens written inside the thinking
    closed: int = 0  # end ids forced so far
    _tail: list[int] = field(default_factory=list, repr=False)  # the last tokens, for matching

    @classmethod
    def of(cls, params: SamplingParams) -> ThinkingBudget | None:
        """The state a request with ``params`` starts with (None: it has no budget)."""
        if params.thinking_budget is None:
            return None
        state = cls(params.thinking_budget, list(params.thinking_start_ids), list(params.thinking_end_ids))
        if params.thinking_from_start:
            state._start_thinking()
        return state

    @property
    def forced(self) -> int | None:
        """The token the answer's next position must hold (None: sample it)."""
        return self.end_ids[self.closed] if self.phase is _Phase.CLOSING else None

    def add(self, token_id: int) -> None:
        """The answer's next token (forced or sampled)."""
        if self.phase is _Phase.WAITING:
            self._tail.append(token_id)
            if self._tail == self.start_ids:
                self._start_thinking()
            elif self._tail != self.start_ids[: len(self._tail)]:
                self.phase = _Phase.DONE  # it began as content: it thinks no more
        elif self.phase is _Phase.THINKING:
            if self._completes(token_id, self.end_ids):
                self.phase = _Phase.DONE
                return
            self.thought += 1
            self._close_if_spent()
        elif self.phase is _Phase.CLOSING:
            self.closed += 1
            if self.closed == len(self.end_ids):
                self.phase = _Phase.DONE

    def _start_thinking(self) -> None:
        self.phase, self._tail = _Phase.THINKING, []
        self._close_if_spent()

    def _close_if_spent(self) -> None:
        """Spent: force the end, from where a partly written one stands (the model wrote
        ``</th`` of a ``</think>`` in several tokens: only ``ink>`` is forced, never the
        whole tag after its own beginning)."""
        if self.thought >= self.budget:
            self.phase = _Phase.CLOSING
            self.closed = self._end_written()

    def _end_written(self) -> int:
        """How many leading end ids the last tokens written are (fewer than all of them)."""
        tail, end = self._tail, self.end_ids
        for k in range(min(len(tail), len(end) - 1), 0, -1):
            if tail[-k:] == end[:k]:
                return k
        return 0

    def _completes(self, token_id: int, sequence: list[int]) -> bool:
        """Whether ``token_id`` completes ``sequence`` (the last tokens kept to match it)."""
        self._tail.append(token_id)
        del self._tail[: -len(sequence)]
        return self._tail == sequence


def forced_tokens(budgets: Sequence[ThinkingBudget | None]) -> list[int | None] | None:
    """Per sampling row, the token its request must take (None: sample it); None when no
    row is forced, the common step."""
    if budgets.count(None) == len(budgets):
        return None  # no row has a budget: no pass over the rows in Python
    forced = [None if b is None else b.forced for b in budgets]
    return None if forced.count(None) == len(forced) else forced
