"""Tiny modules shared by the substrate tests (imported as a plain module)."""

from __future__ import annotations

import torch
from torch import nn


class TinyLM(nn.Module):
    """Embedding -> linear -> norm -> tied head; has a buffer so layouts include one."""

    def __init__(
        self, vocab: int = 32, hidden: int = 16, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.norm = nn.LayerNorm(hidden, dtype=dtype)
        self.head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((hidden,), 0.5, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(self.embed(ids))) * self.scale)


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied once) and buffers, by the names a WeightLayout uses."""
    out = {name: p.detach().clone() for name, p in module.named_parameters()}
    out.update({name: b.detach().clone() for name, b in module.named_buffers()})
    return out
