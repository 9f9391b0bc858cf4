"""The simulated staging region: sized for the second largest shard (the largest model keeps
its KV room and loads from host), and a staging copy sharing the host link with KV restores."""

from __future__ import annotations

import pytest

from engine.interface import Residency
from tests.engine.sim.sim_helpers import (
    BS,
    GLM,
    MISTRAL,
    QWEN,
    Clock,
    cost,
    drain,
    make,
    output,
    req,
    tokens,
)


def test_a_staging_region_for_the_second_largest_shard() -> None:
    models = (QWEN, GLM, MISTRAL)
    full = make(models, staging=True)
    second = make(models, staging=True, staging_region="second")
    none = make(models, staging=False)
    qwen, mistral = cost().weight_bytes_per_gpu(), cost(MISTRAL).weight_bytes_per_gpu()
    assert qwen > mistral > cost(GLM).weight_bytes_per_gpu()
    assert second.memory.staging_bytes == mistral and full.memory.staging_bytes == qwen
    assert [second.can_stage(m) for m in models] == [False, True, True]
    assert [full.can_stage(m) for m in models] == [True, True, True]
    assert not any(none.can_stage(m) for m in models)
    # the KV region keeps what the largest shard's staging copy would have taken from it
    assert second.kv_capacity_blocks(QWEN) == cost().kv_capacity_tokens(qwen, mistral) // BS
    assert full.kv_capacity_blocks(QWEN) < second.kv_capacity_blocks(QWEN) < (
        none.kv_capacity_blocks(QWEN))
    second.activate(GLM)
    with pytest.raises(ValueError, match="does not fit the staging region"):
        second.stage(QWEN)
    assert second.stage(MISTRAL).kind == "stage"
    with pytest.raises(ValueError, match="staging_region"):
        make(models, staging_region="half")


def _restore_while_staging(stage_first: bool) -> tuple[float, float, float, Residency]:
    """A session's KV is restored from host in one step (before the forward pass, so the
    step's seconds add the restore's), with or without a staging copy in flight; returns
    (the step's seconds, the restore alone, the staging copy alone, GLM's residency when
    the copy alone would have ended)."""
    clock = Clock()
    engine = make(clock=clock, host_kv_bytes=10**12, kv_tier="offload_serial")
    engine.activate(QWEN)
    prompt = tokens(6000)
    engine.add_request(req("c1", prompt, max_tokens=5, session="s"))
    _, ev1 = drain(engine)
    engine.offload_kv(None)
    engine.activate(GLM)
    engine.activate(QWEN)  # GLM is back in host memory only
    clock.now = 50.0
    staging_s = engine.stage(GLM).seconds if stage_first else cost(GLM).switch_seconds_host()
    prompt2 = prompt + output(ev1["c1"]) + tokens(1000, 70_000)
    engine.add_request(req("c2", prompt2, max_tokens=1, session="s"))
    first = engine.step()
    restored = 6004 // BS * BS
    clock.now = 50.0 + staging_s
    return (first.seconds, engine.host_tier.restore_seconds(cost(), restored), staging_s,
            engine.residency()[GLM])


def test_a_restore_shares_the_host_link_with_a_staging_copy() -> None:
    alone, restore_s, staging_s, _ = _restore_while_staging(stage_first=False)
    shared, restore_again, _, glm = _restore_while_staging(stage_first=True)
    assert restore_again == restore_s and restore_s < staging_s
    # both at half rate while they overlap: the restore takes twice as long ...
    assert shared == pytest.approx(alone + restore_s, rel=1e-12)
    # ... and the staging copy ends that much later
    assert glm == Residency.STAGING


def test_lending_the_staging_region_to_the_kv_cache() -> None:
    """A lent slot has the KV blocks the region holds beside the largest shard alone, drops
    what was staged, stages nothing until the next activation, and its next switch is H2D."""
    models = (QWEN, GLM, MISTRAL)
    engine = make(models, staging=True, staging_region="second")
    qwen = cost().weight_bytes_per_gpu()
    lent = engine.kv_capacity_blocks(QWEN, lent=True)
    assert lent == cost().kv_capacity_tokens(qwen, 0) // BS > engine.kv_capacity_blocks(QWEN)
    engine.activate(GLM)
    engine.stage(MISTRAL)
    engine.activate(QWEN, lend_staging=True)
    assert engine.stats().num_total_blocks == lent
    assert engine.residency()[MISTRAL] == Residency.HOST  # the staged copy was overwritten
    with pytest.raises(ValueError, match="lent"):
        engine.stage(MISTRAL)
    assert engine.activate(MISTRAL).kind == "activate_h2d"
    assert engine.stats().num_total_blocks == engine.kv_capacity_blocks(MISTRAL)
    assert engine.stage(GLM).kind == "stage"  # the region is the staging region again
    without = make(models, staging=False)
    assert without.kv_capacity_blocks(QWEN, lent=True) == without.kv_capacity_blocks(QWEN)
    without.activate(GLM)
    with pytest.raises(ValueError, match="no staging region"):
        without.activate(QWEN, lend_staging=True)
    assert without.active_model == GLM  # refused before anything moved


def test_with_a_fixed_kv_region_the_lent_cache_adds_the_staging_region_as_live() -> None:
    """``kv_tokens`` sizes the KV region for the model with the most KV bytes per token (as
    the live arena does); lent, each model's cache spans that region and the staging one."""
    engine = make((QWEN, GLM), staging=True, kv_tokens=64 * BS)
    per_token = {m: cost(m).kv_bytes_per_token_per_gpu() for m in (QWEN, GLM)}
    region = 64 * BS * max(per_token.values()) + engine.memory.staging_bytes
    for model in (QWEN, GLM):
        assert engine.kv_capacity_blocks(model) == 64
        assert engine.kv_capacity_blocks(model, lent=True) == region // (BS * per_token[model])


def test_the_active_model_borrows_the_staging_region_once_nothing_runs() -> None:
    """Lending to the model already active: no weight copy, only the wait for a staging copy
    in flight (as a lending switch waits), refused while a request is unfinished; the KV
    cache then has the lent blocks until the next switch gives the region back."""
    clock = Clock()
    engine = make((QWEN, GLM, MISTRAL), staging=True, clock=clock)
    engine.activate(GLM)
    engine.add_request(req("a", tokens(500), max_tokens=3, model=GLM))
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.activate(GLM, lend_staging=True)
    assert engine.stats().num_total_blocks == engine.kv_capacity_blocks(GLM)
    drain(engine)
    engine.stage(MISTRAL)
    copy = cost(MISTRAL).switch_seconds_host()
    clock.now += copy / 4
    report = engine.activate(GLM, lend_staging=True)
    assert report.kind == "none" and report.bytes == 0
    assert report.seconds == pytest.approx(copy * 3 / 4)
    assert engine.stats().num_total_blocks == engine.kv_capacity_blocks(GLM, lent=True)
    assert engine.residency()[MISTRAL] == Residency.HOST
    assert engine.activate(GLM, lend_staging=True).seconds == 0.0  # lent already
    assert engine.stats().num_total_blocks == engine.kv_capacity_blocks(GLM, lent=True)
    assert engine.activate(MISTRAL).kind == "activate_h2d"
    assert engine.stats().num_total_blocks == engine.kv_capacity_blocks(MISTRAL)
