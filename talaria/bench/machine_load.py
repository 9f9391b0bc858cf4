"""How busy this machine was while something was measured: the load average, and what the
other processes used of the CPUs (``/proc/stat``'s busy time less this process's and its
descendants'), so that a timing can say whether it was taken on an idle machine.

A sample is cheap (a few files read); ``CpuUse.between`` turns two into rates in cores:
``others`` (0 on an idle machine, up to the CPU count), ``ours``, and ``steal`` (time a
hypervisor gave this virtual machine's CPUs to others). ``LoadWatch`` samples the 1-minute
load average every few seconds in a thread, for its peak and mean over a run. Per-thread
CPU time of child processes (``thread_cpu_s``) says what a live engine's step thread
computed however busy the machine was. Where ``/proc`` is missing (not Linux) the CPU
figures are None or empty.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = ["CpuSample", "CpuUse", "LoadWatch", "busiest_thread_cpu_s", "cpu_sample",
           "descendants", "thread_cpu_s"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuSample:
    at: float  # time.monotonic()
    busy_s: float | None  # non-idle CPU time of the machine since boot, summed over CPUs
    steal_s: float | None
    ours_s: float  # this process, its waited-for children and its live descendants


@dataclass(frozen=True)
class CpuUse:
    seconds: float
    others_cores: float | None
    ours_cores: float
    steal_cores: float | None

    @classmethod
    def between(cls, a: CpuSample, b: CpuSample) -> CpuUse:
        dt = max(b.at - a.at, 1e-9)
        ours = (b.ours_s - a.ours_s) / dt
        if a.busy_s is None or b.busy_s is None or a.steal_s is None or b.steal_s is None:
            return cls(dt, None, ours, None)
        others = max(0.0, (b.busy_s - a.busy_s) / dt - ours)
        return cls(dt, others, ours, (b.steal_s - a.steal_s) / dt)

    def to_dict(self) -> dict[str, float | None]:
        return {"seconds": self.seconds, "others_cores": self.others_cores,
                "ours_cores": self.ours_cores, "steal_cores": self.steal_cores}


def _proc_stat() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds of the machine since boot."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    values = [int(x) / _TICK for x in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
    steal = values[7] if len(values) > 7 else 0.0
    guest = sum(values[8:10])  # already counted in user time
    return sum(values) - idle - guest, steal


def _processes() -> dict[int, tuple[int, float]]:
    """Every process: pid -> (parent pid, CPU seconds of it and of what it waited for)."""
    out: dict[int, tuple[int, float]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # utime stime cutime cstime
        out[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / _TICK)
    return out


def descendants(root: int) -> list[int]:
    """The live processes below ``root`` (its children, theirs, ...)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _cpu) in _processes().items():
        children.setdefault(ppid, []).append(pid)
    out, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def _descendants_cpu_s(root: int) -> float:
    """CPU seconds of ``root``'s live descendants and of what they waited for."""
    table = _processes()
    return sum(table[pid][1] for pid in descendants(root) if pid in table)


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of process ``pid`` (empty if it is gone)."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def busiest_thread_cpu_s(before: dict[int, dict[int, float]],
                         after: dict[int, dict[int, float]]) -> float:
    """The most CPU time one thread used between two snapshots (pid -> ``thread_cpu_s``)."""
    return max((cpu - before.get(pid, {}).get(tid, 0.0)
                for pid, threads in after.items() for tid, cpu in threads.items()), default=0.0)


def cpu_sample() -> CpuSample:
    me = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    ours = me.ru_utime + me.ru_stime + waited.ru_utime + waited.ru_stime
    stat = _proc_stat()
    ours += _descendants_cpu_s(os.getpid())
    return CpuSample(time.monotonic(), stat[0] if stat else None, stat[1] if stat else None,
                     ours)


class LoadWatch:
    """The 1-minute load average every ``every_s`` seconds while the block runs."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LoadWatch:
        self.samples.append(os.getloadavg()[0])
        self._thread = threading.Thread(target=self._run, name="load-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, float]:
        s = self.samples or [os.getloadavg()[0]]
        return {"first": s[0], "max": max(s), "mean": sum(s) / len(s), "last": s[-1]}
