"""Gated activation: ``silu(gate) * up`` on a merged ``[gate | up]`` projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def check_activation(hidden_act: str) -> None:
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r}: only 'silu' is implemented")
