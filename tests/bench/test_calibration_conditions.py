"""A calibration records the conditions it was measured under, and a spec measured under
others (another CPU, torch build, thread count, clock, a different background load, too
long ago) or recording none is refused, with the reason."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest

from substrate.devices import DeviceSpec, ServerSpec
from talaria.bench.calibrate import write_spec
from talaria.bench.calibration_conditions import (
    Conditions,
    Tolerance,
    current_conditions,
    mismatches,
    recorded_conditions,
    reusable_spec,
)

SERVER = ServerSpec("cpu-test", DeviceSpec(name="core", hbm_bytes=10**10, hbm_bytes_per_s=8e9,
                                          bf16_flops=6e10, nvlink_bytes_per_s=1e9,
                                          host_link_bytes_per_s=5e9, d2d_bytes_per_s=5e9),
                    num_devices=2)
THEN = Conditions((0.3, 0.5, 0.6), 2, "AMD EPYC", 1, "2.13.0", "thread_cpu", 1_000_000.0, "box")


def test_the_present_conditions_name_this_machine_and_round_trip() -> None:
    now = current_conditions(1, "thread_cpu")
    assert now.cpu_count >= 1 and now.cpu_model and now.torch_version
    assert now.torch_threads == 1 and now.clock == "thread_cpu" and len(now.load_average) == 3
    data = now.to_dict()
    assert "measured_at_local" in data
    assert Conditions.from_dict(orjson.loads(orjson.dumps(data))) == now
    with pytest.raises(ValueError, match="bad calibration conditions"):
        Conditions.from_dict({**data, "load_average": [1.0]})


def test_the_same_conditions_hold_and_each_difference_is_named() -> None:
    later = dataclasses.replace(THEN, load_average=(0.7, 0.6, 0.6), measured_at=THEN.measured_at + 60)
    assert mismatches(THEN, later) == []  # 0.4 apart: within 0.25 per CPU on 2 CPUs
    for field, value in (("cpu_model", "Intel Xeon"), ("cpu_count", 4),
                         ("torch_version", "2.14.0"), ("torch_threads", 2), ("clock", "wall")):
        (reason,) = mismatches(THEN, dataclasses.replace(later, **{field: value}))
        assert reason.startswith(field)
    (busy,) = mismatches(THEN, dataclasses.replace(later, load_average=(2.3, 1.0, 0.7)))
    assert "load average was 0.30" in busy and "now 2.30" in busy
    (old,) = mismatches(THEN, dataclasses.replace(later, measured_at=THEN.measured_at + 2 * 86400))
    assert "48.0 h ago" in old
    strict = Tolerance(load_per_cpu=0.1, max_age_s=30)
    assert len(mismatches(THEN, later, strict)) == 2


def test_a_spec_is_reused_only_when_it_records_conditions_that_hold(tmp_path: Path) -> None:
    path = tmp_path / "cpu_server.json"
    assert reusable_spec(path, THEN) == [f"{path} does not exist"]
    write_spec(SERVER, {"threads_per_rank": 1}, path)  # a spec from before conditions
    assert recorded_conditions(orjson.loads(path.read_bytes())) is None
    (reason,) = reusable_spec(path, THEN)
    assert "does not record the conditions" in reason
    write_spec(SERVER, {"conditions": THEN.to_dict()}, path)
    assert reusable_spec(path, dataclasses.replace(THEN, measured_at=THEN.measured_at + 5)) == []
    (reason,) = reusable_spec(path, dataclasses.replace(THEN, torch_threads=2,
                                                        measured_at=THEN.measured_at + 5))
    assert reason == "torch_threads was 1, now 2"
    path.write_text("{not json")
    (reason,) = reusable_spec(path, THEN)
    assert "is not a calibration" in reason
