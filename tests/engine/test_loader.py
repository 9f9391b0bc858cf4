"""Checkpoint loading: errors name the problem; sharded, tied, fused-expert and TP-sliced
checkpoints load the right values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.attention.torch_paged import TorchPagedAttention
from engine.models.loader import load_checkpoint
from engine.models.registry import build_model
from engine.models.tiny import write_random_checkpoint
from engine.parallel_context import SINGLE, ParallelContext


def _build(path: Path, parallel: ParallelContext = SINGLE) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(path)
    return build_model(config, torch.float32, parallel, TorchPagedAttention())


def _loaded(path: Path, parallel: ParallelContext = SINGLE) -> torch.nn.Module:
    model = _build(path, parallel)
    load_checkpoint(model, path)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("llama") / "m", "llama", seed=2)


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir(parents=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_unknown_architecture_raises(llama: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(llama)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(
        ValueError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen3MoeForCausalLM"
    ):
        build_model(config, torch.float32, SINGLE, TorchPagedAttention())


def test_missing_tensor_raises(llama: Path, tmp_path: Path) -> None:
    tensors = load_file(str(llama / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    path = _rewrite(llama, tmp_path / "m", tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight.*'k'"):
        _loaded(path)


def test_missing_plain_tensor_raises(llama: Path, tmp_path: Path) -> None:
    tensors = load_file(str(llama / "model.safetensors"))
    del tensors["model.norm.weight"]
    path = _rewrite(llama, tmp_path / "m", tensors)
    with pytest.raises(
        ValueError, match=r"lacks a tensor for model parameter 'model\.norm\.weight'"
    ):
        _loaded(path)


def test_misshaped_tensor_raises(llama: Path, tmp_path: Path) -> None:
    tensors = load_file(str(llama / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 100)
    path = _rewrite(llama, tmp_path / "m", tensors)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*\(64, 100\).*128"
    ):
        _loaded(path)


def test_unknown_name_raises_but_inv_freq_is_ignored(llama: Path, tmp_path: Path) -> None:
    tensors = load_file(str(llama / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    _loaded(_rewrite(llama, tmp_path / "ok", tensors))
    tensors["model.layers.0.self_attn.mystery.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.mystery\.weight'"):
        _loaded(_rewrite(llama, tmp_path / "bad", tensors))


def test_sharded_checkpoint_with_index_loads(llama: Path, tmp_path: Path) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = _loaded(llama), _loaded(sharded)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=0, rtol=0, msg=name)


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "q", "qwen3", seed=0)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    model = _loaded(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ckpt = load_file(str(path / "model.safetensors"))
    torch.testing.assert_close(model.model.embed_tokens.weight, ckpt["model.embed_tokens.weight"])
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(
        model.compute_logits(hidden), hidden @ ckpt["model.embed_tokens.weight"].T
    )


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_expert_tensors_load_like_per_expert(arch: str, tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / arch, arch, seed=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    fused_path = _rewrite(path, tmp_path / "fused", fused)
    a, b = _loaded(path), _loaded(fused_path)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=0, rtol=0, msg=name)


def test_tensor_parallel_ranks_load_their_slices(tmp_path: Path) -> None:
    # 4 query heads, 2 KV heads, head_dim 16: at TP=4 each KV head is replicated on two ranks.
    path = write_random_checkpoint(tmp_path / "m", "qwen3_moe", seed=0)
    ckpt = load_file(str(path / "model.safetensors"))
    q = ckpt["model.layers.0.self_attn.q_proj.weight"]
    k = ckpt["model.layers.0.self_attn.k_proj.weight"]
    down = ckpt["model.layers.0.mlp.experts.2.down_proj.weight"]
    up = ckpt["model.layers.0.mlp.experts.2.up_proj.weight"]
    embed = ckpt["model.embed_tokens.weight"]
    for rank in range(4):
        model = _loaded(path, ParallelContext(rank=rank, world_size=4))
        assert model.kv_cache_spec() == (2, 1, 16)
        qkv = model.model.layers[0].self_attn.qkv_proj.weight
        torch.testing.assert_close(qkv[:16], q[rank * 16 : (rank + 1) * 16])
        kv_head = rank // 2
        torch.testing.assert_close(qkv[16:32], k[kv_head * 16 : (kv_head + 1) * 16])
        experts = model.model.layers[0].mlp.experts
        torch.testing.assert_close(experts.w13[2, 16:32], up[rank * 16 : (rank + 1) * 16])
        torch.testing.assert_close(experts.w2[2], down[:, rank * 16 : (rank + 1) * 16])
        torch.testing.assert_close(
            model.model.embed_tokens.weight, embed[rank * 128 : (rank + 1) * 128]
        )


def test_sharding_preconditions_raise(llama: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(llama)
    with pytest.raises(
        ValueError,
        match=r"attention heads \(4\) must be divisible by the tensor-parallel size \(3\)",
    ):
        build_model(
            config, torch.float32, ParallelContext(rank=0, world_size=3), TorchPagedAttention()
        )


def test_unsupported_rope_type_raises(llama: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(llama)
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=r"unsupported rope scaling type 'yarn'"):
        build_model(config, torch.float32, SINGLE, TorchPagedAttention())


def test_same_seed_same_weight_bytes(tmp_path: Path) -> None:
    a = write_random_checkpoint(tmp_path / "a", "mixtral", seed=5)
    b = write_random_checkpoint(tmp_path / "b", "mixtral", seed=5)
    c = write_random_checkpoint(tmp_path / "c", "mixtral", seed=6)
    read = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b)
    assert read(a) != read(c)
