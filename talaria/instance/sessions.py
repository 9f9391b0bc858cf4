"""An instance's per-session state: history, where each session's KV is, soft reservations.

A session here is one KV chain, named by the call's ``session_id``. The router sends each
chain of a client's session under its own id (``router.sessions.table``: the main loop under the
session id, a side call that does not continue it under ``<session id>#<n>``), so a side
call never shares a record, a reservation or the engine's remembered chain with the main
loop: everything below keyed by session id is keyed by chain.

It carries out the reservation life cycle described in ``talaria.policies.reservations``
(create on call end, consume on admission, expire, yield under memory pressure, unpin on a
switch away, release on shutdown). All engine calls go through the executor, from the
admission loop's task only. ``report`` keeps each session's entry of the state report as its
KV map, reservation or model changes (``talaria.instance.session_report``); a session the
router no longer holds is dropped here too (``drop``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable
from typing import TypeVar

import structlog

from talaria.instance.executor import EngineExecutor
from talaria.instance.rates import RateBook
from talaria.instance.session_report import SessionReport, TouchingDict
from talaria.policies.config import PolicyConfig
from talaria.policies.gap_predictor import GapPredictor
from talaria.policies.priority import Service, priority_key, remaining_key
from talaria.policies.reservations import Reservation, ReservationBook, yield_offload_pays
from talaria.policies.session_length import swe_agent_prior
from talaria.policies.ttl import continuum_ttl
from talaria.policies.view import QueuedCall
from talaria.protocol import CallRequest, SessionKV

log = structlog.get_logger("talaria.sessions")

__all__ = ["SessionKeeper"]

T = TypeVar("T")

QUEUE_DELAY_WINDOW = 64  # recent admission waits averaged for Continuum's queueing delay


class SessionKeeper:
    def __init__(
        self,
        policy: PolicyConfig,
        executor: EngineExecutor,
        rates: RateBook,
        counters: dict[str, int],
    ) -> None:
        self.policy = policy
        self.executor = executor
        self.rates = rates
        self.counters = counters
        self.gaps = GapPredictor(policy.default_gap_s, policy.gap_ewma_alpha)
        self.report = SessionReport(self._entry)
        self.reservations = ReservationBook(on_change=self._reservation_changed,
                                            unpin=executor.unpin_session_kv)
        # session -> (device, host) tokens; a change marks the session's report entry
        self.kv_tokens: dict[str, tuple[int, int]] = TouchingDict(self.report.touch)
        self.recent_waits: deque[float] = deque(maxlen=QUEUE_DELAY_WINDOW)
        for key in ("reservations", "reservations_consumed", "reservations_expired",
                    "reservations_released"):
            counters.setdefault(key, 0)
        counters.setdefault("reservations_yielded", 0)
        counters.setdefault("reservations_yielded_dropped", 0)
        counters.setdefault("sessions_dropped", 0)

    def _reservation_changed(self, session_id: str) -> None:
        """A reservation was made or ended: the session's report entry changes, and, with
        host KV, the engine keeps a reserved session's host KV past every unreserved
        session's (a switch away leaves a reservation's KV in host memory only, where plain
        LRU would evict it before KV nobody is expected back for). A yield ends the
        reservation, and the hold with it: the yielded session was the one expected back
        last, and its host KV is then kept as any other session's."""
        self.report.touch(session_id)
        if self.policy.host_kv:
            self.executor.hold_host_kv(session_id, session_id in self.reservations)

    def model_of(self, session_id: str) -> str | None:
        hist = self.gaps.get(session_id)
        return hist.model if hist is not None else None

    def on_arrival(self, call: CallRequest, now: float) -> bool:
        """Record a call's arrival; True when it continues a session served here before."""
        hist = self.gaps.get(call.session_id)
        continuation = hist is not None and hist.calls > 0 and hist.model == call.model
        self.gaps.on_arrival(call.session_id, call.model, len(call.prompt_token_ids), now)
        self.report.touch(call.session_id)  # its model may have changed
        return continuation

    def on_admit(self, session_id: str) -> None:
        """The session's call is in the engine: its request now references the session's
        blocks, so its reservation (if any) is consumed and its pin released."""
        if self.reservations.pop(session_id) is not None:
            self.counters["reservations_consumed"] += 1

    def service(self, session_id: str, waiting_s: float) -> Service:
        """What the session has had so far, for priority rules; ``waiting_s``: how long its
        current call has waited."""
        hist = self.gaps.get(session_id)
        res = self.reservations.get(session_id)
        pinned = res is not None and res.pinned
        if hist is None:
            return Service(0.0, waiting_s, 0.0, pinned)
        cached = self.kv_tokens.get(session_id, (0, 0))[0] if self.policy.queue_order == "lpm" else 0
        return Service(hist.attained_s, hist.waited_s + waiting_s, hist.first_arrival, pinned,
                       hist.calls, cached)

    def waiting_key(self, now: float) -> Callable[[QueuedCall], tuple[float, ...]]:
        """A waiting call's priority key at loop time ``now`` under the policy's admission
        order, its wait counted from its arrival: ``priority.priority_key`` of its session's
        ``service``. Under ``remaining`` it reads the session's history directly instead of
        building a ``Service`` (the loop ranks every queue each turn)."""
        policy = self.policy
        order, ratio = policy.admission_order, policy.starvation_ratio
        floor = policy.starvation_min_wait_s
        if order != "remaining":
            return lambda c: priority_key(order, self.service(c.call.session_id, now - c.arrived),
                                          ratio, min_wait_s=floor)
        history = self.gaps.get

        def key(c: QueuedCall) -> tuple[float, ...]:
            hist = history(c.call.session_id)
            if hist is None:
                return remaining_key(now - c.arrived, 0.0, 0.0, 0, ratio, floor)
            return remaining_key(hist.waited_s + (now - c.arrived), hist.attained_s,
                                 hist.first_arrival, hist.calls, ratio, floor)
        return key

    def best_waiting_key(self, calls: Collection[QueuedCall], now: float) -> tuple[float, ...] | None:
        """The best of ``waiting_key`` over ``calls`` (None: no calls). Under ``remaining``
        the same minimum without a key per call (the priority switch ranks the slot's calls
        and every other queue each turn): the starved call that has waited longest (the
        earliest session among equal waits), else the fewest expected remaining calls (the
        earliest session among equals), as ``remaining_key`` orders them."""
        if not calls:
            return None
        policy = self.policy
        if policy.admission_order != "remaining":
            return min(map(self.waiting_key(now), calls))
        ratio, floor = policy.starvation_ratio, policy.starvation_min_wait_s
        history, expected = self.gaps.sessions.get, swe_agent_prior().expected_remaining
        inf = float("inf")
        starved_wait, starved_first = -inf, inf  # the longest wait among the starved
        fewest, fewest_first = inf, inf  # the fewest expected remaining calls otherwise
        for c in calls:
            hist = history(c.call.session_id)
            if hist is None:  # unknown here: never starved, no call made, first arrival 0
                remaining, first = expected(0), 0.0
            else:
                waited, first = hist.waited_s + (now - c.arrived), hist.first_arrival
                if waited >= ratio * hist.attained_s > 0 and waited >= floor:
                    if waited > starved_wait or (waited == starved_wait and first < starved_first):
                        starved_wait, starved_first = waited, first
                    continue
                if starved_wait > -inf:  # a starved call outranks every other
                    continue
                remaining = expected(hist.calls)
            if remaining < fewest or (remaining == fewest and first < fewest_first):
                fewest, fewest_first = remaining, first
        if starved_wait > -inf:
            return (0.0, -starved_wait, starved_first)
        return (1.0, fewest, fewest_first)

    def on_call_end(
        self, call: CallRequest, output_tokens: int, now: float, waited_s: float = 0.0,
        served_s: float = 0.0,
    ) -> None:
        """Learn from a finished call (it waited ``waited_s`` for admission and ran
        ``served_s``) and reserve for the session's likely return."""
        total = len(call.prompt_token_ids) + output_tokens
        self.gaps.on_end(
            call.session_id, total, output_tokens, now, call.expected_gap_s, call.last_call
        )
        self.gaps.on_service(call.session_id, waited_s, served_s)
        self.recent_waits.append(waited_s)
        self.kv_tokens[call.session_id] = self.executor.session_kv_tokens(call.session_id)
        if not self.policy.soft_reservations or call.last_call:
            return
        gap = self.gaps.predict_gap(call.session_id)
        if gap is None:
            return
        ttl = self._ttl(call.model, total)
        # A fixed TTL reserves only for returns expected within it; Continuum's rule already
        # weighs the whole gap distribution, so its TTL stands whatever this session's gap.
        if ttl <= 0 or (self.policy.reservation_ttl == "fixed" and gap >= ttl):
            return
        self.reservations.pop(call.session_id)
        blocks = self.executor.pin_session_kv(call.session_id)
        self.counters["reservations"] += 1  # before ``add``: it stands even if the hook raises
        self.reservations.add(
            Reservation(
                session_id=call.session_id,
                model=call.model,
                created=now,
                expected_return=now + gap,
                expires=now + ttl,
                blocks=blocks,
                pinned=True,
            )
        )

    def _ttl(self, model: str, prefix_tokens: int) -> float:
        """How long a reservation made now lives: the configured TTL, or Continuum's rule
        (its reload cost: prefilling the session's prefix at the measured rate)."""
        if self.policy.reservation_ttl == "fixed":
            return self.policy.reservation_ttl_s
        waits = self.recent_waits
        delay = sum(waits) / len(waits) if waits else 0.0
        reload = self.rates.models[model].prefill_s(prefix_tokens)
        return continuum_ttl(list(self.gaps.recent_gaps), reload, delay)

    def expire(self, now: float) -> bool:
        """End the reservations expired by ``now``; True when any ended."""
        expired = self.reservations.expired(now)

        def end(res: Reservation) -> None:
            self.counters["reservations_expired"] += 1
            self.reservations.pop(res.session_id)

        errors = _each(expired, end)
        if errors:
            raise errors[0]
        return bool(expired)

    async def yield_reservation(self, res: Reservation) -> None:
        """Memory pressure: give up a reservation's blocks, offloading them first when host
        KV is on and the host store has free room for them (``yield_offload_pays``: a copy
        into a full store would evict KV needed sooner), so the session restores instead of
        recomputing; otherwise the blocks are only unpinned. Under KV demotion the session's
        KV went to host when its call ended: unless the store evicted it since, nothing is
        left to copy."""
        if self.policy.host_kv and self._offload_pays(res.session_id):
            await self.executor.offload_kv([res.session_id])
        elif self.policy.host_kv:
            self.counters["reservations_yielded_dropped"] += 1
        self.reservations.pop(res.session_id)
        self.counters["reservations_yielded"] += 1
        self.kv_tokens[res.session_id] = self.executor.session_kv_tokens(res.session_id)
        log.debug("reservation_yielded", session=res.session_id, blocks=res.blocks)

    def _offload_pays(self, session_id: str) -> bool:
        extra = self.executor.stats().extra
        device, host = self.executor.session_kv_tokens(session_id)
        model = self.model_of(session_id)
        per_token = self.rates.kv_bytes_per_token[model] if model is not None else 0.0
        return yield_offload_pays(
            max(0, device - host) * per_token,
            extra.get("host_kv_used_bytes"),
            extra.get("host_kv_capacity_bytes"),
            may_evict=self.policy.yield_offload_may_evict,
        )

    def device_tokens_of(self, model: str) -> int:
        return sum(dev for s, (dev, _host) in self.kv_tokens.items() if self.model_of(s) == model)

    def switch_out(self, model: str) -> None:
        """``model`` is being switched out: its reservations stay alive (they still predict
        returns) but lose their device blocks, which the switch drops (pins included)."""
        for res in self.reservations.for_model(model):
            if res.pinned:
                self.executor.unpin_session_kv(res.session_id)
                res.pinned = False
            res.blocks = 0

    def release_all(self) -> None:
        """On shutdown: unpin every live reservation (best effort if the engine failed)."""
        for res in self.reservations.all():
            try:
                self.reservations.pop(res.session_id)
            except Exception:
                log.exception("unpin_failed", session=res.session_id)

    def refresh(self, now: float, live_sessions: set[str]) -> None:
        """Re-read where each session's KV is; forget sessions with nothing left here that
        have been quiet for ``session_memory_s``, then, beyond ``max_sessions``, the least
        recently seen ones with no call here and no reservation (here and in the engine)."""
        known = self.kv_tokens
        for session_id, hist in list(self.gaps.sessions.items()):
            kv = self.executor.session_kv_tokens(session_id)
            quiet = now - hist.last_seen > self.policy.session_memory_s
            empty = kv == (0, 0) and session_id not in self.reservations
            if empty and quiet and session_id not in live_sessions:
                self.forget(session_id)
            elif known.get(session_id) != kv:  # most sessions' KV is where it was
                known[session_id] = kv
        excess = len(self.gaps.sessions) - self.policy.max_sessions
        if excess > 0:
            idle = sorted(
                (h for s, h in self.gaps.sessions.items()
                 if s not in live_sessions and s not in self.reservations),
                key=lambda h: h.last_seen,
            )
            for hist in idle[:excess]:
                self.forget(hist.session_id)

    def forget(self, session_id: str) -> None:
        self.gaps.forget(session_id)
        self.kv_tokens.pop(session_id, None)
        self.report.touch(session_id)
        self.executor.forget_session(session_id)

    def known(self, session_id: str) -> bool:
        """Whether a forget of the session has anything to drop here."""
        return self.gaps.get(session_id) is not None or session_id in self.reservations

    def releasable(self, session_ids: Iterable[str]) -> list[str]:
        """Of sessions gone to another instance, those whose reservation here a release
        takes. Not hard pins (Continuum's): they last their TTL whatever a router says, as
        in Continuum's own scheduler."""
        if self.policy.hard_pins:
            return []
        return [s for s in session_ids if s in self.reservations]

    def drop(self, session_ids: set[str], release: set[str], live_sessions: set[str]) -> bool:
        """Sessions the router no longer holds: forgotten here too, reservations released
        first; and sessions gone to another instance (``release``): their reservations alone
        released (``releasable`` chose them). Neither when a call of theirs is here (then
        they are current again). True when any was dropped or released (its blocks may be
        free now). A hook that raises for one session (``ReservationBook.pop``) leaves the
        rest of the batch done all the same; the first error is raised at the end."""
        dropped = False

        def release_one(session_id: str) -> None:
            nonlocal dropped
            if session_id in self.reservations:  # counted whether or not its hook raises
                dropped = True
                self.counters["reservations_released"] += 1
                self.reservations.pop(session_id)

        def drop_one(session_id: str) -> None:
            nonlocal dropped
            if not self.known(session_id):
                return
            dropped = True
            try:
                self.reservations.pop(session_id)
            finally:
                self.forget(session_id)
                self.counters["sessions_dropped"] += 1

        errors = (_each(sorted(release - session_ids - live_sessions), release_one)
                  + _each(sorted(session_ids - live_sessions), drop_one))
        if errors:
            raise errors[0]
        return dropped

    def _entry(self, session_id: str) -> SessionKV | None:
        """The session's entry in the state report: where its KV is and its reservation;
        None for a session with neither."""
        hist = self.gaps.get(session_id)
        if hist is None:
            return None
        device, host = self.kv_tokens.get(session_id, (0, 0))
        res = self.reservations.get(session_id)
        if device == 0 and host == 0 and res is None:
            return None
        return SessionKV(
            session_id=session_id,
            model=hist.model,
            device_tokens=device,
            host_tokens=host,
            reserved_until=res.expires if res is not None else None,
            expected_return=res.expected_return if res is not None else None,
        )


def _each(items: Iterable[T], action: Callable[[T], None]) -> list[Exception]:
    """``action`` on every item, whichever raise; the errors, in order (the caller raises the
    first once its whole batch is done)."""
    errors = []
    for item in items:
        try:
            action(item)
        except Exception as exc:
            errors.append(exc)
    return errors
