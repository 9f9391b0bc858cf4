"""Start, watch and stop the worker processes of one tensor-parallel group.

Rank 0 is the calling process; ranks 1..N-1 are spawned (``torch.multiprocessing``, spawn)
and joined through a process group of their own over a TCP store at (address, port): port 0
lets the OS pick a free one, so engines on one host never collide. Each worker has one pipe
to rank 0 for commands (see ``engine.parallel.worker``).

Failure contract: a worker that dies turns the next (or the pending) operation into
``RuntimeError("tensor-parallel worker rank k died (exit code c)")`` within seconds: process
sentinels are checked before every command and after a failed collective, and gloo reports
a closed peer at once (a hung peer by the collective timeout). Any failure breaks the group:
the other workers are stopped at once and every later call raises the same error.
``shutdown`` (also run at garbage collection and at interpreter exit) stops all workers:
a shutdown command, then terminate, then kill; no process is left behind.
"""

from __future__ import annotations

import datetime
import itertools
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import structlog
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.parallel.channel import StepMessage
from engine.parallel.worker import (
    RankContext,
    WorkerArgs,
    make_process_group,
    op_name,
    rank_device,
    resolve_op,
    worker_main,
)
from engine.parallel_context import ParallelContext

log = structlog.get_logger(__name__)

_DEATH_GRACE_S = 3.0  # how long to wait for a sentinel after a collective fails


class WorkerGroup:
    """Ranks 0..N-1 of one tensor-parallel group; this process is rank 0."""

    def __init__(
        self,
        ctx: RankContext,
        procs: list[Any],
        conns: list[Connection],
        store: dist.Store,
        address: str,
        port: int,
    ) -> None:
        self.ctx = ctx
        self.procs = procs  # index i holds rank i + 1
        self.conns = conns
        self.address = address
        self.port = port
        self._store = store
        self._keys = itertools.count()
        self._error: RuntimeError | None = None
        self._finalizer = weakref.finalize(self, _stop_workers, list(procs), list(conns))

    def new_key(self, prefix: str = "model") -> str:
        """A runner key not used before on this group (every rank holds runners by key)."""
        return f"{prefix}-{next(self._keys)}"

    # ------------------------------------------------------------------ start
    @classmethod
    def start(
        cls,
        world_size: int,
        *,
        device: str | torch.device = "cpu",
        address: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 60.0,
    ) -> WorkerGroup:
        """Spawn ranks 1..N-1 and join them; raises RuntimeError naming the rank when one
        fails to start, ValueError for a world size the devices cannot hold."""
        if world_size < 2:
            raise ValueError(f"a worker group needs at least 2 ranks, got {world_size}")
        dev = torch.device(device)
        if dev.type == "cuda":
            base = dev.index if dev.index is not None else torch.cuda.current_device()
            if base + world_size > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size {world_size} needs CUDA devices {base}.."
                    f"{base + world_size - 1}, only {torch.cuda.device_count()} are visible"
                )
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(
            address, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout
        )
        port = int(store.port)
        threads = max(1, (os.cpu_count() or 1) // world_size)
        spawn = mp.get_context("spawn")
        procs: list[Any] = []
        conns: list[Connection] = []
        try:
            for rank in range(1, world_size):
                parent_end, child_end = spawn.Pipe(duplex=True)
                args = WorkerArgs(
                    rank,
                    world_size,
                    address,
                    port,
                    str(rank_device(dev, rank)),
                    timeout_s,
                    threads,
                )
                proc = spawn.Process(
                    target=worker_main,
                    args=(args, child_end),
                    daemon=True,
                    name=f"talaria-tp-rank{rank}",
                )
                proc.start()
                child_end.close()
                procs.append(proc)
                conns.append(parent_end)
            group = _join_rank0(world_size, store, dev, timeout_s, address, procs, conns)
            _wait_ready(procs, conns, deadline=time.monotonic() + timeout_s)
        except BaseException:
            _stop_workers(procs, conns)
            raise
        ctx = RankContext(0, world_size, ParallelContext(0, world_size, group), dev)
        log.info("tp.started", world_size=world_size, address=address, port=port)
        return cls(ctx, procs, conns, store, address, port)

    # ----------------------------------------------------------------- status
    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def parallel(self) -> ParallelContext:
        return self.ctx.parallel

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def is_alive(self) -> bool:
        return self._error is None and bool(self._finalizer.alive)

    def check(self) -> None:
        """Raise the group's error if it is broken, shut down, or a worker has died."""
        if self._error is not None:
            raise self._error
        if not self._finalizer.alive:
            raise RuntimeError("the tensor-parallel group has been shut down")
        dead = self._dead()
        if dead:
            self._break(dead)

    # --------------------------------------------------------------- commands
    def broadcast_step(self, msg: StepMessage) -> None:
        """Send one step to every worker (no reply: the step's collectives synchronise)."""
        self.check()
        self._send_all(pickle.dumps(("step", msg), protocol=pickle.HIGHEST_PROTOCOL))

    def run_on_all_ranks(
        self,
        fn: str | Callable[..., Any],
        *args: Any,
        local_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank (rank 0 here, with ``local_kwargs``
        added) and return the results by rank. ``fn`` is a module-level function or its
        ``"module:qualname"``; args and results travel pickled, so keep them small. The op
        may use collectives: all ranks run it at the same time. Any rank failing breaks
        the group (its collectives may be half done) and raises RuntimeError."""
        self.check()
        name = op_name(fn)
        self._send_all(pickle.dumps(("call", name, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL))
        try:
            local = resolve_op(name)(self.ctx, *args, **kwargs, **(local_kwargs or {}))
        except BaseException as exc:
            self.fail(exc, f"op {name} failed on rank 0")
        results = [local]
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            kind, value = self._reply(rank, proc, conn)
            if kind != "ok":
                self._break_with(RuntimeError(f"op {name} failed on {value}"))
            results.append(value)
        return results

    def fail(self, exc: BaseException, what: str) -> None:
        """Turn ``exc`` (raised by a collective or an op on rank 0) into the group's error,
        naming a dead worker when there is one; always raises."""
        if self._error is not None:
            raise self._error from exc
        deadline = time.monotonic() + _DEATH_GRACE_S
        dead = self._dead()
        while not dead and time.monotonic() < deadline and isinstance(exc, RuntimeError):
            wait([p.sentinel for p in self.procs], timeout=0.05)
            dead = self._dead()
        if dead:
            self._break(dead, cause=exc)
        reported = self._reported_errors()
        detail = f"; {reported}" if reported else ""
        self._break_with(RuntimeError(f"tensor-parallel {what}: {exc}{detail}"), cause=exc)

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
        if self._finalizer.alive:
            self._finalizer()
            log.info("tp.stopped", world_size=self.world_size, port=self.port)

    # ---------------------------------------------------------------- helpers
    def _send_all(self, payload: bytes) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(payload)
            except OSError as exc:
                self.fail(exc, f"sending to rank {rank} failed")

    def _reply(self, rank: int, proc: Any, conn: Connection) -> tuple[str, Any]:
        while True:
            ready = wait([conn, proc.sentinel])
            if conn in ready:
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    pass
            if proc.exitcode is not None or proc.sentinel in ready:
                proc.join(timeout=_DEATH_GRACE_S)
                self._break([(rank, proc.exitcode)])

    def _dead(self) -> list[tuple[int, int | None]]:
        return [
            (rank, p.exitcode)
            for rank, p in enumerate(self.procs, start=1)
            if p.exitcode is not None
        ]

    def _reported_errors(self) -> str:
        texts = []
        for conn in self.conns:
            try:
                while conn.poll(0):
                    kind, value = conn.recv()
                    if kind == "error":
                        texts.append(str(value).strip())
            except (EOFError, OSError):
                continue
        return "\n".join(texts)

    def _break(
        self, dead: list[tuple[int, int | None]], cause: BaseException | None = None
    ) -> None:
        reported = self._reported_errors()
        rank, code = dead[0]
        msg = f"tensor-parallel worker rank {rank} died (exit code {code})"
        if reported:
            msg += f": {reported}"
        self._break_with(RuntimeError(msg), cause=cause)

    def _break_with(self, error: RuntimeError, cause: BaseException | None = None) -> None:
        self._error = error
        log.error("tp.broken", error=str(error))
        self.shutdown()
        raise error from cause


def _join_rank0(
    world_size: int,
    store: dist.Store,
    device: torch.device,
    timeout_s: float,
    address: str,
    procs: list[Any],
    conns: list[Connection],
) -> dist.ProcessGroup:
    """Create rank 0's process group (a rendezvous with every worker) in a thread, watching
    the workers meanwhile so one that dies during start-up fails fast."""
    result: dict[str, Any] = {}

    def join() -> None:
        try:
            result["group"] = make_process_group(0, world_size, store, device, timeout_s, address)
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=join, name="talaria-tp-join", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        _raise_if_dead(procs, conns, "during start-up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers did not join within {timeout_s} s")
        thread.join(timeout=0.05)
    if "error" in result:
        raise RuntimeError(f"tensor-parallel rank 0 could not join: {result['error']}")
    return result["group"]


def _wait_ready(procs: list[Any], conns: list[Connection], deadline: float) -> None:
    for rank, (proc, conn) in enumerate(zip(procs, conns, strict=True), start=1):
        remaining = max(0.0, deadline - time.monotonic())
        ready = wait([conn, proc.sentinel], timeout=remaining)
        if conn in ready:
            kind, value = conn.recv()
            if kind == "ready":
                continue
            raise RuntimeError(f"tensor-parallel worker failed to start: {value}")
        if not ready:
            raise RuntimeError(f"tensor-parallel worker rank {rank} did not start in time")
        _raise_if_dead(procs, conns, "during start-up")


def _raise_if_dead(procs: list[Any], conns: list[Connection], when: str) -> None:
    for rank, (p, conn) in enumerate(zip(procs, conns, strict=True), start=1):
        if p.exitcode is not None:
            detail = ""
            try:
                if conn.poll(0):
                    kind, value = conn.recv()
                    detail = f": {value}" if kind == "error" else ""
            except (EOFError, OSError):
                pass
            if not detail and when == "during start-up":
                detail = ("; a script that starts tensor parallelism needs its work under "
                          "`if __name__ == \"__main__\":` (each rank's process imports it)")
            raise RuntimeError(
                f"tensor-parallel worker rank {rank} died {when} (exit code {p.exitcode}){detail}"
            )


def _stop_workers(procs: list[Any], conns: list[Connection], grace_s: float = 3.0) -> None:
    """Ask, then terminate, then kill; join all. Safe to call more than once."""
    payload = pickle.dumps(("shutdown",))
    for p, conn in zip(procs, conns, strict=True):
        if p.exitcode is None:
            try:
                conn.send_bytes(payload)
            except OSError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.exitcode is None:
            p.kill()
            p.join(timeout=2.0)
    for conn in conns:
        conn.close()
