"""D2D staging: which model to copy into the device staging region while the current runs.

The model most likely needed next: under the priority switch, the one the priority would
pick (the model of the first queued session, else of the first session expected back; ties
as ``priority.first_model`` breaks them);
otherwise the next one in round order (after the active model) with queued calls, else with
live reservations. It is staged only when its weights are only in host memory, fit the
staging region, and no other staging copy is in progress, so a staged model is not replaced
while it is still the best guess.

Under KV pressure a slot may instead lend the staging region to the KV cache
(``lend_staging_due``): the model switched in gets more KV blocks, and the next switch is an
H2D copy because nothing can be staged meanwhile.
"""

from __future__ import annotations

from engine.interface import Residency
from talaria.policies.config import PolicyConfig
from talaria.policies.priority import first_model, priority_key
from talaria.policies.view import InstanceView

__all__ = ["call_capacity_blocks", "lend_staging_due", "predicted_next", "staging_target"]


def predicted_next(view: InstanceView) -> str | None:
    return _predict(view, *_candidates(view))


def _predict(view: InstanceView, candidates: set[str], by_queue: bool) -> str | None:
    if view.policy.priority_switch:
        return _first_by_priority(view, candidates, by_queue)
    return view.rounds.next_model(view.active_model, candidates.__contains__)


def _candidates(view: InstanceView) -> tuple[set[str], bool]:
    """The models the prediction chooses among: those other than the active one with calls
    queued (True), else those with a live reservation (False)."""
    active = view.active_model
    queued = {m for m in view.models if m != active and view.queued(m)}
    if queued:
        return queued, True
    return {r.model for r in view.reservations.all() if r.model != active}, False


def _first_by_priority(view: InstanceView, candidates: set[str], by_queue: bool) -> str | None:
    order, ratio = view.policy.admission_order, view.policy.starvation_ratio
    floor = view.policy.starvation_min_wait_s
    # first_model's last tie-break is its dict's order: round order after the active model,
    # as the switch it predicts (priority.next_model) builds it
    rounds = view.rounds.after(view.active_model)
    best: dict[str, tuple[float, ...]] = {}
    if by_queue:
        for m in rounds:
            if m in candidates and (key := view.best_waiting_key(view.queued(m))) is not None:
                best[m] = key
        return first_model(order, best, {m: len(view.queued(m)) for m in best})
    counts: dict[str, int] = {}
    keys: dict[str, tuple[float, ...]] = {}
    for res in view.reservations.all():
        if res.model in candidates:
            key = priority_key(order, view.service(res.session_id, 0.0), ratio, min_wait_s=floor)
            counts[res.model] = counts.get(res.model, 0) + 1
            if res.model not in keys or key < keys[res.model]:
                keys[res.model] = key
    best = {m: keys[m] for m in rounds if m in keys}
    return first_model(order, best, counts) if best else None


def staging_target(view: InstanceView) -> str | None:
    """The model to start staging now, or None. The prediction (which ranks every queued
    call) is made only when a model it could name could be staged."""
    if any(r == Residency.STAGING for r in view.residency.values()):
        return None
    stageable = {m for m, r in view.residency.items()
                 if r == Residency.HOST and view.can_stage(m)}
    candidates, by_queue = _candidates(view)
    if not stageable & candidates:
        return None
    nxt = _predict(view, candidates, by_queue)
    return nxt if nxt in stageable else None


def call_capacity_blocks(policy: PolicyConfig, capacity_blocks: int,
                         lent_capacity_blocks: int) -> int:
    """The most KV blocks one call of a model can hold whenever it runs: its KV region with
    the staging region lent to it where the policy lends under pressure (``lend_staging``
    with ``d2d_staging``), else its KV region alone. A queued call that needs more than the
    KV region is pressure by itself (``lend_staging_due``), so its slot lends the region
    (at the switch, or once the calls in flight end) and the call then fits."""
    if policy.lend_staging and policy.d2d_staging:
        return max(capacity_blocks, lent_capacity_blocks)
    return capacity_blocks


def lend_staging_due(queued_blocks: int, capacity_blocks: int, lent_capacity_blocks: int) -> bool:
    """Whether the model being switched in borrows the staging region for its KV cache for
    this slot: the calls queued for it need more blocks (``queued_blocks``, each call's
    prompt and all of its output) than its KV region holds (``capacity_blocks``), and the
    staging region adds blocks (``lent_capacity_blocks``: with it lent). Such a slot is
    bound by KV, not by switches: blocks that would otherwise make calls wait, or evict KV
    that is recomputed later, are worth more than a D2D switch at its end (the next
    switch copies from host instead: seconds, against a slot that lasts minutes). Without
    pressure the staging region stays what it is for.

    Measured (``make replay``, Talaria at drained/240 s): on the real trace of 179 sessions at
    once it acts once, at the first switch, when the first calls of 98 Qwen sessions are all
    queued: 1572 / 2962 s p50 / p95 without lending and 1408 / 2748 s with it; on the
    default trace no switch meets pressure and nothing changes."""
    if min(queued_blocks, capacity_blocks, lent_capacity_blocks) < 0:
        raise ValueError(f"block counts must be >= 0, got {queued_blocks}, {capacity_blocks}, "
                         f"{lent_capacity_blocks}")
    return lent_capacity_blocks > capacity_blocks and queued_blocks > capacity_blocks
