"""A model whose staging copies fail waits a doubling backoff (capped) before its next try;
a copy seen complete ends its run of failures."""

from __future__ import annotations

import pytest

from engine.interface import Residency
from talaria.instance.staging import MAX_BACKOFF_DOUBLINGS, StagingRetries


def test_the_backoff_doubles_is_capped_and_ends_once_the_model_stages() -> None:
    counters: dict[str, int] = {}
    retries = StagingRetries("i", 1.0, counters)
    assert retries.may_stage("b", 0.0)
    waits = [retries.failed("b", 0.0) for _ in range(MAX_BACKOFF_DOUBLINGS + 3)]
    assert waits[:4] == [1.0, 2.0, 4.0, 8.0]
    assert waits[-1] == waits[-2] == 2.0**MAX_BACKOFF_DOUBLINGS
    assert not retries.may_stage("b", waits[-1] - 0.1) and retries.may_stage("b", waits[-1])
    assert retries.may_stage("a", 0.0)  # per model
    retries.observe(["a"], {"a": Residency.HOST, "b": Residency.STAGING}, 10.0)  # a background one
    assert not retries.may_stage("a", 10.5) and retries.may_stage("a", 11.0)
    assert counters["staging_failures"] == len(waits) + 1
    retries.observe([], {"a": Residency.HOST, "b": Residency.STAGED}, 20.0)
    assert retries.may_stage("b", 20.0) and retries.failed("b", 20.0) == 1.0  # afresh
    with pytest.raises(ValueError, match="backoff"):
        StagingRetries("i", 0.0, counters)
