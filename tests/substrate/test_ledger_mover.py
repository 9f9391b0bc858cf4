"""Ledger plans and mover records agree on bytes; placements follow the plan/commit cycle."""

from __future__ import annotations

import pytest
import torch

from substrate.arena import DeviceArena
from substrate.host_kv import HostKVStore
from substrate.host_weights import HostWeightStore
from substrate.layout import TensorSpec, WeightLayout
from substrate.ledger import Ledger, Placement, StagingState
from substrate.mover import TorchMover
from substrate.moves import MoveKind, MoveRecord, PlannedMove, RateMover
from substrate.staging import Stager


def _layout(n: int) -> WeightLayout:
    return WeightLayout(
        [TensorSpec("w", (n,), torch.float32), TensorSpec("b", (3,), torch.float16)]
    )


def test_ledger_and_mover_agree_on_bytes_through_a_switch_cycle() -> None:
    layouts = {"a": _layout(100), "b": _layout(300)}
    arena = DeviceArena.for_layouts("cpu", list(layouts.values()), kv_bytes=4096)
    hosts = HostWeightStore(pin=False)
    kv_store = HostKVStore(capacity_bytes=4096, pin=False)
    ledger = Ledger(arena.weight_bytes, arena.staging_bytes, host_kv=kv_store.index)
    for name, layout in layouts.items():
        nbytes = hosts.add_model(name, layout, lambda views: [v.fill_(1) for v in views.values()])
        ledger.add_host_model(name, nbytes)
    mover, stager = TorchMover("cpu"), Stager(arena.staging_region)

    def activate(name: str) -> MoveRecord:
        plan = ledger.plan_activation(name)
        if plan.kind == MoveKind.ACTIVATE_D2D:
            stager.wait()
            record = mover.activate_from_staging(
                arena.weight_region, arena.staging_region, plan.bytes
            )
        else:
            record = mover.activate_from_host(
                arena.weight_region, hosts.get(name).buffer, plan.bytes
            )
        assert (record.kind, record.bytes) == (plan.kind, plan.bytes)
        ledger.commit_activation(name)
        ledger.record(record)
        return record

    assert activate("a").kind == MoveKind.ACTIVATE_H2D
    assert ledger.placements() == {"a": Placement.ACTIVE, "b": Placement.HOST}

    plan = ledger.plan_staging("b")
    assert plan == PlannedMove(MoveKind.STAGE, layouts["b"].total_bytes)
    ledger.begin_staging("b")
    stager.start("b", hosts.get("b").buffer, plan.bytes)
    assert ledger.placement("b") is Placement.STAGING
    staged = stager.wait()
    assert staged is not None and staged.bytes == plan.bytes
    ledger.finish_staging("b")
    ledger.record(staged)
    assert ledger.placement("b") is Placement.STAGED

    kv = arena.kv_cache(2, None, 4, 1, 8, torch.float32)
    block_bytes = 2 * 2 * 4 * 8 * 4
    ledger.set_kv_block_bytes("a", block_bytes)
    offload = kv_store.save("a", [1, 2, 3], [0, 1, 2], kv, session_id="s1")
    ledger.record(offload)
    assert offload.bytes == 3 * ledger.kv_block_bytes("a") == ledger.host_kv_bytes("a")

    assert activate("b").kind == MoveKind.ACTIVATE_D2D
    assert ledger.placements() == {"a": Placement.HOST, "b": Placement.ACTIVE}
    assert activate("a").kind == MoveKind.ACTIVATE_H2D
    assert ledger.placement("b") is Placement.STAGED  # staging still holds b
    assert ledger.plan_activation("a") == PlannedMove(MoveKind.NONE, 0)

    assert ledger.totals(MoveKind.ACTIVATE_H2D).bytes == 2 * layouts["a"].total_bytes
    assert ledger.totals(MoveKind.ACTIVATE_D2D).bytes == layouts["b"].total_bytes
    assert ledger.totals(MoveKind.STAGE).count == 1
    assert ledger.totals(MoveKind.KV_OFFLOAD).bytes == 3 * block_bytes
    assert ledger.active_model == "a" and ledger.host_kv_bytes() == 3 * block_bytes


def test_ledger_rejects_bad_input() -> None:
    ledger = Ledger(weight_bytes=1000, staging_bytes=500)
    with pytest.raises(ValueError, match="2000 bytes does not fit the weight region of 1000"):
        ledger.add_host_model("huge", 2000)
    ledger.add_host_model("mid", 800)
    with pytest.raises(ValueError, match="staging region of 500 bytes"):
        ledger.plan_staging("mid")
    with pytest.raises(KeyError, match="not in the host weight store"):
        ledger.plan_activation("nope")
    with pytest.raises(ValueError, match="is not being staged"):
        ledger.finish_staging("mid")
    ledger.commit_activation("mid")
    with pytest.raises(ValueError, match="is active"):
        ledger.remove_host_model("mid")
    assert ledger.staging_state is StagingState.NONE
    assert ledger.bandwidth(MoveKind.ACTIVATE_H2D) is None


def test_rate_mover_predicts_and_ledger_learns_bandwidth() -> None:
    rates = RateMover({MoveKind.ACTIVATE_H2D: 50e9, MoveKind.ACTIVATE_D2D: 2e12}, latency_s=0.001)
    h2d = rates.perform(PlannedMove(MoveKind.ACTIVATE_H2D, 100 * 10**9))
    assert h2d.seconds == pytest.approx(2.001)
    assert rates.move(MoveKind.ACTIVATE_D2D, 0).seconds == 0.0
    ledger = Ledger(weight_bytes=1)
    ledger.record(h2d)
    ledger.record(rates.move(MoveKind.ACTIVATE_H2D, 100 * 10**9))
    assert ledger.bandwidth(MoveKind.ACTIVATE_H2D) == pytest.approx(200e9 / 4.002)
    with pytest.raises(KeyError, match="no bandwidth known for move kind 'stage'"):
        rates.move(MoveKind.STAGE, 1)
    with pytest.raises(ValueError, match="must be > 0"):
        RateMover({MoveKind.STAGE: 0})


def test_rate_mover_for_links_covers_every_kind() -> None:
    rates = RateMover.for_links(host_link_bytes_per_s=50e9, d2d_bytes_per_s=1e12)
    assert rates.move(MoveKind.ACTIVATE_D2D, 10**12).seconds == pytest.approx(1.0)
    for kind in MoveKind.ALL:
        assert rates.move(kind, 10**9).seconds > 0
    assert rates.move(MoveKind.KV_RESTORE, 50 * 10**9).seconds == pytest.approx(1.0)
