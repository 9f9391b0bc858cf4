"""Linear layers that hold one tensor-parallel shard each and load their own slice.

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``: it is given
the *full* checkpoint tensor and copies the part this rank owns. Column-parallel layers
shard the output dimension (dim 0 of the weight), row-parallel ones the input dimension
(dim 1). Merged layers (gate_up, qkv) hold several checkpoint tensors side by side in dim 0
and are loaded once per ``shard_id``. At world_size 1 every shard is the whole tensor.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel_context import ParallelContext


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, raising ValueError when it does not divide evenly."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by the tensor-parallel size ({denominator})"
        )
    return numerator // denominator


def copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``param`` (any device/dtype), raising on a shape mismatch."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch: parameter expects {tuple(param.shape)}, "
            f"checkpoint slice has {tuple(loaded.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded.to(dtype=param.dtype))


def shard_dim(loaded: torch.Tensor, dim: int, full: int, rank: int, size: int) -> torch.Tensor:
    """Rank's slice of ``loaded`` along ``dim``, after checking the full size is ``full``."""
    if loaded.dim() <= dim or loaded.shape[dim] != full:
        raise ValueError(
            f"shape mismatch: expected size {full} in dim {dim}, checkpoint tensor has "
            f"{tuple(loaded.shape)}"
        )
    return loaded.narrow(dim, rank * size, size)


def _new_param(shape: Sequence[int], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LinearBase(nn.Module, abc.ABC):
    """``y = x W^T (+ b)`` with a weight of shape ``[out_local, in_local]``."""

    def __init__(
        self,
        in_local: int,
        out_local: int,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.in_local = in_local
        self.out_local = out_local
        self.weight = _new_param((out_local, in_local), dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias: nn.Parameter | None = _new_param((out_local,), dtype)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    @abc.abstractmethod
    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Copy this rank's slice of ``loaded_weight`` (the full checkpoint tensor) into
        ``param``; ``shard_id`` names the part of a merged parameter (q/k/v, gate/up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (e.g. the MoE router)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(in_features, out_features, bias, parallel, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        copy_checked(param, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays sharded unless gathered."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
        gather_output: bool = False,
    ) -> None:
        out_local = divide(out_features, parallel.world_size, "output features")
        super().__init__(in_features, out_local, bias, parallel, dtype)
        self.out_features = out_features
        self.gather_output = gather_output

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        rank = self.parallel.rank
        copy_checked(param, shard_dim(loaded_weight, 0, self.out_features, rank, self.out_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return self.parallel.all_gather_last_dim(y) if self.gather_output else y


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs side by side (gate_up: ``output_sizes=[I, I]``).

    Each rank holds ``[shard_0 slice, shard_1 slice, ...]``; ``shard_id`` is the index of the
    checkpoint tensor in ``output_sizes``.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        ws = parallel.world_size
        self.output_sizes = list(output_sizes)
        self.local_sizes = [divide(s, ws, "merged output features") for s in output_sizes]
        super().__init__(in_features, sum(self.local_sizes), bias, parallel, dtype)
        self.weight.required_shards = frozenset(range(len(output_sizes)))  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.required_shards = frozenset(range(len(output_sizes)))  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"merged linear needs a shard id in 0..{len(self.output_sizes) - 1}, got {shard_id!r}"
            )
        local = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        src = shard_dim(loaded_weight, 0, self.output_sizes[shard_id], self.parallel.rank, local)
        copy_checked(param.data.narrow(0, offset, local), src)


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection. Query heads are split across ranks; KV heads are split when
    there are at least as many as ranks, otherwise each KV head is replicated on
    ``world_size / num_kv_heads`` consecutive ranks (rank r holds head
    ``r * num_kv_heads // world_size``)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        ws = parallel.world_size
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_local_heads = divide(num_heads, ws, "number of attention heads")
        if num_kv_heads >= ws:
            self.num_local_kv_heads = divide(num_kv_heads, ws, "number of KV heads")
            self.kv_head_start = parallel.rank * self.num_local_kv_heads
        else:
            if ws % num_kv_heads != 0:
                raise ValueError(
                    f"tensor-parallel size ({ws}) must be a multiple of the number of KV heads "
                    f"({num_kv_heads}) to replicate them"
                )
            self.num_local_kv_heads = 1
            self.kv_head_start = parallel.rank * num_kv_heads // ws
        self.q_size = self.num_local_heads * head_dim
        self.kv_size = self.num_local_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, parallel, dtype)
        self.weight.required_shards = frozenset({"q", "k", "v"})  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.required_shards = frozenset({"q", "k", "v"})  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        d = self.head_dim
        if shard_id == "q":
            src = shard_dim(loaded_weight, 0, self.num_heads * d, self.parallel.rank, self.q_size)
            offset, size = 0, self.q_size
        elif shard_id in ("k", "v"):
            full = self.num_kv_heads * d
            if loaded_weight.dim() == 0 or loaded_weight.shape[0] != full:
                raise ValueError(
                    f"shape mismatch: expected size {full} in dim 0, checkpoint tensor has "
                    f"{tuple(loaded_weight.shape)}"
                )
            src = loaded_weight.narrow(0, self.kv_head_start * d, self.kv_size)
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size = self.kv_size
        else:
            raise ValueError(f"QKV linear needs shard id 'q', 'k' or 'v', got {shard_id!r}")
        copy_checked(param.data.narrow(0, offset, size), src)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed by one all-reduce
    (unless ``reduce_results`` is False, when the caller reduces). The bias is counted once:
    after the reduction, or on rank 0 only when the caller reduces."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
        reduce_results: bool = True,
    ) -> None:
        in_local = divide(in_features, parallel.world_size, "input features")
        super().__init__(in_local, out_features, bias, parallel, dtype)
        self.in_features = in_features
        self.reduce_results = reduce_results

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if param is self.bias:
            copy_checked(param, loaded_weight)
            return
        if loaded_weight.dim() != 2:
            raise ValueError(
                f"shape mismatch: expected a 2-D weight, checkpoint tensor has {tuple(loaded_weight.shape)}"
            )
        src = shard_dim(loaded_weight, 1, self.in_features, self.parallel.rank, self.in_local)
        copy_checked(param, src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce_results:
            y = self.parallel.all_reduce(y)
        if self.bias is not None and (self.reduce_results or self.parallel.rank == 0):
            y = y + self.bias
        return y
