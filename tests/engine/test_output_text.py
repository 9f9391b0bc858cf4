"""The library's returned text is the text the engine watched for stop strings: decoded with
the end of the prompt as context (so a SentencePiece-style decoder, which drops the first
token's leading space when it decodes alone, gives the answer's leading space as vLLM does)
and cut before the earliest stop string."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import StopStringWatcher, output_text

_VOCAB = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁stop": 3, "▁here": 4}


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2 / Mistral's kind of decoder: a leading '▁' becomes a space, except on the
    first token of a decode."""
    tok = Tokenizer(models.WordLevel(_VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _engine_stops_at(tokenizer: PreTrainedTokenizerFast, prompt: list[int], out: list[int],
                     stops: list[str]) -> int | None:
    watcher = StopStringWatcher(tokenizer, prompt, stops)
    return next((i for i, t in enumerate(out) if watcher.add(t)), None)


def test_the_answer_keeps_its_leading_space() -> None:
    tokenizer = _metaspace_tokenizer()
    assert tokenizer.decode([2, 4]) == "world here"  # alone: no leading space
    assert output_text(tokenizer, [1], [2, 4], []) == " world here"


def test_a_stop_string_at_the_answers_start_is_cut() -> None:
    tokenizer = _metaspace_tokenizer()
    assert _engine_stops_at(tokenizer, [1], [2, 4], [" world"]) == 0  # the engine stopped there
    assert output_text(tokenizer, [1], [2], [" world"]) == ""


def test_the_earliest_stop_string_cuts() -> None:
    tokenizer = _metaspace_tokenizer()
    assert output_text(tokenizer, [1], [2, 3, 4], [" here", " stop"]) == " world"
