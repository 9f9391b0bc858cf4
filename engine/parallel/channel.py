"""The step command channel from rank 0 to the workers: compact per-step deltas.

Rank 0 owns the scheduler; workers only mirror what a forward pass needs. For every
scheduled request rank 0 sends the tokens the worker has not seen yet (a new request's
prompt once, then only the last sampled token per decode), the block-table change (keep the
first ``keep_blocks`` ids, append ``new_blocks``; a preempted and rescheduled request shares
a prefix or nothing) and the step's (computed, new, samples) numbers. Finished requests are
dropped from the mirrors by id. ``StepEncoder`` (rank 0) and ``StepDecoder`` (a worker)
stay in lockstep as long as every encoded message is decoded, in order, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request
from engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class ScheduledDelta:
    request_id: str
    new_tokens: list[int]
    keep_blocks: int
    new_blocks: list[int]
    num_computed_tokens: int
    num_new_tokens: int
    samples: bool


@dataclass(slots=True)
class StepMessage:
    key: str  # which runner on each rank (see RankContext.runners)
    scheduled: list[ScheduledDelta]
    finished: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Shadow:
    request: Request
    num_tokens: int
    block_ids: list[int]


class StepEncoder:
    """Rank 0's record of what the workers know about each request."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._known: dict[str, _Shadow] = {}

    @property
    def num_tracked(self) -> int:
        return len(self._known)

    def encode(self, out: SchedulerOutput) -> StepMessage:
        finished = [rid for rid, sh in self._known.items() if sh.request.is_finished]
        for rid in finished:
            del self._known[rid]
        deltas: list[ScheduledDelta] = []
        for s in out.scheduled:
            rid = s.request_id
            shadow = self._known.get(rid)
            if shadow is not None and shadow.request is not s.request:
                finished.append(rid)  # the id was reused by a new request
                shadow = None
            if shadow is None:
                shadow = _Shadow(s.request, 0, [])
                self._known[rid] = shadow
            end = s.num_computed_tokens + s.num_new_tokens
            new_tokens: list[int] = []
            if end > shadow.num_tokens:
                new_tokens = s.request.token_slice(shadow.num_tokens, end)
                shadow.num_tokens = end
            old, cur = shadow.block_ids, s.block_ids
            if len(old) <= len(cur) and cur[: len(old)] == old:
                keep = len(old)
            else:
                keep = 0
                while keep < min(len(old), len(cur)) and old[keep] == cur[keep]:
                    keep += 1
            new_blocks = list(cur[keep:])
            shadow.block_ids = list(cur)
            deltas.append(
                ScheduledDelta(
                    rid,
                    new_tokens,
                    keep,
                    new_blocks,
                    s.num_computed_tokens,
                    s.num_new_tokens,
                    s.samples,
                )
            )
        return StepMessage(self.key, deltas, finished)


@dataclass(slots=True)
class MirroredScheduled:
    """Duck-types ``ScheduledRequest`` for ``ModelRunner.prepare``; ``key`` is the same object
    at every step of the request (its mirrored token list), as rank 0's is its ``Request``."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    samples: bool
    key: object


@dataclass(slots=True)
class MirroredStep:
    """Duck-types ``SchedulerOutput`` for ``ModelRunner.prepare``."""

    scheduled: list[MirroredScheduled]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class StepDecoder:
    """A worker's mirror of the scheduled requests' tokens and block tables."""

    def __init__(self) -> None:
        self._tokens: dict[str, list[int]] = {}
        self._blocks: dict[str, list[int]] = {}

    @property
    def num_tracked(self) -> int:
        return len(self._tokens)

    def decode(self, msg: StepMessage) -> MirroredStep:
        for rid in msg.finished:
            self._tokens.pop(rid, None)
            self._blocks.pop(rid, None)
        out: list[MirroredScheduled] = []
        for d in msg.scheduled:
            tokens = self._tokens.setdefault(d.request_id, [])
            tokens.extend(d.new_tokens)
            blocks = self._blocks.setdefault(d.request_id, [])
            del blocks[d.keep_blocks :]
            blocks.extend(d.new_blocks)
            start = d.num_computed_tokens
            end = start + d.num_new_tokens
            if end > len(tokens):
                raise RuntimeError(
                    f"step channel out of sync: request {d.request_id!r} needs tokens up to "
                    f"{end}, the worker has {len(tokens)}"
                )
            out.append(
                MirroredScheduled(
                    d.request_id,
                    tokens[start:end],
                    start,
                    d.num_new_tokens,
                    blocks,
                    d.samples,
                    tokens,
                )
            )
        return MirroredStep(out)
