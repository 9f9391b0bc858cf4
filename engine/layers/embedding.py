"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of the world size and split into contiguous
ranges, one per rank. The embedding looks up the ids of its range, zeros the others and
all-reduces; the LM head computes logits for its range and all-gathers them, then drops
the padding so callers always see the full vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import copy_checked
from engine.parallel_context import ParallelContext


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, parallel: ParallelContext, dtype: torch.dtype
    ) -> None:
        super().__init__()
        ws = parallel.world_size
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.padded_vocab_size = -(-vocab_size // ws) * ws
        self.vocab_per_rank = self.padded_vocab_size // ws
        self.vocab_start = parallel.rank * self.vocab_per_rank
        self.vocab_end = self.vocab_start + self.vocab_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.vocab_per_rank, hidden_size, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if loaded_weight.dim() != 2 or loaded_weight.shape[0] != self.vocab_size:
            raise ValueError(
                f"shape mismatch: expected [{self.vocab_size}, {param.shape[1]}], checkpoint "
                f"tensor has {tuple(loaded_weight.shape)}"
            )
        end = min(self.vocab_end, self.vocab_size)
        rows = max(0, end - self.vocab_start)
        with torch.no_grad():
            param.zero_()
        copy_checked(param.data[:rows], loaded_weight[self.vocab_start : self.vocab_start + rows])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.is_parallel:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight)
        out = out * in_range.unsqueeze(-1).to(out.dtype)
        return self.parallel.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Same sharding as the embedding, so a tied head can share its parameter."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits ``[n, vocab_size]`` on every rank."""
        logits = F.linear(hidden, self.weight)
        logits = self.parallel.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size].float()
