"""The assembled substrate: switches by H2D and D2D at fixed addresses, books kept."""

from __future__ import annotations

import threading

import pytest
import torch
from substrate_testing import TinyLM, state_of

from substrate.instance_memory import InstanceMemory, KVSpec
from substrate.layout import WeightLayout
from substrate.ledger import Placement
from substrate.moves import MoveKind, MoveRecord, PlannedMove
from substrate.staging import StagingOutcome


def _fill(weights: dict[str, torch.Tensor]):
    def fill(views: dict[str, torch.Tensor]) -> None:
        for name, view in views.items():
            view.copy_(weights[name])

    return fill


def _two_models(seed: int, kv_blocks: int) -> tuple[
        dict[str, TinyLM], dict[str, TinyLM], KVSpec, InstanceMemory]:
    """Two tiny models a and b loaded into one instance memory (KV region of ``kv_blocks``
    blocks, no host KV): their reference modules, the modules bound to the arena, the KV
    spec and the memory."""
    torch.manual_seed(seed)
    refs = {"a": TinyLM(vocab=32, hidden=16), "b": TinyLM(vocab=64, hidden=8)}
    with torch.device("meta"):
        models = {"a": TinyLM(vocab=32, hidden=16), "b": TinyLM(vocab=64, hidden=8)}
    layouts = {n: WeightLayout.from_module(m) for n, m in models.items()}
    spec = KVSpec(2, 4, 2, 8, torch.float32)
    mem = InstanceMemory("cpu", layouts, kv_bytes=kv_blocks * spec.block_bytes, host_kv_bytes=0,
                         pin=False)
    for name in refs:
        mem.load_model(name, _fill(state_of(refs[name])), spec)
        mem.bind_module(name, models[name])
    return refs, models, spec, mem


def _blank_models() -> InstanceMemory:
    """Two tiny models' shards (contents left unset) in one instance memory of 4 KV blocks."""
    layouts = {n: WeightLayout.from_module(TinyLM()) for n in ("a", "b")}
    spec = KVSpec(2, 4, 2, 8, torch.float32)
    mem = InstanceMemory("cpu", layouts, kv_bytes=4 * spec.block_bytes, host_kv_bytes=0,
                         pin=False)
    for name in layouts:
        mem.load_model(name, lambda views: None, spec)
    return mem


def test_switch_cycle_keeps_addresses_and_outputs() -> None:
    torch.manual_seed(2)
    refs = {"a": TinyLM(vocab=32, hidden=16), "b": TinyLM(vocab=64, hidden=8)}
    with torch.device("meta"):
        models = {"a": TinyLM(vocab=32, hidden=16), "b": TinyLM(vocab=64, hidden=8)}
    layouts = {n: WeightLayout.from_module(m) for n, m in models.items()}
    specs = {"a": KVSpec(2, 4, 2, 8, torch.float32), "b": KVSpec(3, 4, 1, 8, torch.float32)}
    mem = InstanceMemory("cpu", layouts, kv_bytes=64 * 1024, host_kv_bytes=1 << 20, pin=False)
    for name in refs:
        assert (
            mem.load_model(name, _fill(state_of(refs[name])), specs[name])
            == layouts[name].total_bytes
        )
        mem.bind_module(name, models[name])
    assert mem.placements() == {"a": Placement.HOST, "b": Placement.HOST}
    ptrs = {n: [p.data_ptr() for p in m.parameters()] for n, m in models.items()}
    ids = torch.tensor([[1, 2, 3]])

    assert mem.activate("a").kind == MoveKind.ACTIVATE_H2D
    torch.testing.assert_close(models["a"](ids), refs["a"](ids))
    kv_a = mem.kv_cache("a")
    assert kv_a.data_ptr() == mem.arena.kv_region.data_ptr()
    assert mem.activate("a").kind == MoveKind.NONE

    plan = mem.stage("b")
    assert plan == PlannedMove(MoveKind.STAGE, layouts["b"].total_bytes)
    assert mem.stage("b").kind == MoveKind.NONE  # already staging or staged
    assert mem.activate("b").kind == MoveKind.ACTIVATE_D2D
    torch.testing.assert_close(models["b"](ids), refs["b"](ids))
    kv_b = mem.kv_cache("b")
    assert kv_b.data_ptr() == mem.arena.kv_region.data_ptr() and kv_b.shape[0] == 3

    assert mem.activate("a").kind == MoveKind.ACTIVATE_H2D
    torch.testing.assert_close(models["a"](ids), refs["a"](ids))
    assert mem.kv_cache("a") is kv_a
    assert {n: [p.data_ptr() for p in m.parameters()] for n, m in models.items()} == ptrs
    assert mem.placements() == {"a": Placement.ACTIVE, "b": Placement.STAGED}
    assert mem.activate("b").kind == MoveKind.ACTIVATE_D2D  # staging still holds b

    ledger = mem.ledger
    assert ledger.totals(MoveKind.ACTIVATE_H2D).bytes == 2 * layouts["a"].total_bytes
    assert ledger.totals(MoveKind.ACTIVATE_D2D).bytes == 2 * layouts["b"].total_bytes
    assert ledger.totals(MoveKind.STAGE).bytes == layouts["b"].total_bytes
    estimate = mem.estimate(PlannedMove(MoveKind.ACTIVATE_H2D, 1000))
    assert estimate is not None and estimate > 0
    assert mem.estimate(PlannedMove(MoveKind.KV_RESTORE, 1000)) is None


def test_kv_offload_and_restore_through_the_secondary_cache() -> None:
    layouts = {"a": WeightLayout.from_module(TinyLM())}
    spec = KVSpec(2, 4, 2, 8, torch.float32)
    mem = InstanceMemory(
        "cpu", layouts, kv_bytes=32 * spec.block_bytes, host_kv_bytes=1 << 20, pin=False
    )
    mem.load_model("a", lambda views: None, spec)
    mem.activate("a")
    kv = mem.kv_cache("a")
    kv.copy_(torch.arange(kv.numel(), dtype=kv.dtype).view_as(kv))
    before = kv[:, :, [4, 5]].clone()
    record = mem.offload_kv("a", [101, 102], [4, 5], session_id="s")
    assert record.bytes == 2 * spec.block_bytes == mem.ledger.host_kv_bytes("a")
    kv.zero_()
    cache = mem.host_kv_cache("a")
    assert cache.lookup([101, 102, 103]) == 2
    cache.load([101, 102], [0, 9])
    assert torch.equal(kv[:, :, [0, 9]], before)


def test_start_up_fails_when_a_shard_does_not_fit() -> None:
    layouts = {
        "small": WeightLayout.from_module(TinyLM(hidden=8)),
        "big": WeightLayout.from_module(TinyLM(hidden=64)),
    }
    limit = layouts["small"].total_bytes
    with pytest.raises(
        ValueError, match=f"big: weight shard of {layouts['big'].total_bytes} bytes"
    ) as err:
        InstanceMemory("cpu", layouts, kv_bytes=0, host_kv_bytes=0, weight_bytes=limit)
    assert f"weight region of {limit} bytes" in str(err.value)
    mem = InstanceMemory(
        "cpu", {"small": layouts["small"]}, kv_bytes=64, host_kv_bytes=0, staging=False
    )
    with pytest.raises(ValueError, match="holds no KV block"):
        mem.load_model("small", lambda views: None, KVSpec(2, 16, 2, 8, torch.float32))
    with pytest.raises(KeyError, match="not in this instance's catalog"):
        mem.bind_module("nope", TinyLM())


def test_staging_disabled_is_a_clear_error() -> None:
    layouts = {"a": WeightLayout.from_module(TinyLM())}
    mem = InstanceMemory("cpu", layouts, kv_bytes=1024, host_kv_bytes=0, staging=False, pin=False)
    mem.load_model("a", lambda views: None, KVSpec(1, 4, 1, 8, torch.float32))
    assert mem.arena.staging_bytes == 0
    with pytest.raises(ValueError, match="staging is disabled"):
        mem.stage("a")
    assert mem.activate("a").kind == MoveKind.ACTIVATE_H2D


def test_a_lent_staging_region_widens_the_kv_cache_from_the_same_base() -> None:
    """Activating b from staging with the region lent: b's weights arrive whole (the D2D copy
    reads the region before the KV cache claims it), its KV cache spans both regions from the
    KV region's base, zeroed, and nothing can be staged until the next activation."""
    refs, models, spec, mem = _two_models(3, kv_blocks=8)
    arena = mem.arena
    mem.activate("a")
    normal = mem.kv_cache("a")
    assert normal.shape[2] == 8
    mem.stage("b")
    assert mem.activate("b", lend_staging=True).kind == MoveKind.ACTIVATE_D2D
    ids = torch.tensor([[4, 1, 7]])
    torch.testing.assert_close(models["b"](ids), refs["b"](ids))
    lent = mem.kv_cache("b")
    assert lent.data_ptr() == normal.data_ptr() == arena.kv_region.data_ptr()
    assert lent.shape[2] == (arena.kv_bytes + arena.staging_bytes) // spec.block_bytes > 8
    assert not lent.any()  # the staged weights it covers were zeroed
    assert mem.placements()["b"] == Placement.ACTIVE and mem.ledger.staged_model is None
    with pytest.raises(ValueError, match="lent"):
        mem.stage("a")
    lent.fill_(1.0)
    assert mem.activate("a").kind == MoveKind.ACTIVATE_H2D
    assert mem.kv_cache("a") is normal and not arena.kv_region.any()
    assert mem.stage("b").kind == MoveKind.STAGE
    layouts = {n: WeightLayout.from_module(m) for n, m in models.items()}
    no_staging = InstanceMemory("cpu", layouts, kv_bytes=8 * spec.block_bytes, host_kv_bytes=0,
                                staging=False, pin=False)
    no_staging.load_model("a", _fill(state_of(refs["a"])), spec)
    with pytest.raises(ValueError, match="no staging region"):
        no_staging.activate("a", lend_staging=True)


def test_a_failed_weight_copy_leaves_no_model_active() -> None:
    """The copy into the weight region fails half-way: the outgoing model's weights are torn,
    so activating it again copies them again instead of finding it active."""
    mem = _blank_models()
    mem.activate("a")

    def torn(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> MoveRecord:
        dst[: nbytes // 2].copy_(src[: nbytes // 2])
        raise RuntimeError("copy failed")

    copy = mem.mover.activate_from_host
    mem.mover.activate_from_host = torn  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="copy failed"):
        mem.activate("b")
    mem.mover.activate_from_host = copy  # type: ignore[method-assign]
    assert mem.active_model is None
    assert mem.activate("a").kind == MoveKind.ACTIVATE_H2D


def test_a_failed_staging_copy_costs_its_d2d_switch_only() -> None:
    """A background staging copy fails: activating the model it was staging copies it from
    host instead (the copy staged nothing), and the ledger holds no staged model."""
    refs, models, _, mem = _two_models(4, kv_blocks=4)
    mem.activate("a")

    def failing(dst: torch.Tensor, src: torch.Tensor) -> None:
        mem.stager._error = RuntimeError("link down")

    mem.stager._cpu_copy = failing  # type: ignore[method-assign]
    assert mem.stage("b").kind == MoveKind.STAGE
    assert mem.activate("b").kind == MoveKind.ACTIVATE_H2D
    ids = torch.tensor([[5, 2, 9]])
    torch.testing.assert_close(models["b"](ids), refs["b"](ids))
    assert mem.placements() == {"a": Placement.HOST, "b": Placement.ACTIVE}
    assert mem.ledger.totals(MoveKind.STAGE).count == 0
    assert mem.take_staging_outcomes() == [StagingOutcome("b", None)]  # told once
    assert mem.take_staging_outcomes() == []
    assert mem.stage("a").kind == MoveKind.STAGE  # the caller waiting for its copy hears
    with pytest.raises(RuntimeError, match="staging copy failed: link down"):
        mem.poll_staging(block=True, raise_failure=True)
    assert mem.ledger.staged_model is None
    assert mem.take_staging_outcomes() == []  # raised instead


def _gate_copies(mem: InstanceMemory) -> threading.Event:
    """Hold ``mem``'s staging copies until the returned event is set."""
    gate = threading.Event()
    copy = mem.stager._cpu_copy

    def gated(dst: torch.Tensor, src: torch.Tensor) -> None:
        gate.wait(timeout=10)
        copy(dst, src)

    mem.stager._cpu_copy = gated  # type: ignore[method-assign]
    return gate


def test_a_staging_copy_that_a_lend_waits_for_is_booked() -> None:
    """Lending the region waits for the staging copy in flight before dropping what it
    staged: the copy still crossed the host link, so the ledger books it (the staging rate
    is measured from such records)."""
    mem = _blank_models()
    mem.activate("a")
    gate = _gate_copies(mem)
    mem.stage("b")
    plan = mem.ledger.plan_activation

    def open_gate(model: str) -> PlannedMove:  # the copy ends after the activation's poll
        gate.set()
        return plan(model)

    mem.ledger.plan_activation = open_gate  # type: ignore[method-assign]
    mem.activate("a", lend_staging=True)
    totals = mem.ledger.totals(MoveKind.STAGE)
    assert totals.count == 1 and totals.bytes == WeightLayout.from_module(TinyLM()).total_bytes
    assert mem.ledger.staged_model is None and mem.ledger.staging_lent
    (outcome,) = mem.take_staging_outcomes()  # queued for the engine's meter, once
    assert outcome.model == "b" and outcome.record is not None
    assert outcome.record.bytes == totals.bytes


def test_a_dropped_staging_copy_leaves_its_model_in_host_memory_only() -> None:
    """``drop_staged`` (a TP rank whose copy completed where another rank's failed) forgets a
    completed copy of that model only: the switch to it then copies from host, and staging
    it again starts a copy; a copy in flight, or another model's, is kept."""
    refs, models, _, mem = _two_models(5, kv_blocks=4)
    mem.activate("a")
    gate = _gate_copies(mem)
    mem.stage("b")
    assert not mem.drop_staged("b")  # in flight: kept
    gate.set()
    mem.poll_staging(block=True)
    del mem.stager._cpu_copy
    assert not mem.drop_staged("a")  # not what is staged
    assert mem.placements()["b"] is Placement.STAGED
    assert mem.drop_staged("b")
    assert not mem.drop_staged("b")
    assert mem.placements() == {"a": Placement.ACTIVE, "b": Placement.HOST}
    assert mem.activate("b").kind == MoveKind.ACTIVATE_H2D
    ids = torch.tensor([[4, 1, 8]])
    torch.testing.assert_close(models["b"](ids), refs["b"](ids))
    assert mem.stage("b").kind == MoveKind.STAGE  # nothing staged: a copy again
    mem.poll_staging(block=True)
    assert mem.activate("a").kind == MoveKind.ACTIVATE_H2D
    assert mem.activate("b").kind == MoveKind.ACTIVATE_D2D
