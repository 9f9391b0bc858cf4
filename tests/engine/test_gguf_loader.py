"""The GGUF loader on a file written here (no package needed): a random tiny llama checkpoint
exported the way llama.cpp's converter does it (q/k rows permuted for ggml's rotary, one
tensor Q8_0-quantized, the byte-level BPE tokenizer as metadata), converted back by
``engine.models.checkpoint_cache``, must give the original tensors, config and tokenizer,
and the engine's greedy tokens on it must equal transformers' on the original."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.models.checkpoint_cache import model_dir
from engine.models.gguf_checkpoint import hf_tensor_name, unpermute_rows
from engine.models.gguf_tokenizer import END_OF_TURN_TEXTS, build_tokenizer
from engine.models.tiny import write_random_checkpoint

gguf = pytest.importorskip("gguf")

QUANTIZED = "model.layers.1.mlp.down_proj.weight"
_TO_GGUF = {"input_layernorm.weight": "attn_norm.weight",
            "post_attention_layernorm.weight": "ffn_norm.weight",
            "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
            "self_attn.v_proj.weight": "attn_v.weight",
            "self_attn.o_proj.weight": "attn_output.weight",
            "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
            "mlp.down_proj.weight": "ffn_down.weight"}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: per head, rows [2, d/2] -> [d/2, 2]."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


def write_gguf(src: Path, out: Path, stops: tuple[int, int] | None = None,
               add_eos: bool = False) -> dict[str, Any]:
    """``src`` (an HF llama directory) as llama.cpp would write it; returns its config.
    ``stops``: (end-of-turn, end-of-message) token ids; ``add_eos``: the tokenizer appends
    EOS."""
    config = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(config.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    if stops is not None:
        w.add_eot_token_id(stops[0])
        w.add_eom_token_id(stops[1])
    if add_eos:
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        data = tensor.numpy()
        if name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, heads)
        elif name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, kv_heads)
        if name == QUANTIZED:
            quant = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return config


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("gguf")
    src = write_random_checkpoint(root / "hf", "llama", seed=5, initializer_range=0.1,
                                  num_key_value_heads=2)
    config = write_gguf(src, root / "tiny.gguf")
    return src, model_dir(root / "tiny.gguf", root / "cache"), config


def test_conversion_gives_back_the_original_checkpoint(
    exported: tuple[Path, Path, dict[str, Any]],
) -> None:
    src, converted, config = exported
    original = load_file(str(src / "model.safetensors"))
    back = load_file(str(converted / "model.safetensors"))
    assert set(back) == set(original)
    for name, tensor in original.items():
        if name == QUANTIZED:  # Q8_0: 8 bits per value, one scale per 32
            torch.testing.assert_close(back[name], tensor, atol=2e-3, rtol=0)
        else:
            assert torch.equal(back[name], tensor), name
    got = json.loads((converted / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert got[key] == config[key], key


def test_tokenizer_and_greedy_tokens_match_the_original(
    exported: tuple[Path, Path, dict[str, Any]],
) -> None:
    import transformers

    from engine import LLM, SamplingParams

    src, converted, _ = exported
    ours = transformers.AutoTokenizer.from_pretrained(str(converted))
    theirs = transformers.AutoTokenizer.from_pretrained(str(src))
    for text in ("def parse_args(argv):\n    return argv", "Hello, world! 12345", "<|im_start|>x"):
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False), text
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    prompts = [theirs.encode(t, add_special_tokens=False) for t in ("def f(x):", "The agent")]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    llm = LLM(str(converted), device="cpu", kv_cache_blocks=32)
    try:
        got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    finally:
        llm.shutdown()
    with torch.inference_mode():
        for p, out in zip(prompts, got, strict=True):
            ids = torch.tensor([p])
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                min_new_tokens=8, do_sample=False, pad_token_id=0)
            assert out.token_ids == hf[0, len(p):].tolist()


def test_unpermute_inverts_llama_cpp_and_errors_name_what_is_unsupported() -> None:
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)
    with pytest.raises(ValueError, match="rows do not split into 5 heads"):
        unpermute_rows(w, 5)
    assert hf_tensor_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        hf_tensor_name("rope_freqs.weight")
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ValueError, match="pre-tokenizer 'qwen2' is not supported"):
        build_tokenizer(meta)
    with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported"):
        build_tokenizer({**meta, "tokenizer.ggml.model": "llama"})


def test_end_of_turn_and_message_ids_stop_and_add_eos_token_appends_eos(
    tmp_path: Path, exported: tuple[Path, Path, dict[str, Any]],
) -> None:
    """``tokenizer.ggml.eot_token_id`` / ``eom_token_id`` end a generation as EOS does (what
    llama.cpp's end-of-generation set holds), and ``tokenizer.ggml.add_eos_token`` makes
    the tokenizer append EOS, as llama.cpp's tokenizer does."""
    import transformers

    from engine import LLM, SamplingParams

    src, plain, config = exported
    prompt = [5, 17, 42, 9]
    llm = LLM(str(plain), device="cpu", kv_cache_blocks=32)
    try:
        free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True))[0].token_ids
    finally:
        llm.shutdown()
    eos, bos = config["eos_token_id"], config["bos_token_id"]
    eom = next(t for t in free[1:] if t != eos)  # generated: the answer stops at it
    eot = next(t for t in range(3, 512) if t not in free)
    write_gguf(src, tmp_path / "stops.gguf", stops=(eot, eom), add_eos=True)
    converted = model_dir(tmp_path / "stops.gguf", tmp_path / "cache")
    generation = json.loads((converted / "generation_config.json").read_text())
    vocab = json.loads((converted / "tokenizer.json").read_text())["model"]["vocab"]
    by_text = sorted({vocab[t] for t in END_OF_TURN_TEXTS if t in vocab} - {eos, eot, eom})
    assert generation["eos_token_id"] == [eos, eot, eom, *by_text]
    assert not set(by_text) & set(free[: free.index(eom) + 1])  # so eom ends the answer
    llm = LLM(str(converted), device="cpu", kv_cache_blocks=32)
    try:
        assert llm.engine.eos_token_ids == {eos, eot, eom, *by_text}
        [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
    finally:
        llm.shutdown()
    assert out.finish_reason == "stop" and out.token_ids == free[: free.index(eom) + 1]
    ours = transformers.AutoTokenizer.from_pretrained(str(converted))
    theirs = transformers.AutoTokenizer.from_pretrained(str(src))
    body = theirs.encode("Hello, world!", add_special_tokens=False)
    assert ours.encode("Hello, world!") == [bos, *body, eos]
    assert ours.encode("Hello, world!", add_special_tokens=False) == body
    plain_tok = transformers.AutoTokenizer.from_pretrained(str(plain))
    assert plain_tok.encode("Hello, world!") == body  # neither flag: nothing added


def test_tokens_llama_cpp_reads_as_an_end_of_turn_stop_whatever_the_metadata_names() -> None:
    """A GGUF that names only EOS still stops at ``<|im_end|>`` and ``<end_of_turn>`` (by their
    text, as llama.cpp does), after the ids the metadata names, in id order, once each."""
    from engine.models.gguf_tokenizer import stop_token_ids

    tokens = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "hello", "<end_of_turn>",
              "im_end", "<|im_end|> "]
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 3,
            "tokenizer.ggml.eom_token_id": 4}
    assert stop_token_ids(meta) == [3, 4, 1, 5]
    assert stop_token_ids({"tokenizer.ggml.tokens": ["a", "b"]}) == []
