"""Router test helpers: a tiny byte-level BPE tokenizer with a chat template, a tiny
SentencePiece one, and fake instances that stream fixed tokens (or fail, or are overloaded)
in-process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

from router.sessions.prefix_chain import ChainSample
from router.sessions.table import SessionBranch, SessionRecord, SessionTable
from router.tokenization import ModelTokenizer
from talaria.protocol import (
    CallEvent,
    CallRequest,
    CallUsage,
    InstanceState,
    InstanceUnavailable,
    InstanceUnreachable,
    ModelState,
    Overloaded,
    Residency,
)
from talaria.protocol.text import block_hashes

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Hello world, this is a test of the tiny tokenizer.",
    "def main():\n    print('hello')\n",
    "The agent calls the model again and again with a growing prompt.",
    "Session completion time matters more than one call.",
] * 20
CONTEXT_LEN = 256


def write_tokenizer(path: Path, context_len: int = CONTEXT_LEN) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=specials,
    )
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": context_len}))
    return path


class FakeInstance:
    """An in-process InstanceClient. Streams ``reply`` one token per event (the first carries
    the usage so far, the last finished + usage), or fails as configured."""

    def __init__(
        self,
        instance_id: str,
        reply: list[int],
        *,
        unavailable: bool = False,
        fail_after: int | None = None,
        overloaded: bool = False,
        cached_tokens: int = 0,
        restored_tokens: int = 0,
        state: InstanceState | None = None,
        hold: asyncio.Event | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.reply = reply
        self.unavailable = unavailable
        self.fail_after = fail_after
        self.overloaded = overloaded
        self.cached_tokens = cached_tokens
        self.restored_tokens = restored_tokens
        self.state_obj = state or InstanceState(instance_id=instance_id)
        self.hold = hold  # when set, the stream waits on it after the first token
        self.calls: list[CallRequest] = []
        self.aborted: list[str] = []
        self.answered: list[str] = []  # of those, the calls aborted with their answer whole
        self.state_polls = 0

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.calls.append(call)
        if self.unavailable:
            raise InstanceUnreachable(f"{self.instance_id} is down")
        if self.overloaded:
            raise Overloaded(f"{self.instance_id} queue full", retry_after_s=2.5)
        tokens = self.reply[: call.params.max_tokens]
        for i, token in enumerate(tokens):
            if self.fail_after is not None and i == self.fail_after:
                raise InstanceUnavailable(f"{self.instance_id} died mid-call")
            if i == 1 and self.hold is not None:
                await self.hold.wait()
            await asyncio.sleep(0)
            last = i == len(tokens) - 1
            yield CallEvent(
                call_id=call.call_id,
                token_ids=[token],
                logprobs=[-0.25],
                finished=last,
                finish_reason=("length" if len(tokens) == call.params.max_tokens else "stop") if last else None,
                usage=self.usage(call, i, len(tokens)),
            )

    def usage(self, call: CallRequest, i: int, n: int) -> CallUsage | None:
        """What the ``i``-th of ``n`` events carries, as an instance sends it: the usage so
        far on the first (``talaria.instance.calls.token_event``), the final one on the last."""
        if i not in (0, n - 1):
            return None
        return CallUsage(len(call.prompt_token_ids), i + 1, self.cached_tokens, self.restored_tokens)

    async def abort(self, call_id: str, answered: bool = False) -> None:
        self.aborted.append(call_id)
        if answered:
            self.answered.append(call_id)

    async def state(self) -> InstanceState:
        self.state_polls += 1
        if self.unavailable:
            raise InstanceUnavailable(f"{self.instance_id} is down")
        return self.state_obj


def model_state(name: str, residency: Residency = Residency.ACTIVE, **kw: float) -> ModelState:
    return ModelState(name=name, residency=residency, **kw)  # type: ignore[arg-type]


def sentencepiece_tokenizer() -> ModelTokenizer:
    """A SentencePiece (Metaspace, Unigram) vocabulary of a few pieces: a word piece ``▁ol``
    is `` ol`` after other text but ``ol`` when a decode starts with it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "▁caf", "é", "▁ol", "▁naï", "ve", "▁", "c", "a", "f", "o", "l"]
    backend = Tokenizer(models.Unigram([(p, -1.0 - i / 10) for i, p in enumerate(pieces)], 0))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return ModelTokenizer(
        "sp", PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>"), 64)


def write_tiny_tokenizer(path: Path, context_len: int = 4096) -> Path:
    """The tiny models' own tokenizer and chat template (Qwen-style, with tools)."""
    from engine.models.tiny import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(512).save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": context_len}))
    return path


class ScriptedInstance(FakeInstance):
    """A FakeInstance whose answers are chosen per call: ``script`` maps each call (by
    arrival order) to the token ids it answers with, then finishes with ``stop``."""

    def __init__(self, instance_id: str, script: list[list[int]]) -> None:
        super().__init__(instance_id, [])
        self.script = list(script)

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.calls.append(call)
        tokens = self.script[min(len(self.calls), len(self.script)) - 1][: call.params.max_tokens]
        for i, token in enumerate(tokens):
            await asyncio.sleep(0)
            last = i == len(tokens) - 1
            yield CallEvent(
                call_id=call.call_id, token_ids=[token], finished=last,
                finish_reason=("length" if len(tokens) == call.params.max_tokens else "stop") if last else None,
                usage=self.usage(call, i, len(tokens)),
            )


def book_call(
    table: SessionTable, session_id: str, prompt: list[int], start: float, end: float | None = None,
    instance: str | None = "i", model: str = "m", output: int = 0, last: bool = False, block_size: int = 16,
) -> tuple[SessionRecord, SessionBranch]:
    """A call through ``table`` as the router books it: its start, and its end at ``end`` (if
    given) on ``instance`` (None: it ran nowhere) with ``output`` more tokens."""
    hashes = block_hashes(prompt, block_size)
    record, branch, _new = table.start_call(session_id, model, start, prompt, hashes)
    if end is not None:
        if instance is not None:
            chain = block_hashes(prompt + [1] * output, block_size)
            branch.ran_on(instance, prompt, hashes, ChainSample.of(chain, marks=(len(hashes) - 1,)),
                          len(prompt) + output)
        table.end_call(record, branch, end, last_call=last)
    return record, branch
