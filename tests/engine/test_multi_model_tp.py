"""The live multi-model engine at TP=2 on CPU (gloo): every rank switches together.

A -> B -> A outputs equal the TP=1 multi-model engine's and a fresh single-model engine's;
session KV offloaded before a switch is restored on every rank after switching back (and
equals recompute); staged activation equals host activation and a model is STAGED only
once every rank's copy is done; a copy that fails on one rank only reads failed, once, and
leaves no rank with the model staged; shutdown leaves no worker process.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import engine_runs
import pytest
from engine_runs import prompt, run

from engine.interface import EngineRequest, MultiModelEngineProtocol, Residency
from engine.models.tiny import make_tiny_models
from engine.multi_model.engine import MultiModelConfig, MultiModelEngine
from engine.multi_model.tp import (
    STATE_KEY,
    TensorParallelRankModels,
    combine_placements,
    combine_records,
)
from engine.parallel.worker import RankContext, call_state_method
from engine.sampling_params import SamplingParams
from substrate.host_kv_index import HostKVIndex
from substrate.ledger import Placement
from substrate.moves import MoveKind, MoveRecord

pytestmark = pytest.mark.slow

BLOCK = 4
NUM_BLOCKS = 64
LLAMA, QWEN = "tiny-llama", "tiny-qwen3"
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=True)

# the shared drivers with this module's settings
requests = partial(engine_runs.requests, params=GREEDY)
fresh = partial(engine_runs.fresh, block_size=BLOCK, num_blocks=NUM_BLOCKS)
# logprobs differ by the all-reduce's summation order
assert_same = partial(engine_runs.assert_same, atol=1e-4)

PROMPTS = [prompt(1, 13), prompt(2, 22), prompt(3, 5)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = make_tiny_models(tmp_path_factory.mktemp("mmtp"))
    return {LLAMA: paths[LLAMA], QWEN: paths[QWEN]}


def make_engine(models: dict[str, Path], tp: int, **kw: object) -> MultiModelEngine:
    cfg: dict[str, object] = dict(
        device="cpu",
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        host_kv_bytes=1 << 20,
        tensor_parallel_size=tp,
        wait_for_staging=True,
    )
    cfg.update(kw)
    return MultiModelEngine(models, MultiModelConfig(**cfg))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tp2(models: dict[str, Path]) -> Iterator[MultiModelEngine]:
    engine = make_engine(models, 2, wait_for_staging=False)
    yield engine
    engine.shutdown()


def per_rank(engine: MultiModelEngine, method: str, *args: object) -> list[object]:
    assert isinstance(engine.rank, TensorParallelRankModels)
    return engine.rank.group.run_on_all_ranks(call_state_method, STATE_KEY, method, *args)


def test_a_b_a_matches_tp1_and_fresh_engines(
    models: dict[str, Path], tp2: MultiModelEngine
) -> None:
    assert isinstance(tp2, MultiModelEngineProtocol)
    assert isinstance(tp2.rank, TensorParallelRankModels) and tp2.rank.world_size == 2
    tp1 = make_engine(models, 1)
    want = {n: fresh(models[n], requests(n, n, PROMPTS)) for n in (LLAMA, QWEN)}
    for i, name in enumerate([LLAMA, QWEN, LLAMA]):
        tag = f"{name}-{i}"
        report = tp2.activate(name)
        assert report.kind == "activate_h2d" and report.seconds > 0
        # Each rank holds (and moves) only its shard: about half the full model.
        assert report.bytes == tp2.catalog[name].layout.total_bytes
        assert report.bytes < tp1.catalog[name].layout.total_bytes
        tp1.activate(name)
        got = run(tp2, requests(name, tag, PROMPTS))[0]
        assert_same(got, run(tp1, requests(name, tag, PROMPTS))[0])
        assert_same(got, {k.replace(tag, name): v for k, v in want[name].items()})
    active = per_rank(tp2, "placements", False)
    assert [p[LLAMA] for p in active] == ["active", "active"]  # type: ignore[index]
    assert tp2.residency() == {LLAMA: Residency.ACTIVE, QWEN: Residency.HOST}


def test_kv_restore_after_switch_runs_on_every_rank(
    models: dict[str, Path], tp2: MultiModelEngine
) -> None:
    sid = "restore-s"
    tp2.activate(LLAMA)
    first_prompt = prompt(11, 29)
    first = run(tp2, [EngineRequest("k1", first_prompt, GREEDY, model=LLAMA, session_id=sid)])
    cont_prompt = first_prompt + first[0]["k1"][0] + prompt(99, 7)
    assert tp2.session_kv_tokens(sid)[0] == 32  # 29 + 5 - 1 computed tokens: 8 full blocks
    restored_before = per_rank(tp2, "move_totals", "kv_restore")
    tp2.hold_host_kv(sid)  # every rank's store evicts it last
    offload = tp2.offload_kv([sid])
    assert offload.bytes == 8 * tp2.catalog[LLAMA].kv_spec.block_bytes
    assert per_rank(tp2, "host_kv_usage") == [tp2.rank.host_kv_usage()] * 2
    tp2.activate(QWEN)  # clears every rank's KV region
    run(tp2, requests(QWEN, "other", [prompt(7, 30)]))
    tp2.activate(LLAMA)
    assert tp2.session_kv_tokens(sid) == (0, 32)
    cont = EngineRequest("k2", cont_prompt, GREEDY, model=LLAMA, session_id=sid)
    got, prefilled = run(tp2, [cont])
    assert prefilled == len(cont_prompt) - 32
    restores = tp2.take_restore_reports()
    assert [(r.kind, r.bytes) for r in restores] == [("kv_restore", offload.bytes)]
    assert tp2.stats().restored_tokens_total == 32
    for (before, _), (after, _) in zip(
        restored_before,  # type: ignore[misc]
        per_rank(tp2, "move_totals", "kv_restore"),  # type: ignore[misc]
        strict=True,
    ):
        assert after - before == offload.bytes  # every rank copied its heads back
    want = fresh(models[LLAMA], [EngineRequest("k2", cont_prompt, GREEDY, model=LLAMA)])
    assert_same(got, want)


def test_staged_activation_equals_host_activation(
    tp2: MultiModelEngine, models: dict[str, Path]
) -> None:
    """Staging runs in the background on every rank (the engine does not wait for it);
    activating the staged model waits for every rank's copy, then copies D2D. Lending the
    staging region to the KV cache happens on every rank too."""
    tp2.activate(LLAMA)
    stage = tp2.stage(QWEN)
    assert stage.kind == "stage" and stage.bytes == tp2.catalog[QWEN].layout.total_bytes
    assert stage.seconds > 0  # predicted from the measured host-link rate
    assert tp2.residency()[QWEN] in (Residency.STAGING, Residency.STAGED)
    assert tp2.activate(QWEN).kind == "activate_d2d"
    assert [p[QWEN] for p in per_rank(tp2, "placements", False)] == ["active"] * 2  # type: ignore[index]
    staged = run(tp2, requests(QWEN, "staged", PROMPTS))[0]
    tp2.activate(LLAMA)
    tp2.stage(LLAMA)  # the staging region now holds another model
    assert tp2.rank.poll_staging(block=True) is not None  # every rank finished its copy
    assert tp2.residency()[LLAMA] is Residency.ACTIVE
    assert [p[LLAMA] for p in per_rank(tp2, "placements", False)] == ["active"] * 2  # type: ignore[index]
    assert tp2.stage(QWEN).kind == "stage"
    tp2.rank.poll_staging(block=True)
    assert [p[QWEN] for p in per_rank(tp2, "placements", False)] == ["staged"] * 2  # type: ignore[index]
    assert tp2.residency()[QWEN] is Residency.STAGED
    tp2.stage(LLAMA)
    tp2.rank.poll_staging(block=True)
    assert tp2.activate(QWEN).kind == "activate_h2d"
    host = run(tp2, requests(QWEN, "host", PROMPTS))[0]
    assert_same(staged, {k.replace("host", "staged"): v for k, v in host.items()})
    rates = tp2.model_rates(QWEN)
    assert rates["switch_staged_s"] > 0 and rates["switch_host_s"] > 0 and rates["stage_s"] > 0
    lent = tp2.kv_capacity_blocks(LLAMA, lent=True)
    assert tp2.activate(LLAMA, lend_staging=True).kind == "activate_d2d"  # staging held it
    assert tp2.stats().num_total_blocks == lent > NUM_BLOCKS
    assert per_rank(tp2, "kv_capacity_blocks", LLAMA, True) == [lent] * 2
    # each copy that ended is metered once, those polled past the engine above too
    assert isinstance(tp2.rank, TensorParallelRankModels)
    copies = tp2.rank.local.memory.ledger.totals("stage").count
    assert sum(m.moves["stage"].count for m in tp2._meters.values() if "stage" in m.moves) == copies
    batch = [prompt(40 + i, 30) for i in range(12)]  # 12 x 9 blocks > 64: one wave if lent
    assert_same(run(tp2, requests(LLAMA, "lent", batch))[0],
                fresh(models[LLAMA], requests(LLAMA, "lent", batch)))
    tp2.activate(QWEN)
    assert tp2.stats().num_total_blocks == NUM_BLOCKS
    # lent inside QWEN's slot: every rank re-views its KV cache, no weight moves
    assert tp2.activate(QWEN, lend_staging=True).kind == "none"
    qwen_lent = tp2.kv_capacity_blocks(QWEN, lent=True)
    assert tp2.stats().num_total_blocks == qwen_lent > NUM_BLOCKS
    assert tp2.rank.staging_lent
    assert_same(run(tp2, requests(QWEN, "slot-lent", batch))[0],
                fresh(models[QWEN], requests(QWEN, "slot-lent", batch)))


def test_shutdown_leaves_no_process(models: dict[str, Path]) -> None:
    engine = make_engine({LLAMA: models[LLAMA]}, 2, initial_model=LLAMA, staging=False)
    assert isinstance(engine.rank, TensorParallelRankModels)
    with pytest.raises(ValueError, match="staging is disabled"):
        engine.stage(LLAMA)  # fails on rank 0 before any rank moves: the group stays usable
    assert engine.rank.group.is_alive
    assert engine.residency() == {LLAMA: Residency.ACTIVE}
    pids = engine.rank.group.pids
    assert all(_alive(pid) for pid in pids)
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.rank.group.check()


def test_unshardable_catalog_fails_before_workers_start(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="tiny-llama"):
        make_engine({LLAMA: models[LLAMA]}, 3)


def test_staged_only_when_every_rank_is_done_and_slowest_rank_times_a_move() -> None:
    rank0 = {LLAMA: Placement.ACTIVE, QWEN: Placement.STAGED}
    rank1 = {LLAMA: Placement.ACTIVE, QWEN: Placement.STAGING}
    assert combine_placements([rank0, rank1])[QWEN] is Placement.STAGING
    assert combine_placements([rank1, rank0])[QWEN] is Placement.STAGING
    assert combine_placements([rank0, dict(rank0)]) == rank0
    fast = MoveRecord(MoveKind.STAGE, 100, 0.5)
    slow = MoveRecord(MoveKind.STAGE, 100, 2.0)
    assert combine_records([fast, slow]) == MoveRecord(MoveKind.STAGE, 100, 2.0)
    assert combine_records([None, slow]) == slow
    assert combine_records([None, None]) is None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_forgetting_a_held_session_lets_its_host_kv_go_on_every_rank(
    tp2: MultiModelEngine,
) -> None:
    sid = "forget-s"
    tp2.activate(LLAMA)
    run(tp2, [EngineRequest("f1", prompt(12, 29), GREEDY, model=LLAMA, session_id=sid)])
    tp2.hold_host_kv(sid)
    tp2.offload_kv([sid])
    tp2.forget_session(sid)
    for index in per_rank(tp2, "host_kv_index"):
        assert isinstance(index, HostKVIndex) and len(index) > 0
        assert sid not in index._held and all(sid not in e.sessions for e in index.entries())


def fail_next_staging_copy(ctx: RankContext, rank: int) -> None:
    """Rank op: on rank ``rank`` only, the next staging copy fails (its host link breaks)."""
    if ctx.rank != rank:
        return
    stager = ctx.state[STATE_KEY].memory.stager

    def failing(dst: object, src: object) -> None:
        del stager._cpu_copy  # this copy only: the class's copy again after it
        stager._error = RuntimeError(f"link down on rank {rank}")

    stager._cpu_copy = failing


def staged_copies(engine: MultiModelEngine, model: str) -> int:
    """Staging copies of ``model`` the engine's meter has booked."""
    moves = engine._meters[model].moves
    return moves["stage"].count if "stage" in moves else 0


def wait_for_staging_copies(engine: MultiModelEngine) -> dict[str, Residency]:
    """Wait until no rank's staging copy runs; the residency the engine then reports (its
    poll books every rank's copy together)."""
    deadline = time.monotonic() + 30
    while any(per_rank(engine, "staging_copy_running")):
        assert time.monotonic() < deadline, "a staging copy never ended"
        time.sleep(0.01)
    return engine.residency()


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_staging_copy_failed_on_one_rank_is_failed_on_every_rank(
    tp2: MultiModelEngine, models: dict[str, Path], bad_rank: int
) -> None:
    """A background copy that completes on one rank and fails on the other: the combined
    outcome reads failed, told once and metered nowhere; no rank keeps the model staged (the
    ranks' ledgers agree: HOST everywhere), so the switch to it copies from host on every
    rank and its outputs are right; staging it again copies on every rank and is booked as
    one completed copy, the switch after it D2D on every rank."""
    tp2.activate(QWEN)
    tp2.activate(LLAMA)  # whatever earlier tests left: LLAMA active, nothing lent,
    tp2.stage(LLAMA)  # and QWEN in host memory only
    assert wait_for_staging_copies(tp2)[QWEN] is Residency.HOST
    assert tp2.take_staging_failures() == []
    copies = staged_copies(tp2, QWEN)
    tp2.rank.group.run_on_all_ranks(fail_next_staging_copy, bad_rank)
    assert tp2.stage(QWEN).kind == "stage"
    residency = wait_for_staging_copies(tp2)
    assert tp2.take_staging_failures() == [QWEN]
    assert tp2.take_staging_failures() == []  # told once
    assert staged_copies(tp2, QWEN) == copies
    assert residency[QWEN] is Residency.HOST
    assert [p[QWEN] for p in per_rank(tp2, "placements", False)] == ["host"] * 2  # type: ignore[index]
    h2d = per_rank(tp2, "move_totals", "activate_h2d")
    d2d = per_rank(tp2, "move_totals", "activate_d2d")
    assert tp2.activate(QWEN).kind == "activate_h2d"
    shard = tp2.catalog[QWEN].layout.total_bytes
    assert [b for b, _ in per_rank(tp2, "move_totals", "activate_h2d")] == [  # type: ignore[misc]
        b + shard for b, _ in h2d  # type: ignore[misc]
    ]
    assert per_rank(tp2, "move_totals", "activate_d2d") == d2d
    assert_same(run(tp2, requests(QWEN, "partial", PROMPTS))[0],
                fresh(models[QWEN], requests(QWEN, "partial", PROMPTS)))
    tp2.activate(LLAMA)
    assert tp2.stage(QWEN).kind == "stage"  # every rank copies again: their outcomes pair up
    assert wait_for_staging_copies(tp2)[QWEN] is Residency.STAGED
    assert tp2.take_staging_failures() == []
    assert staged_copies(tp2, QWEN) == copies + 1
    assert tp2.activate(QWEN).kind == "activate_d2d"
    assert [p[QWEN] for p in per_rank(tp2, "placements", False)] == ["active"] * 2  # type: ignore[index]


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_waited_staging_copy_failed_on_one_rank_raises_and_the_group_goes_on(
    tp2: MultiModelEngine, models: dict[str, Path], bad_rank: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy ``stage`` waits for (``wait_for_staging``) that fails on one rank raises
    there, once every rank has ended it, and leaves the group working (a rank that raised on
    its own used to break it): no rank keeps the model staged, the failure is not told again
    as a background one, and staging it again completes on every rank, its switch D2D."""
    tp2.activate(QWEN)
    tp2.activate(LLAMA)
    tp2.stage(LLAMA)
    assert wait_for_staging_copies(tp2)[QWEN] is Residency.HOST
    tp2.take_staging_failures()
    copies = staged_copies(tp2, QWEN)
    monkeypatch.setattr(tp2, "config", dataclasses.replace(tp2.config, wait_for_staging=True))
    tp2.rank.group.run_on_all_ranks(fail_next_staging_copy, bad_rank)
    with pytest.raises(RuntimeError, match=rf"staging 'tiny-qwen3' failed on rank\(s\) \[{bad_rank}\]"):
        tp2.stage(QWEN)
    assert tp2.take_staging_failures() == []  # told by the raise
    assert tp2.residency()[QWEN] is Residency.HOST
    assert [p[QWEN] for p in per_rank(tp2, "placements", False)] == ["host"] * 2  # type: ignore[index]
    assert staged_copies(tp2, QWEN) == copies
    assert tp2.stage(QWEN).kind == "stage"  # waited: done on every rank when it returns
    assert tp2.residency()[QWEN] is Residency.STAGED
    assert tp2.take_staging_failures() == []
    assert staged_copies(tp2, QWEN) == copies + 1
    assert tp2.activate(QWEN).kind == "activate_d2d"
    assert_same(run(tp2, requests(QWEN, "waited", PROMPTS))[0],
                fresh(models[QWEN], requests(QWEN, "waited", PROMPTS)))
