"""Small random-weight Hugging Face checkpoints for CPU tests and demos.

``write_random_checkpoint`` builds a transformers config and model (transformers' own
classes, fp32, initialised from ``torch.manual_seed(seed)``), saves it with
``save_pretrained`` (safetensors) and adds a byte-level BPE tokenizer trained on a small
embedded English/code corpus, saved as a ``PreTrainedTokenizerFast`` with a ChatML-like chat
template. The directory loads offline with ``AutoTokenizer`` / ``AutoModelForCausalLM``.
The same arguments give the same weight bytes. The tokenizer's vocabulary is at most the
model's (BPE stops early when the corpus has no more pairs to merge); ids above it are never
produced by the tokenizer but are valid model outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.models.chatml import ASSISTANT_TURN, TEXT_OF_MACRO

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, IM_START_ID, EOS_ID = 0, 1, 2  # ids of SPECIAL_TOKENS, in order
PAD_ID = BOS_ID

# A Qwen2.5-style ChatML template with tools (rendered by transformers' apply_chat_template,
# whose ``tojson`` keeps key order and does not HTML-escape): tool signatures in the system
# turn, assistant tool calls as <tool_call>{"name", "arguments"}</tool_call>, consecutive tool
# results grouped into one user turn of <tool_response> blocks. Content may be a string, a list
# of text parts or null; arguments a JSON string (OpenAI's wire form) or an object. Unlike
# Qwen's, an assistant turn always starts "<|im_start|>assistant\n", so every prompt extends
# the previous call's prompt (the generation prompt) token for token.
CHAT_TEMPLATE = TEXT_OF_MACRO + """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- text_of(messages[0].content) + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + text_of(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + text_of(message.content) + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
""" + ASSISTANT_TURN + """\
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + text_of(message.content) + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")

_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        moe_intermediate_size=64,
        num_experts=4,
    ),
    "small": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        vocab_size=8192,
        moe_intermediate_size=352,
        num_experts=8,
    ),
}

_CORPUS = """
The quick brown fox jumps over the lazy dog. A session is a sequence of calls to one model
that share a growing prefix. Each call's prompt is the previous prompt plus the previous
output plus a tool result. Between calls there is a short tool gap, and the user waits for
the whole session to complete. The router ranks instances by model residency, cache locality
and pressure; the instance keeps a soft reservation for the session's likely return.
Serving large language models means moving weights and key-value caches between host memory
and device memory. Bandwidth is the floor of what a switch costs; a stable memory arena keeps
addresses fixed so that graphs stay valid. The scheduler mixes prefill chunks with decodes,
and preempts when blocks run out. Tokens are sampled greedily or with temperature, top-k
and top-p; generation stops at an end-of-sequence token, a stop string or a length limit.
You are a helpful assistant. Please read the file, fix the failing test and explain the change.
The test failed because the function returned None instead of an empty list. I will open the
file, find the bug, write a patch and run the tests again. All tests pass now.
def fibonacci(n: int) -> list[int]:
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]

class Stack:
    def __init__(self) -> None:
        self.items: list[object] = []

    def push(self, item: object) -> None:
        self.items.append(item)

    def pop(self) -> object:
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

for i in range(10):
    if i % 2 == 0:
        print(f"even: {i}")
    else:
        print(f"odd: {i}")

import json
with open("config.json") as f:
    config = json.load(f)
print(config["model"], config.get("max_tokens", 128))

def read_lines(path):
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\\n") for line in handle]

$ git diff --stat
 src/parser.py | 12 ++++++++----
 tests/test_parser.py | 8 ++++++++
$ python -m pytest -q tests/test_parser.py
.....                                                   [100%]
5 passed in 0.12s
{"role": "user", "content": "What is the capital of France?"}
{"role": "assistant", "content": "The capital of France is Paris."}
SELECT name, count(*) FROM users WHERE active = 1 GROUP BY name ORDER BY 2 DESC;
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
fn main() { let v: Vec<u32> = (0..10).collect(); println!("{:?}", v); }
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 4096 65536.
"""


def _config(arch: str, size: str, overrides: dict[str, Any]) -> Any:
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny-model arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if size not in _SIZES:
        raise ValueError(f"unknown tiny-model size {size!r}; choose one of {', '.join(_SIZES)}")
    s = _SIZES[size]
    common: dict[str, Any] = dict(
        vocab_size=s["vocab_size"],
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_hidden_layers"],
        num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    if arch == "llama":
        cls, extra = transformers.LlamaConfig, {}
    elif arch == "qwen2":
        cls, extra = transformers.Qwen2Config, {}
    elif arch == "qwen3":
        cls, extra = transformers.Qwen3Config, dict(head_dim=head_dim, tie_word_embeddings=True)
    elif arch == "qwen3_moe":
        cls = transformers.Qwen3MoeConfig
        extra = dict(
            head_dim=head_dim,
            num_experts=s["num_experts"],
            num_experts_per_tok=2,
            moe_intermediate_size=s["moe_intermediate_size"],
            norm_topk_prob=True,
        )
    else:
        cls = transformers.MixtralConfig
        extra = dict(
            num_local_experts=s["num_experts"],
            num_experts_per_tok=2,
            intermediate_size=s["moe_intermediate_size"],
        )
    kwargs = {**common, **extra, **overrides}
    config = cls(**kwargs)
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return config


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with the chat template and special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    for token, expected in zip(SPECIAL_TOKENS, (BOS_ID, IM_START_ID, EOS_ID), strict=True):
        if tok.token_to_id(token) != expected:
            raise RuntimeError(
                f"special token {token} got id {tok.token_to_id(token)}, expected {expected}"
            )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[PAD_ID],
        additional_special_tokens=[SPECIAL_TOKENS[IM_START_ID]],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def write_random_checkpoint(
    path: str | Path,
    arch: str,
    seed: int = 0,
    size: str = "tiny",
    tokenizer: Any = None,
    **config_overrides: Any,
) -> Path:
    """Write a random fp32 ``arch`` model (+ tokenizer) to ``path``; returns ``path``.

    ``config_overrides`` are passed to the transformers config (e.g. ``tie_word_embeddings``,
    ``rope_scaling``, ``initializer_range``). ``tokenizer`` reuses an already built one."""
    import transformers

    path = Path(path)
    config = _config(arch, size, config_overrides)
    model_cls = getattr(transformers, config.architectures[0])
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok = tokenizer if tokenizer is not None else build_tokenizer(config.vocab_size)
    tok.save_pretrained(path)
    return path


def write_tokenizer_files(model_dirs: list[Path]) -> None:
    """Rewrite the tokenizer (and chat template) of tiny models written earlier; the same
    seeded BPE, so token ids are unchanged."""
    import json

    by_vocab: dict[int, Any] = {}
    for path in model_dirs:
        vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
        if vocab not in by_vocab:
            by_vocab[vocab] = build_tokenizer(vocab)
        by_vocab[vocab].save_pretrained(path)


def make_tiny_models(directory: str | Path, size: str = "tiny", seed: int = 0) -> dict[str, Path]:
    """Write "tiny-llama", "tiny-qwen3" (tied embeddings) and "tiny-qwen3-moe" under
    ``directory`` (one shared tokenizer); returns name -> path. ``size="small"`` gives
    models of tens of millions of parameters."""
    directory = Path(directory)
    tokenizer = build_tokenizer(_SIZES[size]["vocab_size"]) if size in _SIZES else None
    out: dict[str, Path] = {}
    for name, arch in (
        ("tiny-llama", "llama"),
        ("tiny-qwen3", "qwen3"),
        ("tiny-qwen3-moe", "qwen3_moe"),
    ):
        out[name] = write_random_checkpoint(
            directory / name, arch, seed=seed, size=size, tokenizer=tokenizer
        )
    return out
