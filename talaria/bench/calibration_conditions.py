"""The conditions a calibration was measured under, recorded in the spec file beside it
(``calibration.conditions``), and the check that refuses a spec measured under other ones.

A calibration describes this machine as it was when measured: its CPU, the torch build and
threads the kernels ran with, the clock they were timed on, and how busy the machine was
(other processes share the caches and memory bandwidth even where the clock does not count
their time). A spec is reused only where all of these still hold (``TOLERANCE``):
- the same CPU model and count, torch version, torch threads per rank and clock;
- the machine's background load (the 1-minute load average before the calibration
  started, against the one now) within ``load_per_cpu`` per CPU: 0.5 on 2 CPUs;
- at most ``max_age_s`` old (a virtual machine may have moved to another host).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

__all__ = ["Conditions", "Tolerance", "TOLERANCE", "current_conditions", "mismatches",
           "recorded_conditions", "reusable_spec"]


@dataclass(frozen=True)
class Conditions:
    load_average: tuple[float, float, float]  # 1, 5 and 15 minutes
    cpu_count: int
    cpu_model: str
    torch_threads: int
    torch_version: str
    clock: str  # talaria.bench.timing: "thread_cpu" or "wall"
    measured_at: float  # seconds since the epoch
    host: str

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["measured_at_local"] = time.strftime("%Y-%m-%d %H:%M:%S",
                                                 time.localtime(self.measured_at))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Conditions:
        try:
            load = tuple(float(x) for x in data["load_average"])
            if len(load) != 3:
                raise ValueError(f"load_average needs 3 values, got {len(load)}")
            return cls((load[0], load[1], load[2]), int(data["cpu_count"]),
                       str(data["cpu_model"]), int(data["torch_threads"]),
                       str(data["torch_version"]), str(data["clock"]),
                       float(data["measured_at"]), str(data["host"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad calibration conditions: {exc!r}") from exc


@dataclass(frozen=True)
class Tolerance:
    load_per_cpu: float = 0.25
    max_age_s: float = 24 * 3600.0


TOLERANCE = Tolerance()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def current_conditions(threads: int, clock: str) -> Conditions:
    """This machine now, for work at ``threads`` torch threads timed on ``clock``."""
    import torch

    one, five, fifteen = os.getloadavg()
    return Conditions((one, five, fifteen), os.cpu_count() or 1, cpu_model(), threads,
                      torch.__version__, clock, time.time(), platform.node())


def mismatches(recorded: Conditions, now: Conditions,
               tolerance: Tolerance = TOLERANCE) -> list[str]:
    """Why a calibration taken under ``recorded`` does not hold ``now`` (empty: it does)."""
    out = [f"{name} was {a!r}, now {b!r}" for name, a, b in (
        ("cpu_model", recorded.cpu_model, now.cpu_model),
        ("cpu_count", recorded.cpu_count, now.cpu_count),
        ("torch_version", recorded.torch_version, now.torch_version),
        ("torch_threads", recorded.torch_threads, now.torch_threads),
        ("clock", recorded.clock, now.clock)) if a != b]
    allowed = tolerance.load_per_cpu * now.cpu_count
    then_load, now_load = recorded.load_average[0], now.load_average[0]
    if abs(then_load - now_load) > allowed:
        out.append(f"load average was {then_load:.2f} before it was measured, now "
                   f"{now_load:.2f} (more than {allowed:.2f} apart)")
    age = now.measured_at - recorded.measured_at
    if not 0 <= age <= tolerance.max_age_s:
        out.append(f"measured {age / 3600:.1f} h ago (at most {tolerance.max_age_s / 3600:.0f} h)")
    return out


def recorded_conditions(data: Mapping[str, Any]) -> Conditions | None:
    """The conditions in a spec file's JSON (None for a spec that has none)."""
    calibration = data.get("calibration")
    if not isinstance(calibration, Mapping) or "conditions" not in calibration:
        return None
    return Conditions.from_dict(calibration["conditions"])


def reusable_spec(path: str | Path, now: Conditions,
                  tolerance: Tolerance = TOLERANCE) -> list[str]:
    """Why the spec at ``path`` may not be reused ``now`` (empty: it may): it is missing or
    unreadable, records no conditions, or was measured under others."""
    path = Path(path)
    if not path.is_file():
        return [f"{path} does not exist"]
    try:
        data = orjson.loads(path.read_bytes())
        recorded = recorded_conditions(data)
    except (orjson.JSONDecodeError, ValueError) as exc:
        return [f"{path} is not a calibration: {exc}"]
    if recorded is None:
        return [f"{path} does not record the conditions it was measured under"]
    return mismatches(recorded, now, tolerance)
