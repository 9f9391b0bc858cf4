"""The instance's small parts: the fake engine keeps to the engine protocol; the rate book
learns from what the engine reports."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine

from engine.interface import MoveReport, MultiModelEngineProtocol, StepResult
from talaria.instance.rates import RateBook


def test_fake_engine_implements_the_protocol() -> None:
    assert isinstance(FakeEngine(["a"]), MultiModelEngineProtocol)


def test_rates_learn_from_reported_seconds() -> None:
    rates = RateBook(["a", "b"], alpha=0.5, kv_bytes_per_token={"a": 100.0, "b": 300.0})
    rates.observe("step", StepResult([], 0.1, num_prefill_tokens=0, num_decode_tokens=4), "a")
    rates.observe("step", StepResult([], 0.3, num_prefill_tokens=1000, num_decode_tokens=4), "a")
    m = rates.models["a"]
    assert m.decode_step_s.value == pytest.approx(0.1)
    fused = StepResult([], 0.5, num_decode_tokens=20, num_steps=5)
    rates.observe("step", fused, "a")
    assert m.decode_step_s.value == pytest.approx(0.1)
    rates.observe("step", StepResult([], 0.0, num_steps=0), "a")  # nothing ran
    assert m.decode_step_s.count == 2
    assert m.prefill_tokens_per_s.value == pytest.approx(1000 / 0.2)
    rates.observe("activate", MoveReport("activate_h2d", 10**9, 4.0), "a")
    rates.observe("activate", MoveReport("activate_d2d", 10**9, 0.5), "a")
    assert m.switch_s(staged=False) == 4.0 and m.switch_s(staged=True) == 0.5
    rates.observe("offload_kv", MoveReport("kv_offload", 2000, 0.001), "a")
    assert rates.restore_s("a", 1000) == pytest.approx(1000 * 100 / 2e6)
    assert rates.restore_s("b", 1000) == pytest.approx(1000 * 300 / 2e6)  # each model its own
    assert RateBook(["a"], 0.5, {"a": 100.0}).restore_s("a", 1000) == 0.0  # no rate yet: free
    rates.observe_restores("b", 10)  # the engine's running total: 10 of b's
    rates.observe_restores("a", 20)  # then 10 of a's
    rates.observe_restores("a", 20)  # a step that restored nothing
    rates.observe_restores(None, 20)
    assert rates.kv_restored_bytes == 4000
