"""What the router keeps of a session's prefix: a sampled chain that still tells how far a
prompt extends it, and known chains that let a continuation hash only its new blocks."""

from __future__ import annotations

import random
import struct
import threading
from array import array
from concurrent.futures import ThreadPoolExecutor

import pytest
from router_fakes import FakeInstance

import engine.block_hash
from router.core import RouterCore
from router.sessions.inference import ANSWER_TOKENS_KEPT, SessionInference
from router.sessions.prefix_chain import ChainSample, KnownChains, _pack
from talaria.protocol import CallRequest, SamplingParams
from talaria.protocol.text import block_hashes

BS = 16


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(n)]


@pytest.mark.parametrize("blocks", [1, 7, 100, 5000])
def test_a_sample_tells_how_far_another_chain_shares_it(blocks: int) -> None:
    rng = random.Random(blocks)
    chain = block_hashes(tokens(rng, blocks * BS), BS)
    sample = ChainSample.of(chain, marks=(blocks // 3,))
    assert len(sample.indices) <= 32 + 2 * blocks.bit_length() + 2 and sample.last_hash == chain[-1]
    sampled = set(sample.indices)
    for parted in sorted({0, 1, blocks // 3, blocks // 3 + 1, blocks // 2, blocks - 1, blocks}):
        other = chain[:parted] + [h + 1 for h in chain[parted:]]
        shared = sample.shared_blocks(other)
        nearest = max((i + 1 for i in sampled if i < parted), default=0)
        assert shared == nearest <= parted  # exact where sampled, never more than shared
        assert sample.shared_blocks(chain[:parted]) == nearest
    assert ChainSample.of(()).shared_blocks(chain) == 0


def test_a_continuation_reuses_the_known_chain_and_always_gets_its_own() -> None:
    rng = random.Random(0)
    known = KnownChains(BS)
    prompt = tokens(rng, 1000)
    answer = tokens(rng, 90)
    first = known.hash_prompt(["s"], prompt)
    assert first.reused == 0 and first.hashes == block_hashes(prompt, BS)
    full = len(first.hashes) * BS
    tail = prompt[full:] + answer
    known.remember("s", first, tail, block_hashes(tail, BS, parent=first.hashes[-1]))
    cases = {
        "extends the answer": (prompt + answer + tokens(rng, 300), len(prompt + answer) // BS),
        "re-renders the answer": (prompt + tokens(rng, 500), len(prompt) // BS),
        "edits its history": (prompt[:400] + tokens(rng, 900), 0),
        "is shorter": (prompt[:500], 0),
    }
    for name, (new, reused) in cases.items():
        got = known.hash_prompt(["s"], new)
        assert got.hashes == block_hashes(new, BS), name
        assert got.reused == reused, name
    assert known.hash_prompt(["other"], prompt + answer).reused == 0
    assert known.hash_prompt(None, prompt).hashes == first.hashes and known.hash_prompt(None, prompt).digest is None
    # A session's branches: the chain the prompt repeats the most of is the one reused.
    side = tokens(rng, 300)
    known.remember("s#1", known.hash_prompt([], side), [], [])
    for keys in (["s#1", "s"], ["s", "s#1"]):
        got = known.hash_prompt(keys, prompt + answer + side)
        assert got.reused == len(prompt + answer) // BS and got.hashes == block_hashes(prompt + answer + side, BS)
    assert known.hash_prompt(["s", "s#1"], side + prompt).reused == len(side) // BS


def test_known_chains_are_bounded_in_blocks() -> None:
    rng = random.Random(1)
    known = KnownChains(BS, max_blocks=100)
    for sid in "abcd":
        prompt = tokens(rng, 40 * BS)
        known.remember(sid, known.hash_prompt([sid], prompt), [], [])
    assert known.blocks == 80 and len(known) == 2  # the two least recent went
    known.forget("d")
    assert known.blocks == 40


async def test_a_named_continuation_hashes_only_its_new_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[str] = []
    original = engine.block_hash.hash_block_tokens

    def counting(parent, token_ids):  # type: ignore[no-untyped-def]
        hashed.append(threading.current_thread().name)
        return original(parent, token_ids)

    monkeypatch.setattr(engine.block_hash, "hash_block_tokens", counting)
    rng = random.Random(2)
    answer = tokens(rng, 40)
    with ThreadPoolExecutor(1, thread_name_prefix="hasher") as pool:
        core = RouterCore({"a": FakeInstance("a", answer)}, "talaria", refresh_after_call=False,
                          block_size=BS, hash_executor=pool)
        prompt = tokens(rng, 4000)
        [e async for e in core.submit(CallRequest("c1", "s", "m", prompt, SamplingParams(max_tokens=40)))]
        hashed.clear()
        longer = prompt + answer + tokens(rng, 200)
        [e async for e in core.submit(CallRequest("c2", "s", "m", longer, SamplingParams(max_tokens=40)))]
    new_blocks = len(longer) // BS - (len(prompt) + len(answer)) // BS
    tail_blocks = (len(longer) % BS + len(answer)) // BS
    assert len(hashed) == new_blocks + tail_blocks  # not the 4000-token prompt again
    assert hashed.count("MainThread") == tail_blocks  # the prompt's on the hashing thread
    record = core.sessions.get("s")
    assert record is not None and record.main.kv.blocks == (len(longer) + len(answer)) // BS
    assert len(record.main.kv.indices) < 64 and len(record.branches) == 1  # a sample, not the chain
    await core.close()


def test_an_inferred_session_keeps_only_the_start_of_its_answer() -> None:
    inference = SessionInference(BS)
    prompt = list(range(1, 100))
    sid = inference.assign("m", prompt, block_hashes(prompt, BS))
    inference.record_answer(sid, list(range(5000)))
    assert inference._anchors[sid].answer == tuple(range(ANSWER_TOKENS_KEPT))


def test_tokens_pack_five_bytes_each_when_they_fit_in_32_bits_else_eight() -> None:
    narrow, width = _pack([0, 7, 2**31 - 1])
    assert width == 5 and list(struct.iter_unpack("<ci", narrow)) == [(b"i", 0), (b"i", 7), (b"i", 2**31 - 1)]
    for wide in ([1, 2**31], array("q", [1, 2]), (1, True)):
        packed, width = _pack(wide)
        assert width == 8 and packed.tobytes() == array("q", wide).tobytes(), wide
    assert _pack((5, 6))[0].tobytes() == _pack([5, 6])[0].tobytes()


def test_a_prompt_past_32_bits_is_hashed_whole_and_its_own_continuations_reuse() -> None:
    rng = random.Random(3)
    known = KnownChains(BS)
    prompt, answer = tokens(rng, 500), tokens(rng, 40) + [2**40] + tokens(rng, 40)
    first = known.hash_prompt(["s"], prompt)
    assert first.token_bytes == 5
    full = len(first.hashes) * BS
    tail = prompt[full:] + answer
    known.remember("s", first, tail, block_hashes(tail, BS, parent=first.hashes[-1]))
    # The answer's wide token makes the continuation pack wide: the narrow checkpoint of its
    # prompt reads as a miss, never as a match, and the chain is the prompt's own.
    longer = prompt + answer + tokens(rng, 100)
    got = known.hash_prompt(["s"], longer)
    assert got.token_bytes == 8 and got.reused == 0 and got.hashes == block_hashes(longer, BS)
    known.remember("s", got, [], [])
    again = longer + tokens(rng, 100)
    assert known.hash_prompt(["s"], again).reused == len(longer) // BS  # wide meets wide
