"""A request inside the engine and its state machine.

    WAITING --schedule--> RUNNING --preempt--> PREEMPTED --schedule--> RUNNING
       |                     |                     |
       +---------------------+---------------------+--> FINISHED_{STOPPED,LENGTH,ABORTED}

Tokens: ``all_token_ids`` is prompt + output. ``num_computed_tokens`` counts the leading
tokens whose KV is in the request's blocks; a running request that has produced its first
token always has exactly one token (the last sampled) without KV. Preemption recomputes:
it drops the blocks and sets ``num_computed_tokens`` back to 0 but keeps the output.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.interface import FinishReason, TokenEvent
from engine.sampling_params import SamplingParams
from engine.thinking_budget import ThinkingBudget


def validate_prompt(
    request_id: str,
    prompt: Sequence[int],
    max_model_len: int,
    vocab_size: int,
    checked_prefix: int = 0,
) -> None:
    """The one prompt check of every engine: not empty, shorter than ``max_model_len`` (one
    token must be left to generate), token ids integers in ``[0, vocab_size)``. The first
    ``checked_prefix`` tokens are known valid (e.g. a session's previous prompt)."""
    if not prompt:
        raise ValueError(f"request {request_id!r} has an empty prompt")
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"request {request_id!r}: prompt has {len(prompt)} tokens; max_model_len is "
            f"{max_model_len} and must leave room for at least one generated token"
        )
    rest = prompt[checked_prefix:]
    if not rest:
        return
    if set(map(type, rest)) == {int}:  # every id exactly an int (not bool, not float), at C speed
        low, high = min(rest), max(rest)
        if low >= 0 and high < vocab_size:
            return
    bad = next(t for t in rest if type(t) is not int or not 0 <= t < vocab_size)
    raise ValueError(
        f"request {request_id!r}: token id {bad!r} is outside the vocabulary "
        f"(integers in [0, {vocab_size}))"
    )


def validate_forced_ids(request_id: str, params: SamplingParams, vocab_size: int) -> None:
    """The tokens a thinking budget may force are in the vocabulary: the model reads each
    forced token at the next step, where an id out of range would fail the whole batch."""
    if params.thinking_budget is None:
        return
    bad = next((t for t in params.thinking_end_ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"request {request_id!r}: thinking_end_ids holds {bad}, outside the vocabulary "
            f"(integers in [0, {vocab_size}))"
        )


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: Sequence[int]  # read only: shared with the call it serves, never changed
    params: SamplingParams
    session_id: str | None = None
    priority: float = 0.0  # under KV pressure the largest is preempted first (``Scheduler``)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens not prefilled on first admission (device prefix cache + restored).
    num_cached_tokens: int = 0
    # Of those, copied back from the secondary (host) KV cache.
    num_restored_tokens: int = 0
    num_preemptions: int = 0
    admitted: bool = False  # scheduled at least once (cached counts are then final)
    # Chained hashes of the full blocks of all_token_ids, extended lazily by the KV manager.
    block_hashes: list[int] = field(default_factory=list, repr=False)
    # Its thinking so far, when its params set a thinking budget (engine.thinking_budget).
    thinking: ThinkingBudget | None = field(default=None, repr=False)
    # len(prompt_token_ids), read at every step: the prompt never changes, and a replay's
    # prompt is a view whose len is a Python call.
    num_prompt_tokens: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.thinking is None:
            self.thinking = ThinkingBudget.of(self.params)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int, logprob: float | None) -> None:
        """The next output token (and its logprob, when the request asked for them)."""
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.thinking is not None:
            self.thinking.add(token_id)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output without building the whole list."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]


def token_event(req: Request, tokens: list[int], logprobs: list[float] | None = None) -> TokenEvent:
    """The event that reports ``tokens`` (new since the last event) of ``req`` as it is now."""
    reason = _FINISH_REASONS.get(req.status)  # every engine step calls this for each request
    return TokenEvent(
        request_id=req.request_id,
        new_token_ids=tokens,
        finished=reason is not None,
        finish_reason=reason,
        logprobs=logprobs,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
        num_restored_tokens=req.num_restored_tokens,
        num_output_tokens=len(req.output_token_ids),
    )
