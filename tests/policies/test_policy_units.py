"""Small policy units: round order, wait estimates, gap prediction, reservation bookkeeping,
what to stage."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from engine.interface import Residency
from engine.sampling_params import SamplingParams
from talaria.policies.config import PolicyConfig, preset
from talaria.policies.gap_predictor import GapPredictor
from talaria.policies.priority import Service, best_key, next_model
from talaria.policies.reservations import (
    Reservation,
    ReservationBook,
    demotion_due,
    yield_offload_pays,
)
from talaria.policies.round_scheduler import RoundScheduler
from talaria.policies.staging import lend_staging_due, predicted_next, staging_target
from talaria.protocol import CallRequest


def test_round_order_puts_the_current_model_last() -> None:
    rounds = RoundScheduler(["a", "b", "c"])
    work = {"a", "c"}
    assert rounds.next_model("a", work.__contains__) == "c"
    assert rounds.next_model("c", work.__contains__) == "a"
    assert rounds.next_model("b", work.__contains__) == "c"
    assert rounds.next_model(None, work.__contains__) == "a"
    assert rounds.next_model("a", {"a"}.__contains__) == "a"
    assert rounds.next_model("a", set().__contains__) is None
    with pytest.raises(ValueError, match="at least one model"):
        RoundScheduler([])


def test_wait_estimate_walks_the_round() -> None:
    rounds = RoundScheduler(["a", "b", "c"])
    kw = dict(
        current_left_s=1.0,
        has_work={"a", "b", "c"}.__contains__,
        slot_s={"a": 10.0, "b": 20.0, "c": 30.0}.__getitem__,
        switch_s={"a": 1.0, "b": 2.0, "c": 3.0}.__getitem__,
    )
    assert rounds.wait_s("a", "a", current_open=True, **kw) == 0.0
    assert rounds.wait_s("a", "b", current_open=True, **kw) == 1.0 + 2.0
    assert rounds.wait_s("a", "c", current_open=True, **kw) == 1.0 + (2.0 + 20.0) + 3.0
    # a's slot closed while others wait: a whole round, then the switch back
    assert rounds.wait_s("a", "a", current_open=False, **kw) == 1.0 + 22.0 + 33.0 + 1.0
    alone = dict(kw, has_work={"a"}.__contains__)
    assert rounds.wait_s("a", "a", current_open=False, **alone) == 1.0


def test_gap_prediction_prior_session_ewma_hint_and_last_call() -> None:
    gaps = GapPredictor(default_gap_s=5.0, alpha=0.5)
    gaps.on_arrival("s", "m", 100, now=0.0)
    gaps.on_end("s", 110, 10, now=1.0, hint_gap_s=None, last_call=False)
    assert gaps.predict_gap("s") == 5.0  # the prior
    gaps.on_arrival("s", "m", 130, now=3.0)  # gap 2.0
    gaps.on_end("s", 140, 10, now=4.0, hint_gap_s=None, last_call=False)
    assert gaps.predict_gap("s") == 2.0
    gaps.on_arrival("s", "m", 150, now=8.0)  # gap 4.0 -> EWMA 3.0
    gaps.on_end("s", 160, 10, now=9.0, hint_gap_s=None, last_call=False)
    assert gaps.predict_gap("s") == 3.0
    assert gaps.get("s").new_tokens == pytest.approx(0.5 * 10 + 0.5 * 20)  # growth 20, 10
    gaps.on_arrival("s", "m", 170, now=9.5)
    gaps.on_end("s", 180, 10, now=10.0, hint_gap_s=0.25, last_call=False)
    assert gaps.predict_gap("s") == 0.25  # the client's hint wins
    gaps.on_arrival("s", "m", 190, now=10.5)
    gaps.on_end("s", 200, 10, now=11.0, hint_gap_s=None, last_call=True)
    assert gaps.predict_gap("s") is None
    gaps.on_arrival("t", "m", 10, now=12.0)
    gaps.on_end("t", 20, 10, now=13.0, hint_gap_s=None, last_call=False)
    assert gaps.predict_gap("t") == gaps.global_gap_s < 5.0  # learned across sessions


def test_reservation_book_yield_order_and_expiry() -> None:
    book = ReservationBook()
    book.add(Reservation("s1", "a", 0.0, expected_return=5.0, expires=10.0, blocks=3, pinned=True))
    book.add(Reservation("s2", "a", 0.0, expected_return=9.0, expires=20.0, blocks=4, pinned=True))
    book.add(Reservation("s3", "b", 0.0, expected_return=1.0, expires=5.0, blocks=0))
    with pytest.raises(ValueError, match="already has a reservation"):
        book.add(Reservation("s1", "a", 0.0, 1.0, 2.0))
    assert [r.session_id for r in book.yield_order("a")] == ["s2", "s1"]
    assert [r.session_id for r in book.yield_order("a", exclude="s2")] == ["s1"]
    assert book.pinned_blocks("a") == 7
    assert [r.session_id for r in book.expired(10.0)] == ["s1", "s3"]
    assert book.next_expiry() == 5.0


def test_reservation_book_pop_releases_the_pin_whatever_a_hook_does() -> None:
    """``pop`` unpins a pinned reservation leaving the book even when ``on_change`` raises,
    and still tells ``on_change`` when ``unpin`` raises; ``add`` keeps the reservation when
    its hook raises (its pin is then released by a later ``pop``)."""
    heard: list[str] = []
    unpinned: list[str] = []
    broken: set[str] = set()

    def on_change(session_id: str) -> None:
        heard.append(session_id)
        if "hook" in broken:
            raise RuntimeError("TP group broken")

    def unpin(session_id: str) -> None:
        unpinned.append(session_id)
        if "unpin" in broken:
            raise RuntimeError("unpin failed")

    book = ReservationBook(on_change=on_change, unpin=unpin)
    broken.add("hook")
    with pytest.raises(RuntimeError, match="TP group broken"):
        book.add(Reservation("s", "a", 0.0, 1.0, 2.0, blocks=3, pinned=True))
    assert "s" in book and heard == ["s"] and unpinned == []
    with pytest.raises(RuntimeError, match="TP group broken"):
        book.pop("s")
    assert "s" not in book and unpinned == ["s"] and heard == ["s", "s"]
    broken.discard("hook")
    book.add(Reservation("t", "a", 0.0, 1.0, 2.0))  # not pinned: nothing to release
    assert book.pop("t") is not None and unpinned == ["s"]
    book.add(Reservation("u", "a", 0.0, 1.0, 2.0, blocks=3, pinned=True))
    broken.add("unpin")
    with pytest.raises(RuntimeError, match="unpin failed"):
        book.pop("u")
    assert "u" not in book and unpinned == ["s", "u"] and heard[-1] == "u"
    assert book.pop("u") is None and unpinned == ["s", "u"]


def test_yield_offload_needs_free_host_room_unless_eviction_is_allowed() -> None:
    assert yield_offload_pays(100.0, 800.0, 1000.0)
    assert yield_offload_pays(200.0, 800.0, 1000.0)  # exactly fills the store
    assert not yield_offload_pays(201.0, 800.0, 1000.0)  # would evict other sessions' KV
    assert yield_offload_pays(201.0, 800.0, 1000.0, may_evict=True)
    assert yield_offload_pays(201.0, None, None)  # the engine does not report its host store
    with pytest.raises(ValueError, match="need_bytes"):
        yield_offload_pays(-1.0, 0.0, 10.0)


@dataclass
class _Queued:
    call: CallRequest
    arrived: float = 0.0
    continuation: bool = True


@dataclass
class _View:
    """The parts of an instance staging looks at."""

    policy: PolicyConfig
    residency: dict[str, Residency]
    queues: dict[str, list[_Queued]]
    calls_done: dict[str, int]
    stageable: set[str]
    active_model: str | None = "a"
    models: tuple[str, ...] = ("a", "b", "c")
    reservations: ReservationBook = field(default_factory=ReservationBook)

    @property
    def rounds(self) -> RoundScheduler:
        return RoundScheduler(list(self.models))

    def now(self) -> float:
        return 10.0

    def queued(self, model: str) -> list[_Queued]:
        return self.queues.get(model, [])

    def can_stage(self, model: str) -> bool:
        return model in self.stageable

    def service(self, session_id: str, waiting_s: float) -> Service:
        return Service(5.0, waiting_s, 0.0, calls=self.calls_done[session_id])

    def best_waiting_key(self, calls: list[_Queued]) -> tuple[float, ...] | None:
        p = self.policy
        return best_key(p.admission_order, calls,
                        lambda c: self.service(c.call.session_id, self.now() - c.arrived),
                        p.starvation_ratio, min_wait_s=p.starvation_min_wait_s)


def _queued(session: str, model: str) -> _Queued:
    return _Queued(CallRequest(f"{session}#0", session, model, [1, 2, 3],
                               SamplingParams(max_tokens=1)))


def test_staging_target_is_the_next_model_that_fits_the_staging_region() -> None:
    host = {"a": Residency.ACTIVE, "b": Residency.HOST, "c": Residency.HOST}
    queues = {"b": [_queued("early", "b")], "c": [_queued("late", "c")]}
    done = {"early": 1, "late": 60}
    view = _View(preset("+sp"), host, queues, done, {"b", "c"})
    assert staging_target(view) == "b"  # round order after a
    # under the priority switch: the model of the first session (60 calls made: c)
    prio = _View(preset("talaria"), host, queues, done, {"b", "c"})
    assert staging_target(prio) == "c"
    # a model whose shard does not fit the staging region is never staged
    assert staging_target(_View(preset("talaria"), host, queues, done, {"b"})) is None
    # nothing queued: the model of the first session expected back
    view = _View(preset("talaria"), host, {}, {"early": 1, "late": 60}, {"b", "c"})
    for sid, model in (("early", "b"), ("late", "c")):
        view.reservations.add(Reservation(sid, model, 0.0, 12.0, 60.0))
    assert staging_target(view) == "c"
    # equal first sessions: the model with more calls queued is staged, not round order's
    tied = {"b": [_queued("b1", "b")], "c": [_queued("c1", "c"), _queued("c2", "c")]}
    fresh = {"b1": 0, "c1": 0, "c2": 0}
    assert staging_target(_View(preset("talaria"), host, tied, fresh, {"b", "c"})) == "c"
    # one copy at a time
    busy = dict(host, b=Residency.STAGING)
    assert staging_target(_View(preset("talaria"), busy, queues, done, {"b", "c"})) is None


def test_demotion_is_due_only_when_queued_calls_need_more_than_the_empty_blocks() -> None:
    assert demotion_due(queued_blocks=15, free_blocks=13)
    assert not demotion_due(queued_blocks=13, free_blocks=13)  # they fit: no eviction
    assert not demotion_due(queued_blocks=0, free_blocks=0)  # nothing waits
    with pytest.raises(ValueError):
        demotion_due(queued_blocks=-1, free_blocks=3)


def test_staging_is_lent_only_when_queued_calls_overflow_the_kv_region_and_it_adds_blocks() -> None:
    assert lend_staging_due(queued_blocks=30, capacity_blocks=20, lent_capacity_blocks=40)
    # they fit the KV region as it is: the staging region keeps the next model's weights
    assert not lend_staging_due(queued_blocks=20, capacity_blocks=20, lent_capacity_blocks=40)
    # no staging region (or one too small for a block): lending adds nothing
    assert not lend_staging_due(queued_blocks=30, capacity_blocks=20, lent_capacity_blocks=20)
    with pytest.raises(ValueError):
        lend_staging_due(queued_blocks=-1, capacity_blocks=20, lent_capacity_blocks=40)


@pytest.mark.parametrize("policy", ["+sp", "talaria"])
def test_staging_predicts_only_when_its_prediction_could_be_staged(policy: str) -> None:
    """``staging_target`` skips the prediction when no model it could name can be staged;
    on random instances it stages exactly what predicting every time would."""
    rng = random.Random(3)
    models = ("a", "b", "c", "d")
    for _ in range(400):
        residency = {m: rng.choice([Residency.HOST, Residency.STAGED]) for m in models}
        active = rng.choice(models)
        residency[active] = Residency.ACTIVE
        queues = {m: [_queued(f"{m}{i}", m) for i in range(rng.randrange(3))]
                  for m in models if rng.random() < 0.5}
        done = {f"{m}{i}": rng.randrange(80) for m in models for i in range(3)}
        view = _View(preset(policy), residency, queues, done,
                     {m for m in models if rng.random() < 0.7}, active_model=active,
                     models=models)
        for m in models:
            if rng.random() < 0.3:
                view.reservations.add(Reservation(f"{m}0", m, 0.0, rng.uniform(1, 20), 60.0))
        nxt = predicted_next(view)
        stageable = {m for m, r in residency.items() if r == Residency.HOST and view.can_stage(m)}
        assert staging_target(view) == (nxt if nxt in stageable else None)


def test_staging_breaks_full_ties_as_the_switch_it_predicts() -> None:
    """Two models other than the active one, each with one fresh session (same calls made,
    same first arrival): the priority ties, so ``next_model`` takes the first in round order
    after the active model (c after b). Staging predicts that switch (``first_model``'s ties),
    so it must stage c, not the catalog's first model a."""
    host = {"a": Residency.HOST, "b": Residency.ACTIVE, "c": Residency.HOST}
    queues = {"a": [_queued("a1", "a")], "c": [_queued("c1", "c")]}
    view = _View(preset("talaria"), host, queues, {"a1": 0, "c1": 0}, {"a", "c"},
                 active_model="b")
    p = view.policy
    switched_to = next_model(
        view.rounds, "b", {m: view.queued(m) for m in view.models}, p.model_choice,
        lambda c: view.service(c.call.session_id, view.now() - c.arrived), p.starvation_ratio,
        p.admission_order, min_wait_s=p.starvation_min_wait_s)
    assert switched_to == "c"
    assert predicted_next(view) == switched_to
    assert staging_target(view) == switched_to
