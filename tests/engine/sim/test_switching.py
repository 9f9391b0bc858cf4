"""Switch prices of the engines compared: the substrate's copy, vLLM/SGLang sleep and wake,
Aegaeon's scale-up; the sleep/wake rates against vLLM's own measurement."""

from __future__ import annotations

import dataclasses

import pytest

from engine.sim.cost_model import CostModel
from engine.sim.model_spec import ModelSpec
from engine.sim.switching import AEGAEON_FIXED_S, SleepWakeRates, switch_seconds
from substrate.devices import GB, HOST_LINK_SHARE_ALL_GPUS, ServerSpec, server_preset

H200X8 = server_preset("h200x8")


def cm(name: str = "qwen3-235b-a22b", server: ServerSpec = H200X8, tp: int = 8) -> CostModel:
    return CostModel(server, ModelSpec.load(name), tp)


def test_measured_sleep_mode_efficiency_is_about_45_percent_of_the_a100_link() -> None:
    rates = SleepWakeRates()
    assert rates.wake_efficiency == pytest.approx(0.436, abs=0.005)
    assert rates.sleep_efficiency == pytest.approx(0.400, abs=0.005)
    assert SleepWakeRates(efficiency=0.85).wake_efficiency == 0.85
    with pytest.raises(ValueError, match="efficiency"):
        SleepWakeRates(efficiency=1.5)


def test_wake_on_an_a100_link_reproduces_the_measured_seconds() -> None:
    """Qwen3-235B-A22B-FP8 at TP=4 over a 25 GB/s link: vLLM measured 5.27-5.66 s; the
    rates applied to this model's own bytes per GPU must land there."""
    a100_link = dataclasses.replace(H200X8.device, host_link_bytes_per_s=25 * GB)
    server = dataclasses.replace(H200X8, device=a100_link)
    fp8 = ModelSpec.load("qwen3-235b-a22b").with_weight_dtype("float8_e4m3fn")
    c = CostModel(server, fp8, tp=4)
    assert 5.2 <= SleepWakeRates().wake_seconds(c) <= 5.7


def test_sleep_wake_costs_more_than_the_substrate_copy_and_scales_with_the_link() -> None:
    rates = SleepWakeRates()
    qwen, glm = cm(), cm("glm-4.5-air")
    sw = switch_seconds("sleep_wake", qwen, glm, staged=False, sleep_wake=rates)
    assert sw == pytest.approx(rates.sleep_seconds(glm) + rates.wake_seconds(qwen))
    # H200's 50 GB/s link at the measured efficiency: about 21.8 GB/s for a wake
    assert rates.wake_seconds(qwen) == pytest.approx(qwen.weight_bytes_per_gpu() / (0.436 * 50 * GB),
                                                    rel=0.01)
    copy = switch_seconds("copy", qwen, glm, staged=False, sleep_wake=rates)
    assert copy == qwen.switch_seconds_host() < rates.wake_seconds(qwen) < sw
    optimistic = SleepWakeRates(efficiency=1.0)  # no dearer than the substrate's copy
    assert optimistic.wake_seconds(qwen) == pytest.approx(copy)
    assert copy < rates.wake_seconds(qwen)
    assert switch_seconds("sleep_wake", qwen, None, staged=False, sleep_wake=rates) == (
        rates.wake_seconds(qwen))


def test_scale_up_is_the_copy_plus_a_fixed_cost() -> None:
    rates = SleepWakeRates()
    qwen = cm()
    for staged in (False, True):
        copy = switch_seconds("copy", qwen, None, staged=staged, sleep_wake=rates)
        assert switch_seconds("scale_up", qwen, None, staged=staged, sleep_wake=rates) == (
            pytest.approx(copy + AEGAEON_FIXED_S))
        assert switch_seconds("scale_up", qwen, None, staged=staged, sleep_wake=rates,
                              scale_up_fixed_s=1.0) == pytest.approx(copy + 1.0)
    with pytest.raises(ValueError, match="unknown switch"):
        switch_seconds("teleport", qwen, None, staged=False, sleep_wake=rates)


def test_the_servers_host_link_share_is_the_one_sleep_mode_measured() -> None:
    """HOST_LINK_SHARE_ALL_GPUS is vLLM's concurrent wake over one GPU waking alone (85%),
    so a wake on the preset costs a plain host copy over 0.85: the sleep-mode rows pay for
    their mechanism, and the copying concurrently once, like every other row."""
    assert SleepWakeRates().wake_efficiency == pytest.approx(HOST_LINK_SHARE_ALL_GPUS * 0.85)
    qwen = cm()
    assert SleepWakeRates().wake_seconds(qwen) == pytest.approx(qwen.switch_seconds_host() / 0.85)
    assert SleepWakeRates(efficiency=0.85).wake_seconds(qwen) == pytest.approx(
        SleepWakeRates().wake_seconds(qwen))
