"""A ModelRunner that runs one model over a tensor-parallel group, from rank 0.

Rank 0 keeps the scheduler and its own shard's ``ModelRunner``; each ``execute`` first sends
the step's delta (``engine.parallel.channel``) to the workers, then runs the same forward
here; logits are gathered on every rank, and only rank 0 samples. Block ids are decided on
rank 0 and mean the same block on every rank (each rank's KV cache has the same number of
blocks, its own KV heads).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner, SampledToken, resolve_device
from engine.parallel.channel import StepEncoder
from engine.parallel.launcher import WorkerGroup
from engine.parallel.sharding import check_shardable
from engine.parallel.worker import drop_runner, load_runner
from engine.scheduler import SchedulerOutput


class TensorParallelRunner:
    """Presents ``ModelRunner``'s surface (``execute``, ``num_blocks``, ``hf_config``, ...);
    attributes it does not define are rank 0's runner's."""

    def __init__(self, group: WorkerGroup, key: str, local: ModelRunner, owns_group: bool) -> None:
        self.group = group
        self.key = key
        self.local = local
        self.owns_group = owns_group
        self.encoder = StepEncoder(key)

    @classmethod
    def load(
        cls,
        group: WorkerGroup,
        config: EngineConfig,
        kv_cache: torch.Tensor | None = None,
        *,
        key: str | None = None,
        owns_group: bool = False,
    ) -> TensorParallelRunner:
        """Load ``config.model`` on every rank of ``group`` (each its own slice)."""
        hf_config = _hf_config(config.model)
        check_shardable(hf_config, group.world_size)
        key = key if key is not None else group.new_key()
        group.run_on_all_ranks(
            load_runner, key, replace(config), local_kwargs={"kv_cache": kv_cache}
        )
        return cls(group, key, group.ctx.runners[key], owns_group)

    @property
    def hf_config(self) -> Any:
        return self.local.hf_config

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def __getattr__(self, name: str) -> Any:
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    def execute(
        self, out: SchedulerOutput, generators: dict[str, torch.Generator]
    ) -> list[SampledToken]:
        if out.is_empty:
            return []
        self.group.broadcast_step(self.encoder.encode(out))
        try:
            return self.local.execute(out, generators)
        except RuntimeError as exc:
            self.group.fail(exc, "step failed")
            raise

    def shutdown(self) -> None:
        """Stop the workers if this runner started them, else free this model on all ranks."""
        if self.owns_group:
            self.group.shutdown()
        elif self.group.is_alive:
            self.group.run_on_all_ranks(drop_runner, self.key)


def start_tensor_parallel(
    config: EngineConfig, kv_cache: torch.Tensor | None = None
) -> TensorParallelRunner:
    """Check the model shards over ``config.tensor_parallel_size`` ranks, start the workers
    and load the model on all of them; the returned runner owns (and stops) the group."""
    hf_config = _hf_config(config.model)
    check_shardable(hf_config, config.tensor_parallel_size)
    group = WorkerGroup.start(
        config.tensor_parallel_size,
        device=resolve_device(config.device),
        address=config.distributed_address,
        port=config.distributed_port,
        timeout_s=config.distributed_timeout_s,
    )
    try:
        return TensorParallelRunner.load(group, config, kv_cache, owns_group=True)
    except BaseException:
        group.shutdown()
        raise


def _hf_config(model: str | Path) -> Any:
    from transformers import AutoConfig

    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {str(path)!r}")
    return AutoConfig.from_pretrained(path)
