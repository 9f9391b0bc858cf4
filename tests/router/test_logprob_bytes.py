"""Logprobs of a character split over byte-level tokens (an emoji, CJK): each token carries
its own bytes, which join to the answer's UTF-8; a token that is part of a character is
named ``bytes:\\x..``, never U+FFFD; completions' offsets count characters of the answer."""

from __future__ import annotations

from router_fakes import sentencepiece_tokenizer

from router.api.stream_output import OutputAssembler
from router.tokenization import ModelTokenizer, piece_bytes
from talaria.protocol import CallEvent

TEXT = "ok 🚀 東京, naïve!"


def _assembler(tok: ModelTokenizer) -> OutputAssembler:
    return OutputAssembler(tok, tok.encode_text("hi"), [], want_logprobs=True)


def test_chat_logprob_bytes_join_to_the_answer(tiny_tokenizer: ModelTokenizer) -> None:
    ids = tiny_tokenizer.encode_text(TEXT, add_special_tokens=False)
    out = _assembler(tiny_tokenizer)
    out.add(CallEvent("c", token_ids=ids, logprobs=[-0.5] * len(ids), finished=True,
                      finish_reason="stop"))
    assert out.text == TEXT
    content = out.chat_logprobs()["content"]  # type: ignore[index]
    assert len(content) == len(ids)
    assert b"".join(bytes(c["bytes"]) for c in content) == TEXT.encode()
    partial = [c for c in content if c["token"].startswith("bytes:")]
    assert partial, "the tiny vocabulary splits the emoji and the CJK characters"
    for c in content:
        assert "\ufffd" not in c["token"]
        if c["token"].startswith("bytes:"):
            assert c["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in c["bytes"])
        else:
            assert c["token"].encode() == bytes(c["bytes"])


def test_completion_offsets_count_the_answers_characters_across_events(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    ids = tiny_tokenizer.encode_text(TEXT, add_special_tokens=False)
    out = _assembler(tiny_tokenizer)
    tokens: list[str] = []
    offsets: list[int] = []
    for k, token in enumerate(ids):  # one event a token, as a stream sends them; the second
        # comes without logprobs, and its characters still count for the offsets after it
        piece = out.add(CallEvent("c", token_ids=[token], logprobs=None if k == 1 else [-0.5],
                                  finished=k == len(ids) - 1, finish_reason="stop"))
        lp = out.completion_logprobs(piece)
        assert lp is not None
        tokens += lp["tokens"]
        offsets += lp["text_offset"]
    assert out.completion_logprobs()["text_offset"] == offsets  # type: ignore[index]
    assert "\ufffd" not in "".join(tokens)
    # each token starts where the characters before its bytes end (a continuation byte of a
    # character starts at that character)
    done, expected = b"", []
    for k, token in enumerate(tiny_tokenizer.token_bytes(ids)):
        if k != 1:
            expected.append(len(done.decode("utf-8", errors="ignore")))
        done += token
    assert offsets == expected and len(offsets) == len(ids) - 1 and expected[-1] < len(TEXT)


def test_a_vocabulary_entry_gives_its_bytes() -> None:
    assert piece_bytes("Ġhello") == b" hello" and piece_bytes("Ċ") == b"\n"
    assert piece_bytes("ðŁ") == "🚀".encode()[:2]
    assert piece_bytes("<0xF0>") == b"\xf0" and piece_bytes("<|im_end|>") == b"<|im_end|>"
    assert piece_bytes("▁the") is None and piece_bytes("") is None and piece_bytes(None) is None


def test_sentencepiece_pieces_give_their_utf8() -> None:
    """A SentencePiece vocabulary spells text as itself (``▁`` for a space), not in the
    byte-level alphabet: its piece ``é`` is the two bytes of é, not byte 0xE9."""
    tok = sentencepiece_tokenizer()
    ids = tok.encode_text("café olé naïve", add_special_tokens=False)
    assert tok.tokenizer.convert_ids_to_tokens(ids) == ["▁caf", "é", "▁ol", "é", "▁naï", "ve"]
    got = tok.token_bytes(ids)
    assert got[1] == got[3] == "é".encode()
    assert got[4].endswith("naï".encode())


def test_sentencepiece_word_pieces_keep_their_space() -> None:
    """A word piece ``▁ol`` is `` ol`` in the text (a token of an answer follows other
    tokens), so the tokens' bytes join to the text and completions' offsets stay right."""
    tok = sentencepiece_tokenizer()
    ids = tok.encode_text("café olé naïve", add_special_tokens=False)
    assert b"".join(tok.token_bytes(ids)) == " café olé naïve".encode()
    out = _assembler(tok)
    piece = out.add(CallEvent("c", token_ids=ids, logprobs=[-0.5] * len(ids), finished=True,
                              finish_reason="stop"))
    lp = out.completion_logprobs(piece)
    assert lp is not None and lp["text_offset"] == [0, 4, 5, 8, 9, 13]
