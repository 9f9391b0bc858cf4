"""The session-length prior is the development half of the real trace, and only that half."""

from __future__ import annotations

import pytest

from talaria.policies.session_length import SWE_AGENT_CALLS, swe_agent_prior
from workloads.traces.generator import _percentiles
from workloads.traces.readers import read_real_trace
from workloads.traces.split import dev_half, report_half


def test_the_prior_is_the_real_trace_development_half() -> None:
    sessions = read_real_trace()
    dev = _percentiles([s.num_calls for s in dev_half(sessions)])
    assert SWE_AGENT_CALLS == pytest.approx(dev, abs=0.006)  # written rounded to 0.01
    report = _percentiles([s.num_calls for s in report_half(sessions)])
    assert SWE_AGENT_CALLS != pytest.approx(report, abs=0.006)


def test_expected_remaining_calls_fall_as_a_session_goes_on() -> None:
    prior = swe_agent_prior()
    values = [prior.expected_remaining(k) for k in (0, 10, 40, 100, 500)]
    assert values == sorted(values, reverse=True)
    assert values[0] == pytest.approx(42.4, abs=0.1) and values[-1] == 1.0
