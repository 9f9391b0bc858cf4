"""``talaria serve`` as a child process, for replays against a live system (``talaria
fidelity``): started on free ports from a config file, ready once its router and every
instance said so on stdout, stopped with SIGINT (it stops its instances itself). What its
instances counted is read from the router's ``/metrics`` (``instance_counters``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["COUNTER_GAUGES", "ServeFailed", "instance_counters", "parse_counters", "running_serve"]

# instance counters the router's /metrics exposes, by the admission loop's counter name
COUNTER_GAUGES = {"kv_demotions": "talaria_instance_kv_demotions",
                  "staging_lends": "talaria_instance_staging_lends"}


class ServeFailed(RuntimeError):
    """``talaria serve`` exited or did not become ready; the message ends with its log."""


@contextlib.contextmanager
def running_serve(
    config: Path, *, env: Mapping[str, str] | None = None, timeout_s: float = 300.0,
    instances: int = 1,
) -> Iterator[str]:
    """Run ``talaria serve --config config --port 0`` until the block ends; yields the
    router's base URL once the router and ``instances`` instances are ready."""
    cmd = [sys.executable, "-m", "talaria.cli", "serve", "--config", str(config), "--port", "0",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    out: list[str] = []
    err: list[str] = []
    assert proc.stdout is not None and proc.stderr is not None
    for stream, sink in ((proc.stdout, out), (proc.stderr, err)):
        threading.Thread(target=_drain, args=(stream, sink), daemon=True).start()
    try:
        yield _wait_ready(proc, out, err, instances, timeout_s)
    finally:
        _stop(proc)


def _wait_ready(proc: subprocess.Popen[str], out: list[str], err: list[str], instances: int,
                timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [line.split() for line in list(out)]
        urls = [parts[1] for parts in lines if parts[:1] == ["ROUTER_READY"]]
        ready = sum(1 for parts in lines if parts[:1] == ["INSTANCE"])
        if urls and ready >= instances:
            return urls[0]
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    log = "".join(err[-40:])
    raise ServeFailed(f"talaria serve did not become ready (exit status {proc.poll()}):\n{log}")


def _stop(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _drain(stream: object, sink: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        sink.append(line)


def instance_counters(url: str, settle_s: float = 1.5, timeout_s: float = 10.0) -> dict[str, int]:
    """The admission-loop counters of ``COUNTER_GAUGES`` summed over every instance, as the
    router at ``url`` (its API base, ``.../v1``, as ``running_serve`` yields it) last heard
    them; read after ``settle_s`` (longer than the router's 1 s state poll), so that the end
    of a replay is in them."""
    time.sleep(settle_s)
    root = url.removesuffix("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    return parse_counters(text)


def parse_counters(metrics_text: str) -> dict[str, int]:
    """Sum each gauge of ``COUNTER_GAUGES`` over its samples in a Prometheus text page."""
    out = dict.fromkeys(COUNTER_GAUGES, 0)
    names = {gauge: counter for counter, gauge in COUNTER_GAUGES.items()}
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        counter = names.get(name.split("{", 1)[0])
        if counter is not None:
            out[counter] += int(float(value))
    return out
