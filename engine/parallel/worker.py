"""One tensor-parallel rank's side: its context, the ops every rank can run, the worker loop.

Rank 0 lives in the engine's process and holds its own ``RankContext``; ranks 1..N-1 run
``worker_main`` in processes started by ``engine.parallel.launcher.WorkerGroup``. A worker
builds its process group, reports ready, then serves commands from its pipe, in order:
``("step", StepMessage)`` runs the same forward as rank 0 (logits are computed, because the
vocab-parallel head gathers across ranks, then discarded); ``("call", fn, args, kwargs)``
runs ``fn(ctx, *args, **kwargs)`` and replies ``("ok", result)`` or ``("error", text)``;
``("shutdown",)`` ends the loop. A closed pipe (rank 0's process is gone) ends it too. A
failed step reports ``("error", text)`` and exits with code 1.

Ops are module-level functions ``fn(ctx: RankContext, *args, **kwargs)`` named by
``"module:qualname"``, so new ones (KV reset, weight copies, KV offload) need no change here.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.parallel.channel import StepDecoder, StepMessage
from engine.parallel_context import ParallelContext


@dataclass
class RankContext:
    """What one rank holds: its parallel context, device, runners by key, and free-form
    state for ops (e.g. a multi-model rank object)."""

    rank: int
    world_size: int
    parallel: ParallelContext
    device: torch.device
    runners: dict[str, ModelRunner] = field(default_factory=dict)
    decoders: dict[str, StepDecoder] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    def step(self, msg: StepMessage) -> None:
        """Run the forward pass rank 0 runs for this step (and the KV loads queued for it,
        as rank 0's ``execute`` does); the logits are discarded."""
        runner = self.runners[msg.key]
        out = self.decoders.setdefault(msg.key, StepDecoder()).decode(msg)
        if out.is_empty:
            return
        try:
            inputs = runner.prepare(out)  # type: ignore[arg-type]
            with torch.inference_mode():
                runner.forward_step(inputs)
        finally:
            runner.settle_kv_loads()


def op_name(fn: str | Callable[..., Any]) -> str:
    """``"module:qualname"`` for a module-level function (or the string itself)."""
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"op name {fn!r} must look like 'package.module:function'")
        return fn
    qualname = getattr(fn, "__qualname__", "")
    if "<" in qualname or not getattr(fn, "__module__", None):
        raise ValueError(f"op {fn!r} must be a module-level function so workers can import it")
    return f"{fn.__module__}:{qualname}"


def resolve_op(name: str) -> Callable[..., Any]:
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"op {name!r} is not callable")
    return obj


# --------------------------------------------------------------------- built-in ops
def load_runner(
    ctx: RankContext, key: str, config: EngineConfig, kv_cache: torch.Tensor | None = None
) -> int:
    """Build ``config``'s model on this rank (its shard only) under ``key``; every rank then
    keeps the smallest rank's KV block count, so block ids mean the same on all ranks.
    Returns the agreed number of blocks. A collective op: run it on all ranks."""
    cfg = replace(config, device=str(ctx.device))
    if cfg.num_kv_blocks is None and ctx.device.type == "cpu" and kv_cache is None:
        cfg = replace(cfg, kv_memory_fraction=cfg.kv_memory_fraction / ctx.world_size)
    runner = ModelRunner.from_config(cfg, kv_cache, parallel=ctx.parallel)
    agreed = torch.tensor([runner.num_blocks], dtype=torch.long, device=ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=ctx.parallel.group)
    n = int(agreed.item())
    if n < runner.num_blocks:
        runner.kv_cache = runner.kv_cache[:, :, :n]
        runner.num_blocks = n
    ctx.runners[key] = runner
    ctx.decoders[key] = StepDecoder()
    return n


def drop_runner(ctx: RankContext, key: str) -> None:
    """Forget the runner under ``key`` (its weights and KV are freed with it)."""
    ctx.runners.pop(key, None)
    ctx.decoders.pop(key, None)


def zero_kv(ctx: RankContext, key: str) -> None:
    """Zero every KV block of the runner under ``key``."""
    ctx.runners[key].kv_cache.zero_()


def call_state_method(ctx: RankContext, state_key: str, method: str, *args: Any, **kw: Any) -> Any:
    """``ctx.state[state_key].method(*args, **kw)``: drive a rank-side object by name."""
    return getattr(ctx.state[state_key], method)(*args, **kw)


def describe(ctx: RankContext) -> dict[str, Any]:
    """Rank, pid, device and the runners' keys and KV block counts (for tests and logs)."""
    return {
        "rank": ctx.rank,
        "pid": os.getpid(),
        "device": str(ctx.device),
        "runners": {k: r.num_blocks for k, r in ctx.runners.items()},
        "tracked": {k: d.num_tracked for k, d in ctx.decoders.items()},
    }


# ------------------------------------------------------------------ process groups
def make_process_group(
    rank: int,
    world_size: int,
    store: dist.Store,
    device: torch.device,
    timeout_s: float,
    address: str,
) -> dist.ProcessGroup:
    """A process group of its own (not the global default one, so several engines can live
    in one process): NCCL for CUDA devices, else gloo over ``address``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore("talaria-tp", store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(prefixed, rank, world_size, opts)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device when rank 0 uses ``device``: the next CUDA indices, or the CPU."""
    if device.type != "cuda":
        return device
    base = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", base + rank)


# ----------------------------------------------------------------------- the loop
@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    world_size: int
    address: str
    port: int
    device: str
    timeout_s: float
    num_threads: int


def worker_main(args: WorkerArgs, conn: Connection) -> None:
    """Entry point of ranks 1..N-1 (``torch.multiprocessing`` spawn target)."""
    try:
        ctx = _start(args)
        conn.send(("ready", os.getpid()))
        _serve(ctx, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(0)  # rank 0's process is gone: nobody to report to
    except BaseException:
        try:
            conn.send(("error", f"rank {args.rank}: {traceback.format_exc()}"))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def _start(args: WorkerArgs) -> RankContext:
    torch.set_num_threads(args.num_threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        args.address,
        args.port,
        args.world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    group = make_process_group(
        args.rank, args.world_size, store, device, args.timeout_s, args.address
    )
    parallel = ParallelContext(args.rank, args.world_size, group)
    ctx = RankContext(args.rank, args.world_size, parallel, device)
    ctx.state["_store"] = store
    return ctx


def _serve(ctx: RankContext, conn: Connection) -> None:
    while True:
        cmd = pickle.loads(conn.recv_bytes())
        kind = cmd[0]
        if kind == "step":
            ctx.step(cmd[1])
        elif kind == "call":
            _, name, args, kwargs = cmd
            try:
                result = resolve_op(name)(ctx, *args, **kwargs)
            except Exception:
                conn.send(("error", f"rank {ctx.rank}: {traceback.format_exc()}"))
            else:
                conn.send(("ok", result))
        elif kind == "shutdown":
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel command {kind!r}")
