"""The simulator's GPU physics against a real GPU: the live engine's step times on this
device against the cost model's prediction for the same work with a server preset (default
``h200x8``, the physics every simulated row of ``make replay`` runs on), at TP=1.

The model is a random checkpoint shaped like Llama-3.2-1B (16 layers, hidden 2048, 32 query
and 8 KV heads, vocabulary 32000), served in bfloat16 (weights, KV and activations: the
prediction prices the same dtypes). The grid: prefill chunks of 128 to 4096 tokens (and 1024
after 4096 cached), decode batches of 1 to 64 sequences at contexts of 512 and 4096 tokens.
Each prediction prices the work its timed step ran (``talaria.bench.step_points``), on the
wall clock (a step waits for its kernels when it reads the sampled tokens).

What a gap means: the preset models a tuned engine (vLLM-class kernels: FlashAttention,
CUDA graphs for decode); the live engine here runs its pure-torch paged attention eagerly
unless flash-attn is importable. A measured step slower than predicted is the live engine's
distance from that engine, or the preset's optimism; the terms printed beside the worst
points say which part of the prediction dominates.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from engine.sim.model_spec import ModelSpec
from substrate.devices import server_preset
from talaria.bench.step_fidelity import Case, PointResult, price
from talaria.bench.step_points import StepPoint, measure_steps

__all__ = ["LLAMA_1B_SHAPE", "device_cases", "run_device_steps"]

LLAMA_1B_SHAPE = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192,
    tie_word_embeddings=True, initializer_range=0.02,
)
PREFILL = ((128, 0), (512, 0), (2048, 0), (4096, 0), (1024, 4096))
DECODE = ((1, 512), (8, 512), (64, 512), (1, 4096), (8, 4096), (64, 4096))


def device_cases(prefill: tuple[tuple[int, int], ...] = PREFILL,
                 decode: tuple[tuple[int, int], ...] = DECODE) -> list[Case]:
    points = [StepPoint("prefill", n, c) for n, c in prefill]
    points += [StepPoint("decode", b, c) for b, c in decode]
    return [Case("device", "llama-1b-shape", 1, tuple(points))]


def write_llama_1b_shape(directory: Path, **overrides: int) -> Path:
    """The random Llama-3.2-1B-shaped checkpoint (fp32 on disk), written once."""
    from engine.models.tiny import write_random_checkpoint

    path = directory / "llama-1b-shape"
    if not (path / "config.json").is_file():
        write_random_checkpoint(path, "llama", seed=0, **{**LLAMA_1B_SHAPE, **overrides})
    return path


def run_device_steps(
    model_dir: Path, cases: list[Case], *, device: str = "cuda", dtype: str = "bfloat16",
    server: str = "h200x8", repeats: int = 5,
) -> list[PointResult]:
    """Measure every case's points on ``device`` in ``dtype`` and price them on ``server``;
    the spec is the checkpoint's own shape served in ``dtype`` throughout."""
    spec_server = server_preset(server)
    out: list[PointResult] = []
    for case in cases:
        measured = measure_steps(model_dir, case.points, tp=case.tp, repeats=repeats,
                                 device=device, dtype=dtype)
        spec = dataclasses.replace(ModelSpec.from_hf_config(model_dir, case.model),
                                   weight_dtype=dtype, kv_dtype=dtype, activation_dtype=dtype)
        out.extend(price(case, spec, measured, spec_server))
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out
