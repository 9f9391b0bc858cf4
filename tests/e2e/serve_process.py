"""Run `talaria serve` as a subprocess for end-to-end tests: start it on free ports, read the
router URL and the instances' pids from its stdout, stop it with SIGINT and check that no
process it started is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass
class ServeProcess:
    proc: subprocess.Popen[str]
    url: str = ""  # the router's OpenAI base URL (ends in /v1)
    instances: dict[str, tuple[int, str]] = field(default_factory=dict)  # id -> (pid, url)
    stderr_lines: list[str] = field(default_factory=list)
    stdout_lines: list[str] = field(default_factory=list)

    def descendants(self) -> set[int]:
        """Every live process below the serve process (instances and their workers)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
        out: set[int] = set()
        todo = [self.proc.pid]
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in out:
                    out.add(child)
                    todo.append(child)
        return out

    def stop(self, timeout_s: float = 60.0, sig: int = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"talaria serve did not exit within {timeout_s} s of SIGINT") from None

    def log(self) -> str:
        return "".join(self.stderr_lines[-60:])


def launch_serve(
    cache: Path, config: Path | None = None, cwd: Path = REPO, env: dict[str, str] | None = None,
    args: tuple[str, ...] = ("--tiny-only",),
) -> ServeProcess:
    """Start `talaria serve --port 0 *args` with its output collected (not waiting for it);
    ``cwd`` and ``env`` (added to this process's) as given. The serve process itself runs
    with ``-P``, as the ``talaria`` script does (its directory, not ``cwd``, on its path). By
    default the catalog (when the config names none) is the tiny models alone: the tests of
    the real model pass ``args=()``."""
    env = {**os.environ, "TALARIA_CACHE": str(cache), "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-P", "-m", "talaria.cli", "serve", "--port", "0", *args]
    if config is not None:
        cmd += ["--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    serve = ServeProcess(proc)
    assert proc.stderr is not None and proc.stdout is not None
    threading.Thread(target=_drain, args=(proc.stderr, serve.stderr_lines), daemon=True).start()
    threading.Thread(target=_drain, args=(proc.stdout, serve.stdout_lines), daemon=True).start()
    return serve


def start_serve(
    cache: Path, config: Path | None = None, timeout_s: float = 180.0, **launch: Any
) -> ServeProcess:
    """Start `talaria serve` and wait until its router and every instance are ready
    (``launch``: ``launch_serve``'s arguments)."""
    serve = launch_serve(cache, config, **launch)
    proc, lines = serve.proc, serve.stdout_lines
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(lines):
            parts = line.split()
            if parts[:1] == ["ROUTER_READY"]:
                serve.url = parts[1]
            elif parts[:1] == ["INSTANCE"]:
                serve.instances[parts[1]] = (int(parts[2]), parts[3])
        if serve.url and len(serve.instances) >= _expected(config):
            return serve
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    serve.stop(10)
    raise AssertionError(f"talaria serve did not become ready:\n{serve.log()}")


def _expected(config: Path | None) -> int:
    if config is None:
        return 1
    return config.read_text().count("[[instances]]")


def _drain(stream: object, sink: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        sink.append(line)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:  # a zombie is gone for our purposes
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
