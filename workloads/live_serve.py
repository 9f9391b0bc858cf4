"""``talaria serve`` as a child process, for replays against a live system (``talaria
fidelity``): started on free ports from a config file, ready once its router and every
instance said so on stdout, stopped with SIGINT (it stops its instances itself)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["ServeFailed", "running_serve"]


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
