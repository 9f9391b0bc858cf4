"""Micro-benchmark of a model switch's byte movement on this machine's device.

Times, for one shard of ``nbytes``: host store -> weight region (H2D, pinned on CUDA),
host -> staging region (the background stage), staging -> weight region (D2D), and, for
reference, a plain ``torch`` copy of the same size between preallocated tensors (the bar the
substrate's copies are held to: ratio >= 0.8) and the same copy into a fresh device
allocation (what an engine without an arena does on every switch). Each is the best of
``repeats``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import orjson
import torch

from substrate.arena import DeviceArena
from substrate.mover import TorchMover, synchronize
from substrate.moves import MoveRecord
from substrate.staging import Stager


def _best(records: list[MoveRecord]) -> dict[str, float]:
    best = min(records, key=lambda r: r.seconds)
    return {"seconds": best.seconds, "gb_per_s": best.bytes_per_s / 1e9}


def bench_switch(
    nbytes: int, device: torch.device | str | None = None, repeats: int = 3
) -> dict[str, object]:
    """Seconds and GB/s per kind of copy for a shard of ``nbytes`` (see module doc)."""
    if nbytes <= 0 or repeats <= 0:
        raise ValueError(f"bench_switch needs nbytes > 0 and repeats > 0, got {nbytes}, {repeats}")
    dev = torch.device(
        device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    pinned = dev.type == "cuda"
    arena = DeviceArena(dev, nbytes, nbytes, 0)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).fill_(7)
    plain_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).fill_(7)
    plain_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    mover = TorchMover(dev)
    stager = Stager(arena.staging_region)

    def stage_once() -> MoveRecord:
        stager.invalidate()
        stager.start("bench", host, nbytes)
        record = stager.wait()
        if record is None:
            raise RuntimeError("bench_switch: staging finished without a record")
        return record

    def plain_once() -> MoveRecord:
        return mover.timed("plain_copy", nbytes, lambda: plain_dst.copy_(plain_src))

    def alloc_once() -> MoveRecord:
        return mover.timed(
            "alloc_copy",
            nbytes,
            lambda: torch.empty(nbytes, dtype=torch.uint8, device=dev).copy_(plain_src),
        )

    runs: dict[str, Callable[[], MoveRecord]] = {
        "activate_h2d": lambda: mover.activate_from_host(arena.weight_region, host, nbytes),
        "stage": stage_once,
        "activate_d2d": lambda: mover.activate_from_staging(
            arena.weight_region, arena.staging_region, nbytes
        ),
        "plain_copy": plain_once,
        "alloc_copy": alloc_once,
    }
    results: dict[str, object] = {"device": str(dev), "bytes": nbytes, "pinned": pinned}
    for kind, run in runs.items():
        run()  # warm-up
        results[kind] = _best([run() for _ in range(repeats)])
    plain_rate = results["plain_copy"]["gb_per_s"]  # type: ignore[index]
    for kind in ("activate_h2d", "stage", "activate_d2d"):
        results[kind]["vs_plain_copy"] = results[kind]["gb_per_s"] / plain_rate  # type: ignore[index]
    synchronize(dev)
    if not torch.equal(arena.weight_region[:nbytes].cpu(), host):
        raise RuntimeError("bench_switch: the weight region does not hold the shard after copying")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bytes", type=int, default=256 * 2**20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    result = bench_switch(args.bytes, args.device, args.repeats)
    result["bench_seconds"] = time.perf_counter() - start
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
