"""Continuous batching: which requests run this step and how many new tokens each.

Torch-free. Each ``schedule`` call spends a token budget: running requests first (decodes,
and the next chunk of prefills already started), in admission order; then, if nothing was
preempted, waiting requests in arrival order (preempted ones go back to the front), each
after a prefix-cache lookup, with a prefill chunk that fits the remaining budget. When a
running request cannot get a block, the running request with the largest ``priority`` value
is preempted (blocks freed, recomputed later) until it can, the most recently admitted
among equals: with every priority equal (the default) that is vLLM V1's FCFS
(``self.running.pop()``), and a larger value preempted first is its priority policy's
``max(self.running, key=(priority, arrival_time))`` (vllm/v1/core/sched/scheduler.py).

The caller runs the step, then calls ``update_after_step`` (the scheduled tokens' KV is now
computed) and appends sampled tokens / finishes requests through ``finish_request``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # KV already in the blocks before this step
    # The request's block table itself (the KV manager's list, not a copy: a long context
    # holds thousands of blocks and every step schedules it). Read it before the next
    # ``schedule``, which may extend it; a step's readers (the model runner, the TP channel,
    # the simulated step's pricing) all do.
    block_ids: list[int]
    # True when this step reaches the request's last token, so it yields a new token.
    samples: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def key(self) -> object:
        """The same object at every step of this request (its ``Request``)."""
        return self.request

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.request.token_slice(start, start + self.num_new_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _priority(request: Request) -> float:
    return request.priority


def _is_decode(request: Request, num_new: int, samples: bool) -> bool:
    """A scheduled chunk counted as a decode token (else as prefill tokens)."""
    return samples and num_new == 1 and bool(request.output_token_ids)


def remembers_session(request: Request, keep_session: bool = False) -> bool:
    """Whether ``request``, finished with its status set, leaves its computed blocks as its
    session's remembered prefix: when it finished, or was aborted with ``keep_session`` (its
    caller had the answer) while it held its prompt's KV, as a finished request always does.
    One preempted since (no blocks) or still recomputing its prompt leaves the session's
    prefix as it was (its last finished call's), as a plain abort does."""
    if request.status != RequestStatus.FINISHED_ABORTED:
        return True
    return keep_session and request.num_computed_tokens >= request.num_prompt_tokens


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.cached_tokens_total = 0  # prompt tokens served from cache at first admission
        self.restored_tokens_total = 0  # of those, loaded from the secondary cache

    # ------------------------------------------------------------------ queues
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        capacity = self.kv.num_total_blocks * self.kv.block_size
        longest = min(request.num_tokens + request.params.max_tokens, self.max_model_len)
        if longest > capacity:
            raise ValueError(
                f"request {request.request_id!r} may grow to {longest} tokens; the KV cache "
                f"holds at most {capacity} ({self.kv.num_total_blocks} blocks of "
                f"{self.kv.block_size})"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus,
                       keep_session: bool = False) -> Request | None:
        """Finish (or abort) a request in any state, freeing every block it holds; its
        computed blocks become its session's remembered prefix as :func:`remembers_session`
        says. Returns the request, or None if it is unknown or already finished."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request, remember_session=remembers_session(request, keep_session))
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        running, allocate = self.running, self.kv.allocate_slots
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = min(request.num_prompt_tokens + len(request.output_token_ids)
                          - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not allocate(request, num_new):
                victim = max(reversed(running), key=_priority)  # the last of the largest
                scheduled_already = running.index(victim) < i
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
                if scheduled_already:  # ranked ahead of it, so run earlier this step: undo
                    budget += self._unschedule(out, victim)
                    i -= 1
            if request.status != RequestStatus.RUNNING:
                break  # it preempted itself (as vLLM's priority policy, nothing after it runs)
            self._add_scheduled(out, request, num_new)
            budget -= num_new
            i += 1

        if not out.preempted_ids:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                prefix = (
                    self.kv.get_computed_blocks(request)
                    if not self.kv.holds_blocks(request.request_id)
                    else None
                )
                computed = prefix.num_tokens if prefix is not None else 0
                num_new = min(request.num_tokens - computed, budget)
                if not self.kv.allocate_slots(request, num_new, prefix):
                    break
                self.waiting.popleft()
                if prefix is not None:
                    request.num_computed_tokens = computed
                    if not request.admitted:
                        request.num_cached_tokens = min(computed, request.num_prompt_tokens)
                        request.num_restored_tokens = min(
                            prefix.num_restored_tokens, request.num_cached_tokens
                        )
                        self.cached_tokens_total += request.num_cached_tokens
                        self.restored_tokens_total += request.num_restored_tokens
                request.admitted = True
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                self._add_scheduled(out, request, num_new)
                budget -= num_new
        return out

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        computed = request.num_computed_tokens
        samples = computed + num_new == request.num_prompt_tokens + len(request.output_token_ids)
        out.scheduled.append(ScheduledRequest(request, num_new, computed,
                                              self.kv.block_ids(request.request_id), samples))
        if _is_decode(request, num_new, samples):
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += num_new

    @staticmethod
    def _unschedule(out: SchedulerOutput, request: Request) -> int:
        """Take a request preempted after it was scheduled this step out of ``out`` (its
        blocks are free now, maybe another's already): the tokens it had (none when the
        step skipped it, having nothing to compute)."""
        k = next((k for k, x in enumerate(out.scheduled) if x.request is request), None)
        if k is None:
            return 0
        gone = out.scheduled.pop(k)
        if _is_decode(request, gone.num_new_tokens, gone.samples):
            out.num_decode_tokens -= 1
        else:
            out.num_prefill_tokens -= gone.num_new_tokens
        return gone.num_new_tokens

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free the blocks, back to the front of the waiting queue."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------ after a step
    def update_after_step(self, out: SchedulerOutput) -> None:
        """The scheduled tokens' KV is computed: advance counters, cache full blocks."""
        for s in out.scheduled:
            request = s.request
            if request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
            self.kv.cache_computed_blocks(request)
