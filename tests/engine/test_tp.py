"""Tensor parallelism end to end on CPU (gloo): workers, step channel, life cycle, sharding.

Greedy tokens at TP=2 (every architecture, on one reused worker pool) and at TP=8 (KV heads
replicated, vocabulary padded) equal TP=1 and transformers on the same fp32 weights. A killed
worker surfaces as a RuntimeError naming it, and no process is left behind.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import transformers
from engine_runs import hf_greedy

from engine import LLM, EngineConfig, EngineCore, SamplingParams
from engine.interface import EngineRequest
from engine.kv_cache_manager import KVCacheManager
from engine.models.tiny import ARCHS, build_tokenizer, write_random_checkpoint
from engine.parallel.channel import StepDecoder, StepEncoder
from engine.parallel.launcher import WorkerGroup
from engine.parallel.sharding import check_shardable
from engine.parallel.tp_runner import TensorParallelRunner
from engine.parallel.worker import describe, zero_kv
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler

VOCAB = 512
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _prompts(seed: int, lens: tuple[int, ...] = (1, 5, 9, 17, 3, 12)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB - 3, (n,), generator=g).tolist() for n in lens]


def _config(path: Path, **kw: object) -> EngineConfig:
    args: dict[str, object] = dict(
        model=path,
        max_model_len=128,
        num_kv_blocks=64,
        block_size=BLOCK,
        max_num_batched_tokens=16,
        device="cpu",
    )
    args.update(kw)
    return EngineConfig(**args)  # type: ignore[arg-type]



def run_staggered(
    core: EngineCore, prompt_list: list[list[int]], params: SamplingParams, stagger: bool = True
) -> list[list[int]]:
    """Add half the prompts (all unless ``stagger``), step until they decode, add the rest
    while they run."""
    half = len(prompt_list) // 2 if stagger else len(prompt_list)
    tokens: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompt_list))}
    for i, p in enumerate(prompt_list[:half]):
        core.add_request(EngineRequest(f"s{i}", p, params))
    pending = list(enumerate(prompt_list))[half:]
    while core.has_unfinished() or pending:
        step = core.step()
        for ev in step.events:
            tokens[ev.request_id].extend(ev.new_token_ids)
        if step.num_decode_tokens > 0 and pending:
            i, p = pending.pop(0)
            core.add_request(EngineRequest(f"s{i}", p, params))
    return [tokens[f"s{i}"] for i in range(len(prompt_list))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    tok = build_tokenizer(VOCAB)
    return {a: write_random_checkpoint(root / a, a, seed=5, tokenizer=tok) for a in ARCHS}


@pytest.fixture(scope="module")
def pool() -> WorkerGroup:
    group = WorkerGroup.start(2, device="cpu")
    yield group
    group.shutdown()


# ------------------------------------------------------------------- no processes
@pytest.mark.parametrize("ranked", [False, True])
def test_step_channel_mirrors_scheduler_through_preemption(ranked: bool) -> None:
    """Workers rebuild every step's tokens and block tables from the deltas alone; decodes
    carry one token; preemption (block tables replaced) and finished requests stay in sync.
    ``ranked``: priorities that make the scheduler take victims back out of a step after
    scheduling them (their freed blocks then go to a request scheduled after them)."""
    kv = KVCacheManager(10, BLOCK, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    for i, p in enumerate(_prompts(1, (6, 9, 3, 11))):
        sched.add_request(Request(f"r{i}", p, params, priority=float(4 - i) if ranked else 0.0))
    taken_back: list[str] = []
    unschedule = sched._unschedule

    def counted(out, request):  # type: ignore[no-untyped-def]
        taken_back.append(request.request_id)
        return unschedule(out, request)
    sched._unschedule = counted  # type: ignore[method-assign]
    enc, dec = StepEncoder("m"), StepDecoder()
    decode_tokens_sent = 0
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        msg = enc.encode(out)
        mirror = dec.decode(msg)
        for s, m in zip(out.scheduled, mirror.scheduled, strict=True):
            assert (m.request_id, m.token_ids, m.block_ids) == (
                s.request_id,
                s.token_ids,
                s.block_ids,
            )
            assert (m.num_computed_tokens, m.num_new_tokens, m.samples) == (
                s.num_computed_tokens,
                s.num_new_tokens,
                s.samples,
            )
        for s, d in zip(out.scheduled, msg.scheduled, strict=True):
            if s.num_computed_tokens >= s.request.num_prompt_tokens and s.num_new_tokens == 1:
                if d.new_tokens:
                    decode_tokens_sent += 1
                    assert len(d.new_tokens) == 1 and len(d.new_blocks) <= 1
        sched.update_after_step(out)
        for s in out.scheduled:
            if s.samples:
                s.request.output_token_ids.append(100 + steps % 50)
                if s.request.num_output_tokens >= params.max_tokens:
                    sched.finish_request(s.request_id, RequestStatus.FINISHED_LENGTH)
        steps += 1
    assert sched.num_preemptions > 0
    assert bool(taken_back) == ranked
    assert decode_tokens_sent > 0
    enc.encode(sched.schedule())
    dec.decode(enc.encode(sched.schedule()))
    assert enc.num_tracked == 0


def test_unshardable_configs_fail_with_reason() -> None:
    base = dict(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=3,
    )
    cfg = transformers.LlamaConfig(**base)
    cfg.architectures = ["LlamaForCausalLM"]
    check_shardable(cfg, 3)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) is not divisible by 4"):
        check_shardable(cfg, 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) neither divides by 2"):
        check_shardable(cfg, 2)
    odd = transformers.LlamaConfig(**{**base, "num_key_value_heads": 6, "intermediate_size": 100})
    odd.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3: .*\(100\) must be divisible"):
        check_shardable(odd, 3)
    small = transformers.LlamaConfig(**{**base, "vocab_size": 2})
    small.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match=r"vocab_size \(2\) is smaller"):
        check_shardable(small, 3)


def test_llm_refuses_unshardable_model_before_starting_workers(
    model_dirs: dict[str, Path],
) -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3: num_attention_heads \(4\)"):
        LLM(model_dirs["llama"], tensor_parallel_size=3, device="cpu", kv_cache_blocks=8)
    assert set(multiprocessing.active_children()) == before


# ------------------------------------------------------------------ multi-process
@pytest.mark.slow
def test_a_core_refused_after_its_workers_started_stops_them(model_dirs: dict[str, Path]) -> None:
    """A check that fails once the workers run (max_model_len against the model's) stops
    them at once: a notebook keeps the last exception, whose frames hold the half-built
    core, so they stayed up (on a GPU, holding their memory) until the interpreter exited."""
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="max_position_embeddings") as refused:
        LLM(model_dirs["llama"], tensor_parallel_size=2, device="cpu", kv_cache_blocks=8,
            max_model_len=10**6)
    assert refused.tb is not None  # the frames stay referenced, as in a notebook
    assert set(multiprocessing.active_children()) == before


@pytest.mark.slow
def test_every_architecture_tp2_equals_tp1_and_transformers(
    pool: WorkerGroup, model_dirs: dict[str, Path]
) -> None:
    ps = _prompts(0)
    for arch in ARCHS:
        path = model_dirs[arch]
        expected = hf_greedy(path, ps, max_new=GREEDY.max_tokens)
        single = EngineCore(_config(path))
        assert run_staggered(single, ps, GREEDY) == expected, arch
        config = _config(path, tensor_parallel_size=2)
        runner = TensorParallelRunner.load(pool, config)
        core = EngineCore(config, runner=runner)
        assert run_staggered(core, ps, GREEDY) == expected, arch
        info = pool.run_on_all_ranks(describe)
        assert [i["rank"] for i in info] == [0, 1]
        assert all(i["runners"][runner.key] == 64 for i in info)
        core.shutdown()  # frees the model on every rank, keeps the pool
        assert all(not i["runners"] for i in pool.run_on_all_ranks(describe))
    assert pool.is_alive


@pytest.mark.slow
def test_tp2_through_preemption_equals_tp1(pool: WorkerGroup, model_dirs: dict[str, Path]) -> None:
    path = model_dirs["qwen3"]
    ps = _prompts(2, (7, 13, 5, 21, 9, 16))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tight = dict(num_kv_blocks=8, max_num_batched_tokens=64)
    expected = run_staggered(EngineCore(_config(path)), ps, params, stagger=False)
    single = EngineCore(_config(path, **tight))
    assert run_staggered(single, ps, params, stagger=False) == expected
    assert single.stats().extra["num_preemptions"] > 0
    config = _config(path, tensor_parallel_size=2, **tight)
    core = EngineCore(config, runner=TensorParallelRunner.load(pool, config))
    assert run_staggered(core, ps, params, stagger=False) == expected
    assert core.stats().extra["num_preemptions"] > 0
    core.shutdown()


@pytest.mark.slow
def test_tp2_forces_a_thinking_budgets_end_as_tp1_does(pool: WorkerGroup, model_dirs: dict[str, Path]) -> None:
    """Rank 0 samples, so it forces the end ids: TP=2 gives TP=1's budgeted outputs."""
    path = model_dirs["qwen3"]
    ps = _prompts(3, (7, 13, 5))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, thinking_budget=3,
                            thinking_end_ids=[7, 8], thinking_from_start=True)
    expected = run_staggered(EngineCore(_config(path)), ps, params)
    assert all(out[3:5] == [7, 8] for out in expected)
    config = _config(path, tensor_parallel_size=2)
    core = EngineCore(config, runner=TensorParallelRunner.load(pool, config))
    assert run_staggered(core, ps, params) == expected
    core.shutdown()


_TP8_CHILD = """
import json, sys
from engine import LLM, SamplingParams
if __name__ == "__main__":
    path, prompts, max_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(path, device="cpu", max_model_len=64, kv_cache_blocks=32, block_size=4,
              tensor_parallel_size=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new))
    print(json.dumps({"pids": llm.engine.runner.group.pids,
                      "tokens": [o.token_ids for o in outs]}), flush=True)
    # no shutdown: interpreter exit must stop the workers
"""


@pytest.mark.slow
def test_tp8_replicated_kv_heads_equals_tp1_and_exit_stops_workers(tmp_path: Path) -> None:
    """TP=8 over 2 KV heads (each on 4 ranks) and a vocabulary padded from 509 to 512, in a
    child interpreter that exits without calling shutdown."""
    path = write_random_checkpoint(
        tmp_path / "m8",
        "llama",
        seed=8,
        vocab_size=509,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    ps = _prompts(3, (4, 11, 2))
    child = subprocess.Popen(
        [sys.executable, "-c", _TP8_CHILD, str(path), json.dumps(ps), str(GREEDY.max_tokens)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    expected = hf_greedy(path, ps, max_new=GREEDY.max_tokens)
    single = LLM(path, device="cpu", max_model_len=64, kv_cache_blocks=32, block_size=BLOCK)
    assert [o.token_ids for o in single.generate(ps, GREEDY)] == expected
    stdout, stderr = child.communicate(timeout=240)
    assert child.returncode == 0, stderr[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert len(result["pids"]) == 7
    assert result["tokens"] == expected
    assert not any(_alive(pid) for pid in result["pids"])


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_killed_worker_raises_and_leaves_no_process(
    pool: WorkerGroup, model_dirs: dict[str, Path]
) -> None:
    llm = LLM(
        model_dirs["llama"],
        device="cpu",
        max_model_len=2048,
        kv_cache_blocks=1024,
        block_size=16,
        tensor_parallel_size=2,
    )
    group = llm.engine.runner.group
    assert group.port != pool.port  # two engines in one process, each on its own port
    [pid] = group.pids
    first = llm.generate([[5, 6, 7]], GREEDY)  # the group works before the kill
    assert len(first[0].token_ids) == GREEDY.max_tokens
    long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    decoding = threading.Event()
    original = llm.engine.runner.execute
    calls = [0]

    def execute(out, generators):  # noqa: ANN001, ANN202
        calls[0] += 1
        if calls[0] == 20:
            decoding.set()
        return original(out, generators)

    def kill() -> None:
        decoding.wait()
        os.kill(pid, signal.SIGKILL)

    llm.engine.runner.execute = execute
    killer = threading.Thread(target=kill)
    killer.start()
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 died \(exit code -9\)"):
        llm.generate([[5, 6, 7] * 10] * 4, long)
    killer.join()
    assert not _alive(pid)
    with pytest.raises(RuntimeError, match="rank 1 died"):  # the error sticks
        llm.generate([[5, 6, 7]], GREEDY)
    llm.shutdown()
    llm.shutdown()
    assert pool.is_alive and len(pool.run_on_all_ranks(describe)) == 2


@pytest.mark.slow
def test_failed_op_breaks_group_and_stops_workers() -> None:
    group = WorkerGroup.start(2, device="cpu")
    [pid] = group.pids
    infos = group.run_on_all_ranks("engine.parallel.worker:describe")
    assert [i["rank"] for i in infos] == [0, 1] and infos[1]["pid"] == pid
    with pytest.raises(ValueError, match="module-level function"):
        group.run_on_all_ranks(lambda ctx: None)
    with pytest.raises(RuntimeError, match=r"op engine.parallel.worker:zero_kv failed on rank 0"):
        group.run_on_all_ranks(zero_kv, "no-such-model")
    assert not group.is_alive and not _alive(pid)
    with pytest.raises(RuntimeError, match="zero_kv failed"):  # the group stays broken
        group.run_on_all_ranks(describe)
    group.shutdown()


def test_bench_tp_counts_every_collective_of_a_decode_step_on_every_rank(
    model_dirs: dict[str, Path],
) -> None:
    """Per decode step: two all-reduces per layer (attention and MLP outputs), one for the
    vocab-parallel embedding and one gather of the LM head's logits: the timers see them all
    on both ranks, and they are off outside the benchmark."""
    from engine.parallel_context import SINGLE
    from talaria.bench.tensor_parallel import bench_tp

    result = bench_tp(model_dirs["llama"], steps=2, batch=2, prompt_len=16, num_threads=2)
    layers = result["num_layers"]
    assert [c["rank"] for c in result["collectives"]] == [0, 1]
    for rank in result["collectives"]:
        assert rank["collectives_per_step"] == 2 * layers + 2
        assert set(rank["by_kind_ms_per_step"]) == {"all_reduce", "all_gather_last_dim"}
    assert not SINGLE.timer.enabled and SINGLE.timer.totals == {}
