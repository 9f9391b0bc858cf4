"""Attention backends over the paged KV cache: the pure-torch one (any device; the oracle),
flash-attn (CUDA, when importable), the per-step metadata they share, and the selector.

May import: ``engine.attention`` itself only (and torch / flash_attn).
"""
