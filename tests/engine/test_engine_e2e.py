"""The engine end to end on tiny random fp32 models, checked against transformers."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import engine_runs
import pytest
import torch

from engine import LLM, EngineConfig, EngineCore, SamplingParams
from engine.interface import EngineCoreProtocol, EngineRequest, FinishReason
from engine.models.tiny import ARCHS, build_tokenizer, write_random_checkpoint

VOCAB = 512
BLOCK = 4
MAX_NEW = 8
hf_greedy = partial(engine_runs.hf_greedy, max_new=MAX_NEW)
PROMPT_LENS = [1, 3, 5, 8, 13, 17, 24, 33]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        arch: write_random_checkpoint(root / arch, arch, seed=1, tokenizer=tokenizer)
        for arch in ARCHS
    }


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]



def make_llm(path: Path, **kw) -> LLM:
    args = dict(max_model_len=128, kv_cache_blocks=128, block_size=BLOCK, max_num_batched_tokens=16)
    args.update(kw)
    return LLM(path, **args)


def run_staggered(core: EngineCore, prompt_list: list[list[int]]) -> list[list[int]]:
    """Add half the prompts, step until they decode, add the rest while they run."""
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompt_list[:4]):
        core.add_request(EngineRequest(f"s{i}", p, GREEDY))
    pending = list(enumerate(prompt_list))[4:]
    decoded = False
    while core.has_unfinished() or pending:
        step = core.step()
        for ev in step.events:
            tokens.setdefault(ev.request_id, []).extend(ev.new_token_ids)
        decoded = decoded or step.num_decode_tokens > 0
        if decoded and pending:
            i, p = pending.pop(0)
            core.add_request(EngineRequest(f"s{i}", p, GREEDY))
    return [tokens[f"s{i}"] for i in range(len(prompt_list))]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch: str, model_dirs: dict[str, Path]) -> None:
    path = model_dirs[arch]
    ps = prompts()
    expected = hf_greedy(path, ps)
    llm = make_llm(path)
    together = llm.generate(ps, GREEDY)
    assert [o.token_ids for o in together] == expected
    for o, p in zip(together, ps, strict=True):
        assert o.num_prompt_tokens == len(p)
        assert o.num_generated_tokens == len(o.token_ids)
        assert o.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    fresh = make_llm(path, enable_prefix_caching=False)
    assert run_staggered(fresh.engine, ps) == expected
    assert fresh.engine.stats().num_free_blocks == fresh.engine.stats().num_total_blocks


def test_prefix_cache_reuses_blocks_with_same_tokens(model_dirs: dict[str, Path]) -> None:
    llm = make_llm(model_dirs["llama"])
    p = prompts(1)[6]  # 24 tokens
    [first] = llm.generate([p], GREEDY)
    assert first.num_cached_tokens == 0
    [again] = llm.generate([p], GREEDY)
    assert again.num_cached_tokens == 20  # 5 of 6 full blocks: the last token is recomputed
    assert again.token_ids == first.token_ids
    longer = p + first.token_ids + [7, 8, 9]
    [cont] = llm.generate([longer], GREEDY)
    # Prompt blocks and the first output's computed full blocks are reused.
    assert cont.num_cached_tokens == (len(p) + MAX_NEW - 1) // BLOCK * BLOCK
    assert cont.token_ids == hf_greedy(model_dirs["llama"], [longer])[0]
    assert llm.engine.stats().cached_tokens_total == 20 + cont.num_cached_tokens


def test_preemption_gives_unconstrained_outputs(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["qwen3"]
    ps = prompts(2)
    reference = make_llm(path).generate(ps, GREEDY)
    tight = make_llm(path, kv_cache_blocks=12, max_num_batched_tokens=64)
    outs = tight.generate(ps, GREEDY)
    stats = tight.engine.stats()
    assert stats.extra["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert stats.num_free_blocks == 12 and stats.num_running == 0 and stats.num_waiting == 0


def test_preemption_by_priority_gives_unconstrained_outputs(model_dirs: dict[str, Path]) -> None:
    """The core hands each request's priority to its scheduler: the earliest prompts, ranked
    to go first, are preempted, taken back out of steps that had scheduled them already
    (their freed blocks run another request in the same step), and every output is still
    the unconstrained one."""
    path = model_dirs["qwen3"]
    ps = prompts(2)
    reference = make_llm(path).generate(ps, GREEDY)
    core = make_llm(path, kv_cache_blocks=12, max_num_batched_tokens=64).engine
    victims: list[str] = []
    taken_back: list[str] = []
    preempt, unschedule = core.scheduler._preempt, core.scheduler._unschedule

    def preempted(request):  # type: ignore[no-untyped-def]
        assert request.priority == max(r.priority for r in core.scheduler.running)
        victims.append(request.request_id)
        preempt(request)

    def took_back(out, request):  # type: ignore[no-untyped-def]
        taken_back.append(request.request_id)
        return unschedule(out, request)
    core.scheduler._preempt = preempted  # type: ignore[method-assign]
    core.scheduler._unschedule = took_back  # type: ignore[method-assign]
    n = len(ps)
    for i, p in enumerate(ps):
        core.add_request(EngineRequest(f"p{i}", p, GREEDY, priority=float(n - i)))
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(n)}
    while core.has_unfinished():
        for ev in core.step().events:
            tokens[ev.request_id].extend(ev.new_token_ids)
    assert victims[0] == "p0" and taken_back  # FCFS (equal priorities) takes none back
    assert [tokens[f"p{i}"] for i in range(n)] == [o.token_ids for o in reference]
    stats = core.stats()
    assert stats.num_free_blocks == 12 and stats.num_running == 0 and stats.num_waiting == 0


def test_abort_and_finish_free_every_block(model_dirs: dict[str, Path]) -> None:
    core = make_llm(model_dirs["mixtral"]).engine
    assert isinstance(core, EngineCoreProtocol)
    ps = prompts(3)
    for i in range(4):
        core.add_request(EngineRequest(f"r{i}", ps[4 + i], SamplingParams(max_tokens=20)))
    core.step()
    core.step()
    assert core.stats().num_free_blocks < core.stats().num_total_blocks
    core.abort("r1")  # running
    core.abort("r1")  # already gone: ignored
    core.abort("nope")
    step = core.step()
    [ev] = [e for e in step.events if e.request_id == "r1"]
    assert ev.finished and ev.finish_reason == FinishReason.ABORT and ev.new_token_ids == []
    while core.has_unfinished():
        core.step()
    assert core.stats().num_free_blocks == core.stats().num_total_blocks
    assert core.kv.pool.num_hashed_blocks == core.kv.num_cached_blocks  # nothing referenced


def test_an_abort_event_survives_a_step_that_raises(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An abort's event is delivered by the first step that completes, even when the step
    after the abort raises (a fault the caller lives through)."""
    core = make_llm(model_dirs["llama"]).engine
    ps = prompts(7)
    core.add_request(EngineRequest("a", ps[3], SamplingParams(max_tokens=20)))
    core.add_request(EngineRequest("b", ps[4], SamplingParams(max_tokens=20)))
    core.step()
    core.abort("a")

    def failing(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device fault")

    monkeypatch.setattr(core.runner, "execute", failing)
    with pytest.raises(RuntimeError, match="device fault"):
        core.step()
    monkeypatch.undo()
    assert core.has_unfinished()
    events = core.step().events
    [ev] = [e for e in events if e.request_id == "a"]
    assert ev.finished and ev.finish_reason == FinishReason.ABORT and ev.new_token_ids == []
    assert events.index(ev) == 0  # an abort's event comes before the step's tokens
    assert not core.take_pending_events()


def test_stop_token_ids_and_stop_strings(model_dirs: dict[str, Path], tokenizer) -> None:
    llm = make_llm(model_dirs["qwen2"])
    ps = prompts(4)[3:6]
    base = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop_ids = [o.token_ids[4] for o in base]
    outs = llm.generate(
        ps,
        [
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[t])
            for t in stop_ids
        ],
    )
    for o, b, t in zip(outs, base, stop_ids, strict=True):
        k = b.token_ids.index(t)
        assert o.token_ids == b.token_ids[: k + 1]  # the stop token is an output token (vLLM)
        assert o.finish_reason == FinishReason.STOP
        # ... but its text is not in the output text (vLLM without include_stop_str_in_output)
        assert o.text == tokenizer.decode(o.token_ids[:-1], skip_special_tokens=True)
        assert o.text != tokenizer.decode(o.token_ids, skip_special_tokens=True)
    llm.engine.eos_token_ids = {stop_ids[0]}  # an EOS id that is not a special token
    [eos] = llm.generate(ps[:1], SamplingParams(temperature=0.0, max_tokens=12))
    assert eos.token_ids == outs[0].token_ids and eos.text == outs[0].text
    [kept] = llm.generate(ps[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert kept.text == tokenizer.decode(kept.token_ids, skip_special_tokens=True)
    checked = 0
    for o, p in zip(base, ps, strict=True):
        text = tokenizer.decode(o.token_ids)
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        if not stop.strip() or "\ufffd" in stop:
            continue
        [s] = llm.generate(
            [p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
        )
        assert s.finish_reason == FinishReason.STOP
        assert s.token_ids == o.token_ids[: len(s.token_ids)]
        assert stop not in s.text and stop in tokenizer.decode(s.token_ids)
        assert s.text == text[: text.index(stop)]
        checked += 1
    assert checked > 0


def test_seeded_sampling_and_logprobs(model_dirs: dict[str, Path]) -> None:
    llm = make_llm(model_dirs["qwen3_moe"])
    ps = prompts(5)
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=6, logprobs=True)
    [alone] = llm.generate([ps[2]], seeded)
    mixed = llm.generate(ps[:5], [SamplingParams(temperature=0.8, max_tokens=6)] * 2 + [seeded] * 3)
    assert mixed[2].token_ids == alone.token_ids
    assert alone.logprobs is not None and len(alone.logprobs) == len(alone.token_ids)
    assert all(lp <= 0.0 for lp in alone.logprobs)


def test_bad_input_raises_and_allocates_nothing(model_dirs: dict[str, Path]) -> None:
    llm = make_llm(model_dirs["llama"], max_model_len=40)
    core = llm.engine
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 40], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, VOCAB]], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 6], [-1]], GREEDY)  # the valid first prompt is rolled back
    core.add_request(EngineRequest("dup", [5, 6], GREEDY))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(EngineRequest("dup", [7, 8], GREEDY))
    core.abort("dup")
    while core.has_unfinished():
        core.step()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model_dirs["llama"], tensor_parallel_size=3)  # 4 heads cannot split 3 ways
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EngineCore(EngineConfig(model=model_dirs["llama"], max_model_len=10**6, num_kv_blocks=4))
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not core.has_unfinished()
    [ok] = llm.generate([[5, 6, 7]], GREEDY)
    assert ok.num_generated_tokens >= 1


def test_a_refused_prompt_is_named_by_its_index(model_dirs: dict[str, Path]) -> None:
    """The engine's request ids count over the LLM's life ('llm-7' on a second call), so a
    refusal names the prompt's place in the list the caller passed."""
    llm = make_llm(model_dirs["llama"], max_model_len=40)
    llm.generate([[5, 6]], GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[2\]: .*max_model_len"):
        llm.generate([[5, 6], [7, 8], [5] * 40], GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[1\]: .*outside the vocabulary"):
        llm.generate([[5, 6], [5, VOCAB]], GREEDY)
    assert not llm.engine.has_unfinished()


def test_string_prompts_are_tokenized_and_outputs_detokenized(
    model_dirs: dict[str, Path], tokenizer
) -> None:
    llm = make_llm(model_dirs["qwen3"])
    text = "def fibonacci(n: int) -> list[int]:"
    [by_text] = llm.generate([text], GREEDY)
    [by_ids] = llm.generate([tokenizer.encode(text)], GREEDY)
    assert by_text.prompt_token_ids == tokenizer.encode(text)
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.text == tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate([text, text], [GREEDY])


def test_generate_takes_a_sequence_of_sampling_params_and_names_a_wrong_one(
    model_dirs: dict[str, Path],
) -> None:
    """A tuple of SamplingParams is a sequence of them (as vLLM takes); anything else than
    SamplingParams is a TypeError naming ``params``, not an AttributeError from inside the
    engine."""
    llm = make_llm(model_dirs["llama"])
    by_list = llm.generate([[5, 6], [7, 8]], [GREEDY, GREEDY])
    by_tuple = llm.generate([[5, 6], [7, 8]], (GREEDY, GREEDY))
    assert [o.token_ids for o in by_tuple] == [o.token_ids for o in by_list]
    for bad in ({"max_tokens": 4}, [GREEDY, {"max_tokens": 4}], [GREEDY, None]):
        with pytest.raises(TypeError, match="params"):
            llm.generate([[5, 6], [7, 8]], bad)  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished()


class HostStore:
    """A dict-backed secondary KV cache holding copies of device blocks by block hash."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.blocks: dict[int, torch.Tensor] = {}

    def offload(self, block_hashes: list[int], block_ids: list[int]) -> None:
        for h, b in zip(block_hashes, block_ids, strict=True):
            self.blocks[h] = self.kv_cache[:, :, b].clone()

    def lookup(self, block_hashes: list[int]) -> int:
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.blocks:
            n += 1
        return n

    def load(self, block_hashes: list[int], block_ids: list[int]) -> None:
        for h, b in zip(block_hashes, block_ids, strict=True):
            self.kv_cache[:, :, b].copy_(self.blocks[h])


def collect(core: EngineCore) -> dict[str, list]:
    out: dict[str, list] = {}
    while core.has_unfinished():
        for ev in core.step().events:
            out.setdefault(ev.request_id, []).append(ev)
    return out


def test_session_kv_offload_reset_and_restore(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama"]
    config = EngineConfig(model=path, max_model_len=128, num_kv_blocks=64, block_size=BLOCK)
    core = EngineCore(config)
    store = HostStore(core.runner.kv_cache)
    core.kv.secondary = store
    p = prompts(6)[6]  # 24 tokens
    core.add_request(EngineRequest("a", p, GREEDY, session_id="s"))
    first = [t for ev in collect(core)["a"] for t in ev.new_token_ids]
    computed = (len(p) + MAX_NEW - 1) // BLOCK * BLOCK  # the last output token has no KV
    assert core.session_device_tokens("s") == computed
    assert core.pin_session_kv("s") == computed // BLOCK
    assert core.stats().num_free_blocks == 64 - computed // BLOCK
    core.unpin_session_kv("s")
    store.offload(core.kv.session_block_hashes("s"), core.kv.session_block_ids("s"))
    core.reset_kv()  # a model switch: every device block dropped
    core.runner.kv_cache.normal_()
    assert core.session_device_tokens("s") == 0
    longer = p + first + [7, 8, 9]
    core.add_request(EngineRequest("b", longer, GREEDY, session_id="s"))
    events = collect(core)["b"]
    assert events[-1].num_cached_tokens == computed
    assert events[-1].num_restored_tokens == computed
    assert [t for ev in events for t in ev.new_token_ids] == hf_greedy(path, [longer])[0]
    assert core.stats().restored_tokens_total == computed


def test_core_without_tokenizer_ignores_stop_strings(model_dirs: dict[str, Path]) -> None:
    config = EngineConfig(model=model_dirs["qwen2"], max_model_len=64, num_kv_blocks=32)
    core = EngineCore(config)
    assert core.tokenizer is None
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, stop=["a", "e", " "])
    core.add_request(EngineRequest("x", [5, 6, 7], params))
    events = collect(core)["x"]
    assert events[-1].finish_reason == FinishReason.LENGTH
    assert events[-1].num_output_tokens == 5


def test_llm_takes_engine_config_fields_and_names_an_unknown_one(model_dirs) -> None:
    """``LLM``'s arguments are ``EngineConfig``'s fields (one source for names and
    defaults): a field LLM never listed by hand reaches the config, a typo is refused."""
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_blocks=16, distributed_timeout_s=5.0)
    try:
        assert llm.config.num_kv_blocks == 16 and llm.config.distributed_timeout_s == 5.0
        assert llm.config.max_num_seqs == EngineConfig.__dataclass_fields__["max_num_seqs"].default
    finally:
        llm.shutdown()
    with pytest.raises(TypeError, match="max_num_seq'"):
        LLM(model_dirs["llama"], max_num_seq=4)


def test_llm_names_a_missing_model_directory(tmp_path: Path) -> None:
    """A mistyped path is a FileNotFoundError naming it, not the tokenizer's Hugging Face
    Hub error about repo ids (the path is never a Hub id: the engine loads local files)."""
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(tmp_path / "empty")


@pytest.mark.parametrize(
    "bad",
    [
        {"block_size": 4.0}, {"block_size": True}, {"num_kv_blocks": 16.0},
        {"max_model_len": "128"}, {"max_num_batched_tokens": 8.5}, {"max_num_seqs": 2.5},
        {"tensor_parallel_size": 1.0}, {"seed": "0"}, {"distributed_port": "0"},
        {"enable_prefix_caching": "no"}, {"cuda_graphs": 0}, {"kv_memory_fraction": "0.5"},
        {"distributed_timeout_s": True},
    ],
)
def test_engine_config_refuses_a_wrong_type_by_name(bad: dict[str, object]) -> None:
    """A setting of the wrong type is a ValueError naming it, as SamplingParams' are: before,
    enable_prefix_caching="no" turned caching on, block_size=True was 1, a float block
    count failed inside torch.zeros and a string length in a comparison."""
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineConfig(model="unused", **bad)  # type: ignore[arg-type]
    EngineConfig(model="unused", num_kv_blocks=None, max_model_len=None, kv_memory_fraction=1,
                 distributed_timeout_s=5, dtype=torch.float16, device=torch.device("cpu"))
