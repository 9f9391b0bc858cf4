"""One decoder-only transformer for Llama, Qwen2, Qwen3 (dense) and Qwen3-MoE, Mixtral.

Options from ``DecoderSpec``: q/k/v (and o) bias, per-head q/k RMSNorm, GQA, RoPE scaling,
tied embeddings, and a sparse-MoE MLP on the layers that have one. Parameter names follow
the Hugging Face layout with merged projections (``self_attn.qkv_proj``, ``mlp.gate_up_proj``,
``mlp.experts.w13`` / ``w2``, ``mlp.gate``), so the loader maps checkpoint names directly.

The KV cache is one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``;
layer l reads and writes ``kv_cache[l]``. Per-step work shared by every layer (the rotary
tables, the attention backend's ``prepare``) runs once per forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.layers.activation import SiluAndMul
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.moe import SparseMoE
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.decoder_spec import DecoderSpec
from engine.parallel_context import ParallelContext


class Attention(nn.Module):
    def __init__(
        self,
        index: int,
        spec: DecoderSpec,
        parallel: ParallelContext,
        dtype: torch.dtype,
        backend: object,
    ) -> None:
        super().__init__()
        self.index = index
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size,
            spec.head_dim,
            spec.num_heads,
            spec.num_kv_heads,
            spec.qkv_bias,
            parallel,
            dtype,
        )
        self.o_proj = RowParallelLinear(
            spec.num_heads * spec.head_dim, spec.hidden_size, spec.o_bias, parallel, dtype
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        if spec.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
            self.k_norm: RMSNorm | None = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.backend = backend

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        n, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(n, heads + 2 * kv_heads, d)
        qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        qk = apply_rotary(qk, *rotary)  # q and k heads together: one pass
        q, k = qk[:, :heads], qk[:, heads:]
        out = self.backend.forward(q, k, v, kv_cache, attn, self.scale, self.index)  # type: ignore[attr-defined]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class DenseMLP(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, parallel: ParallelContext, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], False, parallel, dtype
        )
        self.down_proj = RowParallelLinear(intermediate, hidden, False, parallel, dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        index: int,
        spec: DecoderSpec,
        parallel: ParallelContext,
        dtype: torch.dtype,
        backend: object,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(index, spec, parallel, dtype, backend)
        self.mlp: nn.Module
        if spec.moe is not None and index in spec.moe.sparse_layers:
            m = spec.moe
            self.mlp = SparseMoE(
                m.num_experts,
                m.top_k,
                spec.hidden_size,
                m.intermediate_size,
                m.renormalize,
                parallel,
                dtype,
            )
        else:
            self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size, parallel, dtype)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],
        h: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        h = h + self.self_attn(rotary, self.input_layernorm(h), attn, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(
        self, spec: DecoderSpec, parallel: ParallelContext, dtype: torch.dtype, backend: object
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            spec.vocab_size, spec.hidden_size, parallel, dtype
        )
        self.layers = nn.ModuleList(
            DecoderLayer(i, spec, parallel, dtype, backend) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    """``forward`` -> final hidden states; ``compute_logits`` -> full-vocab float32 logits."""

    def __init__(
        self, spec: DecoderSpec, parallel: ParallelContext, dtype: torch.dtype, backend: object
    ) -> None:
        super().__init__()
        self.spec = spec
        self.parallel = parallel
        self.model = DecoderModel(spec, parallel, dtype, backend)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope)
        self.attn_backend = backend
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, parallel, dtype)
        if spec.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @property
    def num_local_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads  # type: ignore[union-attr]

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(num_layers, num_local_kv_heads, head_dim) for allocating the paged cache."""
        return self.spec.num_layers, self.num_local_kv_heads, self.spec.head_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``."""
        num_layers, kv_heads, head_dim = self.kv_cache_spec()
        return (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states of the step's tokens; ``before_layer(i)``, when given, runs before
        layer ``i`` reads or writes ``kv_cache[i]`` (a layer-wise KV restore)."""
        num_layers, kv_heads, head_dim = self.kv_cache_spec()
        if (
            kv_cache.dim() != 6
            or kv_cache.shape[:2] != (num_layers, 2)
            or kv_cache.shape[4:] != (kv_heads, head_dim)
        ):
            raise ValueError(
                f"expected a KV cache [{num_layers}, 2, blocks, block_size, {kv_heads}, "
                f"{head_dim}], got {tuple(kv_cache.shape)}"
            )
        if input_ids.shape != positions.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} differ in shape"
            )
        attn = self.attn_backend.prepare(attn)  # type: ignore[attr-defined]
        rotary = self.rotary.cos_sin(positions)
        h = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            if before_layer is not None:
                before_layer(i)
            h = layer(rotary, h, attn, kv_cache[i])
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
