"""A byte-level BPE tokenizer (``tokenizers``) and its tokenizer_config.json, built from the
``tokenizer.ggml.*`` metadata of a GGUF file.

Only ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE: GPT-2, SmolLM, StarCoder...) is
built. How text is split before BPE is named by ``tokenizer.ggml.pre``, and the merges were
learned on those splits, so an unknown one is refused rather than guessed: ``default`` /
``gpt-2`` split with the GPT-2 expression, ``smollm`` splits every digit apart first (as
llama.cpp and SmolLM's own tokenizer.json do). Token types 3 (control) and 4 (user-defined)
become added tokens, the first special. ``tokenizer.ggml.add_bos_token`` /
``add_eos_token`` make encoding add BOS before / EOS after the text, as llama.cpp does.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

__all__ = ["END_OF_TURN_TEXTS", "PRE_TOKENIZERS", "build_tokenizer", "stop_token_ids", "tokenizer_config"]

_CONTROL, _USER_DEFINED = 3, 4
# ``tokenizer.ggml.<key>_token_id`` -> the tokenizer_config.json entry naming that token
_SPECIAL_KEYS = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token",
                 "padding": "pad_token"}


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2()]
    )


PRE_TOKENIZERS = {"default": _gpt2, "gpt-2": _gpt2, "smollm": _smollm}


def _token(meta: dict[str, Any], key: str) -> str | None:
    index = meta.get(f"tokenizer.ggml.{key}_token_id")
    tokens = meta["tokenizer.ggml.tokens"]
    return None if index is None or not 0 <= int(index) < len(tokens) else tokens[int(index)]


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer the metadata describes; ValueError naming what is not supported."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2', "
                         "byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False)
         for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED]
    )
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False)
         for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL]
    )
    bos = _token(meta, "bos") if meta.get("tokenizer.ggml.add_bos_token") else None
    eos = _token(meta, "eos") if meta.get("tokenizer.ggml.add_eos_token") else None
    if bos is not None or eos is not None:
        first = f"{bos}:0 " if bos else ""
        single = f"{first}$A:0" + (f" {eos}:0" if eos else "")
        pair = single + (f" {bos}:1" if bos else "") + " $B:1" + (f" {eos}:1" if eos else "")
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair,
            special_tokens=[(t, vocab[t]) for t in dict.fromkeys([bos, eos]) if t is not None],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


# Token texts llama.cpp takes for an end of turn whatever the metadata says
# (src/llama-vocab.cpp at 971f245: "find EOT token"), since converters often leave
# ``eot_token_id`` out: a chat model's turn ends at them.
END_OF_TURN_TEXTS: tuple[str, ...] = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
    "<｜end▁of▁sentence｜>",
)


def stop_token_ids(meta: dict[str, Any]) -> list[int]:
    """The ids that end a generation: as the metadata names them, EOS, end of turn, end of
    message (``tokenizer.ggml.{eos,eot,eom}_token_id``), then the vocabulary's tokens whose
    text llama.cpp reads as an end of turn (``END_OF_TURN_TEXTS``), in id order; no repeats.
    That is llama.cpp's end-of-generation set."""
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    texts = set(END_OF_TURN_TEXTS)
    for token_id, text in enumerate(meta.get("tokenizer.ggml.tokens", ())):
        if text in texts and token_id not in ids:
            ids.append(token_id)
    return ids


def tokenizer_config(meta: dict[str, Any], model_max_length: int,
                     chat_template: str | None = None) -> dict[str, Any]:
    """tokenizer_config.json for ``PreTrainedTokenizerFast`` over that tokenizer.json; the
    chat template is the GGUF's unless one is given."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    for key, name in _SPECIAL_KEYS.items():
        token = _token(meta, key)
        if token is not None:
            config[name] = token
    template = chat_template or meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config
