"""Block hashes, incremental detokenisation, stop strings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.api.stream_output import OutputAssembler
from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent
from talaria.protocol.text import StopMatcher, block_hashes


def test_block_hashes_chain_prefixes() -> None:
    a = list(range(100))
    b = list(range(40)) + [999] + list(range(41, 100))
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 6  # only full blocks
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert ha[3:] != hb[3:]  # chained: a change poisons every later block
    assert block_hashes(a[:15], 16) == []
    # Continuing a chain from a parent equals hashing the whole sequence.
    assert ha[:2] + block_hashes(a[32:], 16, parent=ha[1]) == ha
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(a, 0)


def test_chat_template_and_context_length(tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hello world"}])
    text = tokenizer.tokenizer.decode(ids)
    assert text == "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.context_len == 256


def test_max_model_len_overrides_config(model_dir) -> None:  # type: ignore[no-untyped-def]
    assert ModelTokenizer.load("tiny", model_dir, max_model_len=64).context_len == 64
    with pytest.raises(FileNotFoundError, match="model directory"):
        ModelTokenizer.load("x", model_dir / "missing")


def test_token_ids_outside_vocab_rejected(tokenizer: ModelTokenizer) -> None:
    tokenizer.check_token_ids([0, 1, tokenizer.vocab_size - 1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.check_token_ids([5, tokenizer.vocab_size])


@pytest.mark.parametrize("text", ["Hello world, this is a test.", "naïve café ü — 漢字 ok", "  spaced\n\nlines"])
def test_incremental_detokenizer_matches_full_decode(tokenizer: ModelTokenizer, text: str) -> None:
    prompt = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    ids = tokenizer.encode_text(text, add_special_tokens=False)
    detok = tokenizer.detokenizer(prompt)
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@given(st.text(alphabet="abc", max_size=40), st.lists(st.integers(1, 5), min_size=1, max_size=20))
def test_stop_matcher_cuts_exactly_at_first_stop(text: str, cuts: list[int]) -> None:
    stops = ["cab", "bb"]
    matcher = StopMatcher(stops)
    out, pos, k = [], 0, 0
    while pos < len(text):
        c = cuts[k % len(cuts)]
        k += 1
        emitted, stopped = matcher.feed(text[pos : pos + c])
        out.append(emitted)
        pos += c
        if stopped:
            break
    out.append(matcher.flush())
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[: min(hits)] if hits else text
    assert "".join(out) == expected
    assert matcher.stopped == bool(hits)


def _cut_inside_a_character(tok: ModelTokenizer, text: str) -> list[int]:
    """``text``'s ids up to a token that ends inside a multi-byte character."""
    ids = tok.encode_text(text, add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    return ids[:cut]


@pytest.mark.parametrize("text", ["ok 🚀 go", "x 東京"])
def test_a_held_back_tail_is_flushed_at_the_end(tiny_tokenizer: ModelTokenizer, text: str) -> None:
    """Bytes that never complete a character end the answer as U+FFFD, as a full decode
    gives them, and the complete characters before them are not lost either."""
    ids = _cut_inside_a_character(tiny_tokenizer, text)
    detok = tiny_tokenizer.detokenizer(tiny_tokenizer.encode_text("hi"))
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) + detok.flush() == tiny_tokenizer.decode(ids)
    assert detok.flush() == "" and detok.push([]) == ""


def test_the_assembled_answer_ends_as_the_full_decode(tiny_tokenizer: ModelTokenizer) -> None:
    ids = _cut_inside_a_character(tiny_tokenizer, "ok 🚀 go")
    out = OutputAssembler(tiny_tokenizer, tiny_tokenizer.encode_text("hi"), [], want_logprobs=False)
    streamed = [out.add(CallEvent("c", token_ids=[t], finished=k == len(ids) - 1,
                                  finish_reason="length")).text for k, t in enumerate(ids)]
    assert "".join(streamed) + out.flush().text == out.text == tiny_tokenizer.decode(ids)
    assert out.text.endswith("\ufffd")
