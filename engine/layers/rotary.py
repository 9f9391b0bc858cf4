"""Rotary position embedding (NeoX / Llama "rotate half" layout).

Supported ``rope_type``: "default" (no scaling), "linear" (positions divided by ``factor``)
and "llama3" (Llama 3.1 frequency-dependent scaling). Anything else raises at build time.
cos/sin are computed once per forward pass from the batch's positions (no precomputed table,
so there is no maximum position and the result matches the reference bit for bit in float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)


def rope_config_from_hf(hf_config: Any) -> RopeConfig:
    """Read RoPE settings from a transformers config (5.x ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` attributes)."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)), rope_type=rope_type, params=params
    )


def _inv_freq(head_dim: int, cfg: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (
        cfg.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if cfg.rope_type == "linear":
        return inv_freq / float(cfg.params["factor"])
    if cfg.rope_type == "llama3":
        factor = float(cfg.params["factor"])
        low = float(cfg.params["low_freq_factor"])
        high = float(cfg.params["high_freq_factor"])
        old_len = float(cfg.params["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """``cos_sin`` once per forward pass, then ``apply_rotary`` in every layer."""

    def __init__(self, head_dim: int, cfg: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", _inv_freq(head_dim, cfg), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 tables ``[n, 1, head_dim]`` for ``positions`` ``[n]``: ``cat(cos, cos)``
        and ``cat(-sin, sin)`` (the sign of ``rotate_half`` folded in)."""
        inv_freq = self.inv_freq.to(device=positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        cos_table = torch.cat((cos, cos), dim=-1).unsqueeze(1)
        signed_sin_table = torch.cat((-sin, sin), dim=-1).unsqueeze(1)
        return cos_table, signed_sin_table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[n, heads, d]`` in the "rotate half" layout with ``cos_sin``'s tables:
    ``x * cos + swap_halves(x) * signed_sin``, the same float32 products and sums as
    ``x * cos + rotate_half(x) * sin``."""
    h = x.float()
    n, heads, d = h.shape
    swapped = h.reshape(n, heads, 2, d // 2).flip(2).view(n, heads, d)
    return (h * cos + swapped * signed_sin).to(x.dtype)
