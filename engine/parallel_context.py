"""Tensor-parallel context, passed explicitly to every parallel layer.

At world_size 1 every collective is the identity, so the same layers serve TP=1 and TP=N.
Each context carries a ``CollectiveTimer``, off unless a benchmark turns it on: then every
collective is timed (on a GPU, to its completion), so the per-layer cost of TP is visible.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CollectiveTimer:
    """Calls and seconds per kind of collective, counted while ``enabled``."""

    enabled: bool = False
    totals: dict[str, list[float]] = field(default_factory=dict)  # kind -> [calls, seconds]

    def read(self, reset: bool = False) -> dict[str, list[float]]:
        out = {k: list(v) for k, v in self.totals.items()}
        if reset:
            self.totals.clear()
        return out

    def add(self, kind: str, seconds: float) -> None:
        acc = self.totals.setdefault(kind, [0.0, 0.0])
        acc[0] += 1
        acc[1] += seconds


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    timer: CollectiveTimer = field(default_factory=CollectiveTimer, compare=False)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            start = time.perf_counter() if self.timer.enabled else 0.0
            dist.all_reduce(tensor, group=self.group)
            if self.timer.enabled:
                self._timed("all_reduce", tensor, start)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's shard along the last dimension (on every rank)."""
        if self.world_size == 1:
            return tensor
        start = time.perf_counter() if self.timer.enabled else 0.0
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        if self.timer.enabled:
            self._timed("all_gather_last_dim", tensor, start)
        return torch.cat(parts, dim=-1)

    def _timed(self, kind: str, tensor: torch.Tensor, start: float) -> None:
        if tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)
        self.timer.add(kind, time.perf_counter() - start)


SINGLE = ParallelContext()
