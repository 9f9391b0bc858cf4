"""Engine models match transformers on the same random weights: prefill, chunked prefill
with cached context, and decode steps reading the paged cache, batched together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from helpers import Step, ToyBlocks, allocate_kv_cache, batch_inputs

from engine.attention.torch_paged import TorchPagedAttention
from engine.models.loader import load_checkpoint
from engine.models.registry import build_model
from engine.models.tiny import write_random_checkpoint
from engine.parallel_context import SINGLE

ATOL = 1e-4
BLOCK_SIZE = 4

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
        },
    ),
    "qwen2-rope-linear": ("qwen2", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-sparse-step": (
        "qwen3_moe",
        {
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "num_hidden_layers": 3,
        },
    ),
    "mixtral": ("mixtral", {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        name: write_random_checkpoint(root / name, arch, seed=1, initializer_range=0.1, **over)
        for name, (arch, over) in CASES.items()
    }


@torch.no_grad()
def test_rope_scaling_reaches_config(checkpoints: dict[str, Path]) -> None:
    cfg = transformers.AutoConfig.from_pretrained(checkpoints["llama-rope-llama3"])
    assert cfg.rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_engine_matches_transformers(case: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[case]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = transformers.AutoConfig.from_pretrained(path)
    model = build_model(config, torch.float32, SINGLE, TorchPagedAttention())
    load_checkpoint(model, path)

    num_layers, kv_heads, head_dim = model.kv_cache_spec()
    assert (num_layers, kv_heads, head_dim) == (
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.hidden_size // config.num_attention_heads,
    )
    kv = allocate_kv_cache(num_layers, 32, BLOCK_SIZE, kv_heads, head_dim)
    blocks = ToyBlocks(32, BLOCK_SIZE, seed=3)

    gen = torch.Generator().manual_seed(7)
    seq_a = torch.randint(
        3, config.vocab_size, (13,), generator=gen
    ).tolist()  # 11 prompt + 2 decodes
    seq_b = torch.randint(
        3, config.vocab_size, (12,), generator=gen
    ).tolist()  # 6 + 5 chunks + 1 decode
    ref_a = hf(torch.tensor([seq_a])).logits[0]
    ref_b = hf(torch.tensor([seq_b])).logits[0]

    # step 1: A prefills its whole prompt, B its first chunk
    # step 2: A decodes, B prefills the rest of its prompt on top of 6 cached tokens
    # step 3: both decode
    schedule = [
        [Step(0, seq_a[:11], 0), Step(1, seq_b[:6], 0)],
        [Step(0, seq_a[11:12], 11), Step(1, seq_b[6:11], 6)],
        [Step(0, seq_a[12:13], 12), Step(1, seq_b[11:12], 11)],
    ]
    refs = {0: ref_a, 1: ref_b}
    for steps in schedule:
        ids, positions, meta, rows = batch_inputs(steps, blocks)
        logits = model.compute_logits(model(ids, positions, meta, kv))
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), config.vocab_size)
        for st, row in zip(steps, rows, strict=True):
            expected = refs[st.seq][st.num_cached : st.num_cached + len(st.token_ids)]
            torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=0)


def test_logits_are_not_trivial(checkpoints: dict[str, Path]) -> None:
    """Guard for the comparison above: the random models' logits vary well beyond ATOL."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"]).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([[5, 6, 7, 8]])).logits[0]
    assert logits.std().item() > 100 * ATOL
