"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE).

Routing: softmax over all experts in float32, take the top-k, and renormalise the top-k
weights to sum to 1 when ``renormalize`` (Mixtral always; Qwen3-MoE when
``norm_topk_prob``). Mixtral's "softmax over the top-k logits" is the same quantity.

Tensor parallelism: the router is replicated; every expert's gate/up projection is split
along the intermediate dimension (column-parallel) and its down projection along the same
dimension (row-parallel), so each rank computes a partial sum for every routed token and one
all-reduce per layer completes it.

Two equivalent paths: batches of up to ``dense_max_tokens`` tokens (decode steps) run every
expert on every token and weight the results by the routing, zero for experts a token did
not pick: fixed shapes and no host synchronisation, so a CUDA graph can capture it. Larger
batches run each picked expert on its tokens only, which needs the list of picked experts on
the host (one synchronisation per layer).

Weights: ``w13`` is ``[E, 2 * I_local, H]`` (gate rows then up rows), ``w2`` is
``[E, H, I_local]``. The loader accepts per-expert tensors (``shard_id=(e, "gate"|"up"|"down")``)
or transformers' fused 3-D tensors (``shard_id="gate_up"`` with ``[E, 2I, H]``,
``shard_id="down"`` with ``[E, H, I]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import ReplicatedLinear, copy_checked, divide
from engine.parallel_context import ParallelContext

# Batches of up to this many tokens take the dense path (every expert on every token).
DENSE_MAX_TOKENS = 64


class SparseMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
        dense_max_tokens: int = DENSE_MAX_TOKENS,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(
                f"experts per token ({top_k}) must be in 1..num_experts ({num_experts})"
            )
        self.parallel = parallel
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.dense_max_tokens = dense_max_tokens
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.local_intermediate = divide(
            intermediate_size, parallel.world_size, "MoE intermediate size"
        )
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, parallel, dtype)
        self.experts = _Experts(num_experts, hidden_size, self.local_intermediate, dtype)
        expert_ids = range(num_experts)
        self.experts.w13.required_shards = (  # type: ignore[attr-defined]
            frozenset((e, s) for e in expert_ids for s in ("gate", "up")),
            frozenset({"gate_up"}),
        )
        self.experts.w2.required_shards = (  # type: ignore[attr-defined]
            frozenset((e, "down") for e in expert_ids),
            frozenset({"down"}),
        )
        self.experts.w13.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.experts.w2.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        full, local = self.intermediate_size, self.local_intermediate
        start = self.parallel.rank * local
        if shard_id == "gate_up":
            self._check(loaded_weight, (self.num_experts, 2 * full, self.hidden_size))
            gate = loaded_weight[:, start : start + local]
            up = loaded_weight[:, full + start : full + start + local]
            copy_checked(param.data, torch.cat((gate, up), dim=1))
            return
        if shard_id == "down":
            self._check(loaded_weight, (self.num_experts, self.hidden_size, full))
            copy_checked(param.data, loaded_weight[:, :, start : start + local])
            return
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2):
            raise ValueError(f"MoE expert weight needs shard id (expert, part), got {shard_id!r}")
        expert, part = shard_id
        if not (isinstance(expert, int) and 0 <= expert < self.num_experts):
            raise ValueError(f"expert index {expert!r} out of range 0..{self.num_experts - 1}")
        if part in ("gate", "up"):
            self._check(loaded_weight, (full, self.hidden_size))
            offset = 0 if part == "gate" else local
            copy_checked(
                param.data[expert, offset : offset + local], loaded_weight[start : start + local]
            )
        elif part == "down":
            self._check(loaded_weight, (self.hidden_size, full))
            copy_checked(param.data[expert], loaded_weight[:, start : start + local])
        else:
            raise ValueError(f"unknown MoE expert part {part!r}")

    @staticmethod
    def _check(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"shape mismatch: expected {expected}, checkpoint tensor has {tuple(loaded.shape)}"
            )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids ``[n, k]`` and their weights ``[n, k]`` (float32)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        if x.shape[0] <= self.dense_max_tokens:
            out = self._dense(x, ids, weights)
        else:
            out = self._sparse(x, ids, weights)
        return self.parallel.all_reduce(out.to(x.dtype))

    def _dense(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by the routing (float32 ``[n, H]``)."""
        local = self.local_intermediate
        routing = torch.zeros(x.shape[0], self.num_experts, dtype=torch.float32, device=x.device)
        routing.scatter_(1, ids, weights)
        h = torch.matmul(x, self.experts.w13.transpose(1, 2))  # [E, n, 2 * I_local]
        h = F.silu(h[..., :local]) * h[..., local:]
        y = torch.bmm(h, self.experts.w2.transpose(1, 2))  # [E, n, H]
        return (y.float() * routing.t()[:, :, None]).sum(0)

    def _sparse(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each picked expert on its tokens only (float32 ``[n, H]``)."""
        out = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)
        w13, w2, local = self.experts.w13, self.experts.w2, self.local_intermediate
        for expert in torch.unique(ids).tolist():
            token_idx, slot = torch.where(ids == expert)
            h = F.linear(x[token_idx], w13[expert])
            h = F.silu(h[:, :local]) * h[:, local:]
            h = F.linear(h, w2[expert])
            out.index_add_(0, token_idx, h.float() * weights[token_idx, slot, None])
        return out


class _Experts(nn.Module):
    def __init__(
        self, num_experts: int, hidden: int, local_intermediate: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * local_intermediate, hidden, dtype=dtype),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden, local_intermediate, dtype=dtype), requires_grad=False
        )
