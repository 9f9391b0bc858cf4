"""The router's core: place a call, forward it, stream its events, keep the books.

Nothing here is HTTP: the aiohttp layer (router.app) and the replay driver (in-process,
virtual clock) call :meth:`RouterCore.submit` alike; time comes from the injected clock
(default: the running loop's ``loop.time()``).

Sessions (:mod:`router.sessions.books`): a call sent without a session id gets one before it
is placed (the session its prompt continues when inference is on, else a session of one,
``anon-<call id>``); ``call.session_id`` is updated in place. Within its session the call
joins the KV chain (branch, :mod:`router.sessions.table`) its prompt continues; placement
reads that branch's KV and the instance receives the call under the branch's key, so a side
call never moves the main loop or takes its KV. A subagent's first call (it names a parent)
is placed as its parent's continuation would be.

Failures: a call that fails before its first event (:class:`InstanceUnavailable`:
unreachable, an error answer, a broken stream, a missed first-token deadline) is retried
once on the next-best instance; an overloaded one is skipped the same way. After the first
event a failure ends the stream with an error event (``finish_reason="error"``), never a
silent truncation. An instance marked down for not answering cuts the calls waiting on it
within ``Deadlines.down_grace_s`` (``router.instances.waits``): one with no event yet is
re-placed (not its retry), one with events gets its error event. A call that missed a
deadline is aborted on its instance, and so is one whose consumer stops early (``aclose``;
after ``answered`` it counts as finished, and ends so on its instance, its session kept). Every failure counts against the
instance's health (``router.instances.call_health``; deadlines: ``Deadlines``), but for an
instance that shuts down on its own (``router.instances.shutdowns``): a call it ends with no
event yet is re-placed (not its retry), one with events gets the error its API tells as a 503.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Executor

import structlog

from router.instances import shutdowns
from router.instances.aborts import CallAborts
from router.instances.call_health import CallHealth, HealthRules
from router.instances.deadlines import DeadlineMissed, Deadlines, first_token_deadline
from router.instances.placement import PlacementCall, PlacementContext, PlacementPolicy, make_policy
from router.instances.state_polls import StatePolls
from router.instances.waits import (
    InstanceMarkedDown,
    InstanceWaits,
    RouterShuttingDown,
    close_stream,
)
from router.metrics import RouterMetrics
from router.outcomes import CallRejected, NoHealthyInstance, ShutDown, call_outcome, cut_by
from router.sessions.books import SessionBooks, SessionCall
from router.sessions.inference import SessionInference
from router.sessions.output_lengths import OutputLengths
from router.sessions.prefix_chain import PromptHashes
from router.sessions.table import SessionBranch, SessionRecord, SessionTable
from talaria.protocol import (
    CallEvent,
    CallRequest,
    CallUsage,
    InstanceClient,
    InstanceShuttingDown,
    InstanceState,
    InstanceUnavailable,
    InstanceUnreachable,
    Overloaded,
)
from talaria.protocol.text import block_hashes

log = structlog.get_logger(__name__)

__all__ = ["MAX_ATTEMPTS", "CallRejected", "NoHealthyInstance", "RouterCore"]

MAX_ATTEMPTS = 2  # the first choice and one retry


class RouterCore:
    def __init__(
        self,
        clients: Mapping[str, InstanceClient],
        policy: str | PlacementPolicy = "talaria",
        *,
        sessions: SessionTable | None = None,
        metrics: RouterMetrics | None = None,
        context: PlacementContext | None = None,
        clock: Callable[[], float] | None = None,
        block_size: int = 16,
        refresh_after_call: bool = True,
        refresh_interval_s: float = 0.05,
        deadlines: Deadlines | None = None,
        health_rules: HealthRules | None = None,
        inference: SessionInference | None = None,
        hash_executor: Executor | None = None,
        known_chain_blocks: int = 1 << 22,
    ) -> None:
        self.clients: dict[str, InstanceClient] = dict(clients)
        self.context = context if context is not None else PlacementContext()
        self.policy: PlacementPolicy = make_policy(policy, self.context) if isinstance(policy, str) else policy
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.outputs = OutputLengths()
        self.block_size = block_size
        self.refresh_after_call = refresh_after_call
        self.deadlines = deadlines if deadlines is not None else Deadlines()
        self.call_health = CallHealth(health_rules if health_rules is not None else HealthRules())
        self.waits = InstanceWaits(self.deadlines.down_grace_s)
        self._clock = clock
        self.books = SessionBooks(
            sessions if sessions is not None else SessionTable(), inference, block_size,
            known_chain_blocks, self._session_ended, self._let_go,
        )
        self.sessions = self.books.table
        self.inference = inference
        self.hash_executor = hash_executor  # None: prompts are hashed on the event loop
        self.states: dict[str, InstanceState] = {}
        self.healthy: set[str] = set(self.clients)  # optimistic until a poll or call says no
        # Answer their polls but cool down after failed calls: placed on only when no
        # instance is healthy (better a suspect instance than a 503).
        self.suspect: set[str] = set()
        self.aborts = CallAborts(self.clients, self.deadlines.state_s)
        self._stopped: dict[str, CallUsage | None] = {}  # calls answered, their usage (``answered``)
        self._polls = StatePolls(self._poll_state, refresh_interval_s)

    def now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    # ---- instance health and state ---------------------------------------------------------

    def update_state(self, state: InstanceState) -> None:
        """A reported state; a healthy one brings the instance back unless its calls put it
        in a cooldown (see ``router.instances.health``)."""
        self.states[state.instance_id] = state
        if state.healthy:
            self.waits.up(state.instance_id)  # it answers: its calls keep their deadlines
            if self.call_health.may_come_back(state.instance_id, self.now(), state.epoch):
                self.mark_up(state.instance_id)
            elif state.instance_id not in self.healthy:
                self.suspect.add(state.instance_id)
        else:
            self.mark_down(state.instance_id, "instance reports unhealthy")

    def mark_up(self, instance_id: str) -> None:
        self.suspect.discard(instance_id)
        if instance_id in self.clients and instance_id not in self.healthy:
            log.info("router.instance_up", instance=instance_id)
            self.healthy.add(instance_id)

    def mark_down(self, instance_id: str, reason: str, answering: bool = False) -> None:
        """The instance is down: it takes no calls, and the prefixes it held no longer count
        (an instance that comes back has lost its KV). Unless it still ``answering`` (its
        calls' failures put it in a cooldown), the calls waiting on it are cut within the
        grace (``router.instances.waits``)."""
        if not answering:
            self.waits.down(instance_id)
        self.suspect.discard(instance_id)
        if instance_id in self.healthy:
            log.warning("router.instance_down", instance=instance_id, reason=reason)
            self.healthy.discard(instance_id)
            self.context.prefix_index.drop_instance(instance_id)

    async def refresh(self, instance_id: str) -> bool:
        """Fetch one instance's state (or join the poll of it in flight: ``router.instances.state_polls``);
        marks it up or down. Returns whether it is healthy."""
        return await self._polls.poll(instance_id)

    async def _poll_state(self, instance_id: str) -> bool:
        try:
            async with asyncio.timeout(self.deadlines.state_s):
                state = await self.clients[instance_id].state()
        except Exception as exc:  # any failure to report in time counts as down
            self.mark_down(instance_id, f"state poll failed: {exc!r}")
            return False
        if state.instance_id != instance_id:  # a misconfigured address: not the polled one
            self.mark_down(instance_id, f"its state is instance {state.instance_id!r}'s")
            return False
        self.update_state(state)
        return state.healthy

    def call_failed(self, instance_id: str, exc: Exception) -> None:
        """A call failed on the instance: unreachable is down at once (until a poll finds it
        back); other failures count towards a cooldown (``router.instances.call_health``)."""
        kind = ("unreachable" if isinstance(exc, InstanceUnreachable)
                else "deadline" if isinstance(exc, DeadlineMissed) else "unavailable")
        self.metrics.call_failures.inc(instance=instance_id, kind=kind)
        log.warning("router.call_failed", instance=instance_id, kind=kind, error=str(exc))
        if kind == "unreachable" or self.call_health.failure(instance_id, self.now()):
            self.mark_down(instance_id, f"call failed ({kind}): {exc}", answering=kind != "unreachable")

    def instance_shutting_down(self, instance_id: str, call_id: str) -> None:
        """The instance ended a call as it shuts down (``router.instances.shutdowns``): counted
        apart, not against its health; it takes no call until a poll finds it answering."""
        self.metrics.call_failures.inc(instance=instance_id, kind="instance_shutdown")
        log.info("router.instance_shutting_down", instance=instance_id, call_id=call_id)
        self.mark_down(instance_id, "it is shutting down", answering=True)

    def shut_down(self) -> None:
        """The router shuts down past its drain: every call still waiting on an instance ends
        now as a failed one (``router.instances.waits``), aborted there, and no call is placed."""
        self.waits.close()

    def cleanup_sessions(self) -> int:
        return self.books.cleanup(self.now())

    async def close(self) -> None:
        """Stop: the aborts under way get their deadline to reach their instances."""
        await self.aborts.close()
        await self._polls.close()

    # ---- placement and forwarding -----------------------------------------------------------

    def placement_call(
        self, call: CallRequest, hashes: list[int] | None = None, affinity: str | None = None,
        siblings: tuple[tuple[str, str], ...] = (),
    ) -> PlacementCall:
        return PlacementCall(
            model=call.model,
            session_id=call.session_id,
            prompt_len=len(call.prompt_token_ids),
            block_hashes=hashes if hashes is not None else block_hashes(call.prompt_token_ids, self.block_size),
            block_size=self.block_size,
            expected_output=self.outputs.expected(call.model, call.params.max_tokens),
            affinity=affinity,
            siblings=siblings,
        )

    def rank(self, call: CallRequest, session: SessionBranch | None = None) -> list[str]:
        return self.policy.choose(self.placement_call(call), session, self.states, self.candidates())

    def candidates(self) -> set[str]:
        """Where calls may go: the healthy instances, else the suspect ones (none once the
        router shuts down)."""
        return set() if self.waits.closed else set(self.healthy or self.suspect)

    async def submit(self, call: CallRequest, repeated: int | None = None) -> AsyncIterator[CallEvent]:
        """Place and forward ``call``; yields its events, each tagged with ``instance_id``.

        Raises before the first event: :class:`NoHealthyInstance`, :class:`Overloaded`,
        :class:`CallRejected`. ``repeated``: see ``SessionBooks.start``."""
        start = self.now()
        books = self.books.start(call, await self._hash_prompt(call), start, repeated)
        previous, sent = books.branch.instance_id, books.sent
        pcall: PlacementCall | None = None
        instance_id: str | None = None
        stream: AsyncIterator[CallEvent] | None = None
        first: CallEvent | None = None
        outputs: list[int] = []
        outcome = "error"
        finished = False
        prefilling = True  # the call's prompt still counts as outstanding prefill
        tried: list[str] = []  # the instances the call was sent to, in order
        try:  # from here on the session's books are closed however the call ends
            siblings = books.record.side_calls_since(books.branch)
            pcall = self.placement_call(sent, books.prompt.hashes, books.affinity, siblings)
            ranked = self.policy.choose(pcall, books.view, self.states, self.candidates())
            instance_id, stream, first = await self._open(sent, ranked, pcall, tried)
            if previous is not None and previous != instance_id:  # its reservation there goes
                self._let_go(previous, [sent.session_id], reservations_only=True)
            self.metrics.placements.inc(
                instance=instance_id, returning="yes" if previous == instance_id else "no"
            )
            event: CallEvent = first
            while True:
                event.instance_id = instance_id
                outputs.extend(event.token_ids)
                if prefilling and (event.token_ids or event.finished):
                    prefilling = False
                    self.metrics.ttft.observe(self.now() - start, model=call.model)
                    self.context.prefill_done(instance_id, pcall.prompt_len)
                if event.finished:
                    finished = True
                    if shutdowns.ends_call(event):
                        self.instance_shutting_down(instance_id, call.call_id)
                        event = shutdowns.told(event)
                    failed = event.error is not None or event.finish_reason == "error"
                    outcome = "error" if failed else "ok"
                    if not failed:
                        self.call_health.success(instance_id)
                    self._count_usage(call, event.usage, len(outputs))
                yield event
                if finished:
                    break
                event = await self._next(stream, call, instance_id)
        except BaseException as exc:
            if not finished:
                outcome = call_outcome(exc, opened=instance_id is not None)
            raise
        finally:
            label = instance_id or (tried[-1] if tried and outcome != "error" else "none")
            await self._finish(call, books, instance_id, stream, start, outputs, outcome, pcall,
                               prefilling, label)

    def answered(self, call_id: str, usage: CallUsage | None = None) -> None:
        """The call's answer is whole before its events end (a stop string, a settled tool
        call): its consumer closing them now ends it on its instance as a finished call, its
        ``usage`` the answer's (None: its prompt and the tokens received are counted)."""
        self._stopped[call_id] = usage

    async def _hash_prompt(self, call: CallRequest) -> PromptHashes:
        """The prompt's block hashes, reusing a known chain of its session's (``router.sessions.prefix_chain``);
        on ``hash_executor`` when there is one, so a long prompt does not hold the loop."""
        hash_prompt, keys = self.books.chains.hash_prompt, self.books.chain_keys(call)
        if self.hash_executor is None or call.prompt_chain is not None:
            return hash_prompt(keys, call.prompt_token_ids, call.prompt_chain)
        return await asyncio.get_running_loop().run_in_executor(
            self.hash_executor, hash_prompt, keys, call.prompt_token_ids
        )

    async def _open(
        self, call: CallRequest, ranked: list[str], pcall: PlacementCall, tried: list[str]
    ) -> tuple[str, AsyncIterator[CallEvent], CallEvent]:
        """Send the call down ``ranked`` until one instance gives its first event: at most
        ``MAX_ATTEMPTS`` failures (an instance marked down meanwhile costs none, and is
        skipped when not yet tried); ``tried`` gets each instance as it is tried."""
        if self.waits.closed:
            raise NoHealthyInstance("the router is shutting down")
        if not ranked:
            raise NoHealthyInstance(f"no healthy instance can serve model {call.model!r}")
        errors: list[Exception] = []
        failures = 0
        for instance_id in ranked:
            if failures >= MAX_ATTEMPTS:
                break
            if tried:
                if instance_id not in self.candidates():
                    continue  # marked down since the call was ranked
                self.metrics.retries.inc(model=call.model)
            tried.append(instance_id)
            stream = aiter(self.clients[instance_id].submit(call))
            self.context.add(instance_id, pcall.prompt_len, pcall.prompt_len + pcall.expected_output)
            try:
                deadline = first_token_deadline(self.deadlines, self.states.get(instance_id), call.model)
                first = await self.waits.next_event(instance_id, stream, deadline, "first token")
                if shutdowns.ends_unanswered(first):
                    raise InstanceShuttingDown(f"instance {instance_id} is shutting down")
            except InstanceMarkedDown as exc:
                self._cut(instance_id, call.call_id, exc)
                errors.append(exc)
            except InstanceShuttingDown as exc:  # re-placed, as a cut call is
                self.instance_shutting_down(instance_id, call.call_id)
                errors.append(exc)
            except (InstanceUnavailable, StopAsyncIteration) as exc:
                failures += 1
                failure = (exc if isinstance(exc, InstanceUnavailable)
                           else InstanceUnavailable("the stream ended with no event"))
                self.call_failed(instance_id, failure)
                errors.append(failure)
                if isinstance(exc, DeadlineMissed):  # beside the retry, as a cut call's
                    self.aborts.later(instance_id, call.call_id)
            except Overloaded as exc:
                failures += 1
                errors.append(exc)
            except BaseException:  # cancelled (its client left): the call goes everywhere
                self._release(instance_id, pcall)
                self.aborts.later(instance_id, call.call_id)
                await close_stream(stream)
                raise
            else:
                self.context.prefix_index.insert(instance_id, call.model, pcall.block_hashes)
                return instance_id, stream, first
            self._release(instance_id, pcall)
            await close_stream(stream)
        if self.waits.closed:
            raise NoHealthyInstance("the router is shutting down")
        overloaded = [e for e in errors if isinstance(e, Overloaded)]
        if overloaded:
            raise Overloaded(str(overloaded[-1]), min(e.retry_after_s for e in overloaded))
        if (refusal := shutdowns.refusal(errors)) is not None:
            raise refusal
        log.warning("router.call_unplaced", call_id=call.call_id, errors=[str(e) for e in errors])
        raise NoHealthyInstance(f"no instance could take the call ({len(errors)} tried)")

    async def _next(self, stream: AsyncIterator[CallEvent], call: CallRequest, instance_id: str) -> CallEvent:
        """The call's next event; a failure becomes its error event."""
        try:
            return await self.waits.next_event(
                instance_id, stream, self.deadlines.stall_s, "event after the last"
            )
        except StopAsyncIteration:
            failure = InstanceUnavailable("the instance closed the stream before the call finished")
        except (InstanceUnavailable, Overloaded, ConnectionError, TimeoutError) as exc:
            failure = exc if isinstance(exc, InstanceUnavailable) else InstanceUnavailable(str(exc))
        if isinstance(failure, InstanceMarkedDown):
            self._cut(instance_id, call.call_id, failure)
        else:
            self.call_failed(instance_id, failure)
        if isinstance(failure, DeadlineMissed):
            await self.aborts.now(instance_id, call.call_id)
        end = CallEvent(call_id=call.call_id, finished=True, finish_reason="error",
                        error=f"instance {instance_id} failed mid-call: {failure}")
        return cut_by(end, ShutDown.ROUTER) if isinstance(failure, RouterShuttingDown) else end

    def _cut(self, instance_id: str, call_id: str, exc: InstanceMarkedDown) -> None:
        """A call cut from an instance marked down (or by the shut-down): counted (not against
        its health) and aborted there in the background (it may not answer for long)."""
        shutdown = isinstance(exc, RouterShuttingDown)
        self.metrics.call_failures.inc(instance=instance_id, kind="shutdown" if shutdown else "marked_down")
        (log.info if shutdown else log.warning)(
            "router.call_cut", instance=instance_id, call_id=call_id, error=str(exc))
        self.aborts.later(instance_id, call_id)

    def _release(self, instance_id: str, pcall: PlacementCall, prefilling: bool = True) -> None:
        """The call no longer counts on the instance (its prefill only if not yet done)."""
        if prefilling:
            self.context.prefill_done(instance_id, pcall.prompt_len)
        self.context.remove(instance_id, pcall.prompt_len + pcall.expected_output)

    def _count_usage(self, call: CallRequest, usage: CallUsage | None, n_outputs: int) -> None:
        completion = self.metrics.count_usage(call.model, usage, len(call.prompt_token_ids), n_outputs)
        self.outputs.observe(call.model, completion)

    async def _finish(
        self, call: CallRequest, books: SessionCall, instance_id: str | None,
        stream: AsyncIterator[CallEvent] | None, start: float, outputs: list[int], outcome: str,
        pcall: PlacementCall | None, prefilling: bool, label: str,
    ) -> None:
        """The call's end in every book. Its awaits (the abort, the stream's close) may be
        cancelled again (a shut-down cancelling what is left): the stream is closed and the
        books are kept all the same, or its session would count a call in flight forever."""
        now = self.now()
        try:
            if instance_id is not None and stream is not None and pcall is not None:
                self._release(instance_id, pcall, prefilling)
                try:
                    if outcome == "aborted":
                        await self.aborts.now(instance_id, call.call_id, call.call_id in self._stopped)
                        if call.call_id in self._stopped:  # answered: counted as a finished call is
                            outcome = "ok"
                            self.call_health.success(instance_id)
                            self._count_usage(call, self._stopped[call.call_id], len(outputs))
                finally:
                    await close_stream(stream)
                self.metrics.call_time.observe(now - start, model=call.model)
        finally:
            self._stopped.pop(call.call_id, None)
            self.metrics.requests.inc(model=call.model, instance=label, outcome=outcome)
            more = self.books.end(call, books, instance_id, now, outputs)
            if instance_id is not None:
                self.context.prefix_index.insert(instance_id, call.model, more)
            if instance_id is not None and self.refresh_after_call:
                self._polls.after_call(instance_id)

    def _session_ended(self, record: SessionRecord) -> None:
        """A session left the router's books (its last call, idle past the TTL, evicted)."""
        if record.last_finish is not None:
            self.metrics.sct.observe(record.last_finish - record.started_at, model=record.model)

    def _let_go(self, instance_id: str, keys: list[str], reservations_only: bool = False) -> None:
        """``instance_id`` forgets branch ``keys``, or only their reservations (``let_go``)."""
        name = "release_reservations" if reservations_only else "forget_sessions"
        if (let_go := getattr(self.clients.get(instance_id), name, None)) is not None:
            let_go(keys)

