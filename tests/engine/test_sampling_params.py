"""Sampling parameters are checked by type and range (a boolean is not an integer, a seed is a
64-bit integer); a temperature too small to divide by samples greedily instead of producing
NaN probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams


@pytest.mark.parametrize("temperature", [1e-320, 1e-30, 1e-6])
def test_a_tiny_temperature_samples_greedily(temperature: float) -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=temperature, logprobs=True)
    assert params.greedy
    out = Sampler(torch.Generator().manual_seed(0))(logits, [params] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert all(lp is not None and math.isfinite(lp) for lp in out.logprobs)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": True}, {"max_tokens": 2.0}, {"temperature": "1"},
        {"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": True},
        {"top_k": True}, {"top_k": 1.5}, {"seed": "x"}, {"seed": True}, {"seed": 1 << 64},
        {"seed": 1.0}, {"stop": [1]}, {"stop_token_ids": [True]}, {"stop_token_ids": "1"},
        {"ignore_eos": 1}, {"logprobs": "yes"}, {"thinking_budget": -1},
        {"thinking_budget": True}, {"thinking_budget": 2.0}, {"thinking_start_ids": [-1]},
        {"thinking_end_ids": "7"}, {"thinking_from_start": 1},
        {"thinking_budget": 4, "thinking_from_start": True},
        {"thinking_budget": 4, "thinking_end_ids": [7]},
    ],
)
def test_wrong_types_and_ranges_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_good_values_pass() -> None:
    p = SamplingParams(max_tokens=3, temperature=0, top_k=5, top_p=0.5, seed=-(1 << 63),
                       stop="x", stop_token_ids=[0, 2], ignore_eos=True, logprobs=True)
    assert p.stop == ["x"] and p.greedy and not SamplingParams(temperature=0.5).greedy
    for start in ({"thinking_from_start": True}, {"thinking_start_ids": [5, 6]}):
        assert SamplingParams(thinking_budget=0, thinking_end_ids=[7], **start).thinking_budget == 0  # type: ignore[arg-type]
    assert SamplingParams(thinking_end_ids=[7]).thinking_budget is None  # ids without a budget: unused


def test_vllms_spellings_of_none_are_taken() -> None:
    """A script written for vLLM passes ``stop=None``, ``stop_token_ids=None`` and ``top_k=-1``
    (vLLM's "no top-k" before 0 was): each means what the default means."""
    p = SamplingParams(stop=None, stop_token_ids=None, top_k=-1)  # type: ignore[arg-type]
    assert (p.stop, p.stop_token_ids, p.top_k) == ([], [], 0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
