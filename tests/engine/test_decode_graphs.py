"""Decode steps in fixed-shape buckets (``engine.graphs.decode``) on the CPU: the path a GPU
replays from CUDA graphs, run eagerly here. Which steps take it and in which bucket, that an
engine using it generates what one without it does while sequences join and leave, and how
buckets are kept and dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, EngineCore, SamplingParams
from engine.attention.metadata import FixedShape
from engine.graphs.decode import DecodeGraphs, bucket_size
from engine.interface import EngineRequest
from engine.model_runner import ModelRunner
from engine.models.tiny import write_random_checkpoint

BLOCK = 4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graphs")
    return {arch: write_random_checkpoint(root / arch, arch, seed=3)
            for arch in ("llama", "qwen3_moe")}


def make_core(path: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=path, max_model_len=96, num_kv_blocks=160,
                                   block_size=BLOCK, device="cpu", max_num_seqs=8))


def test_bucket_sizes_pad_at_most_a_quarter_within_the_limit() -> None:
    sizes = [bucket_size(n, 64) for n in (1, 2, 3, 8, 9, 11, 16, 17, 33, 41, 64)]
    assert sizes == [1, 2, 3, 8, 10, 12, 16, 20, 40, 48, 64]
    assert all(n <= bucket_size(n, 10**6) <= 1.25 * n for n in range(1, 5000))
    assert bucket_size(9, 9) == 9 and bucket_size(60, 62) == 62


def generate(core: EngineCore, late: list[int]) -> dict[str, list[int]]:
    """Three requests of different lengths, and ``late`` prompts joining after four steps
    (a prefill among decodes: a step the buckets do not take)."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (9, 14, 5)]
    for i, (n, p) in enumerate(zip((5, 17, 30), params, strict=True)):
        core.add_request(EngineRequest(f"r{i}", [(5 * i + j) % 180 + 3 for j in range(n)], p))
    out: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished():
        steps += 1
        if steps == 4:
            for i, n in enumerate(late):
                core.add_request(EngineRequest(f"late{i}", [(3 * j + i) % 150 + 3 for j in range(n)],
                                               SamplingParams(temperature=0.0, max_tokens=6,
                                                              ignore_eos=True)))
        for event in core.step().events:
            out.setdefault(event.request_id, []).extend(event.new_token_ids)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_an_engine_on_buckets_generates_what_one_without_them_does(
    model_dirs: dict[str, Path], arch: str
) -> None:
    want = generate(make_core(model_dirs[arch]), late=[11, 3])
    core = make_core(model_dirs[arch])
    runner: ModelRunner = core.runner
    graphs = runner.use_decode_graphs(8, 96 // BLOCK)
    assert runner.decode_contexts is None
    got = generate(core, late=[11, 3])
    assert got == want
    assert graphs.steps > 10 and graphs.captured == 0  # eager on a CPU
    # as sequences finished and joined the batch moved between buckets
    assert len(graphs) >= 2


def test_which_steps_take_a_bucket(model_dirs: dict[str, Path]) -> None:
    core = make_core(model_dirs["llama"])
    graphs = core.runner.use_decode_graphs(4, 8)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, n in enumerate((5, 9, 2)):
        core.add_request(EngineRequest(f"r{i}", [7 + j for j in range(n)], params))
    first = core.scheduler.schedule()  # prefills
    assert graphs.bucket(first) is None
    core.runner.execute(first, {})
    core.scheduler.update_after_step(first)
    for s in first.scheduled:
        s.request.output_token_ids.append(5)
    decode = core.scheduler.schedule()
    assert graphs.bucket(decode) == FixedShape(num_seqs=3, num_blocks=3)  # 3 seqs, 3 blocks
    narrow = DecodeGraphs(lambda inputs: None, max_seqs=2, max_blocks=8, capture=False)
    assert narrow.bucket(decode) is None  # more sequences than the largest bucket
    short = DecodeGraphs(lambda inputs: None, max_seqs=4, max_blocks=2, capture=False)
    assert short.bucket(decode) is None  # a block table longer than the largest bucket
    fits = DecodeGraphs(lambda inputs: None, max_seqs=4, max_blocks=8, capture=False,
                        block_size=BLOCK, max_padded_tokens=3 * 3 * BLOCK)
    assert fits.bucket(decode) == FixedShape(3, 3)
    big = DecodeGraphs(lambda inputs: None, max_seqs=4, max_blocks=8, capture=False,
                       block_size=BLOCK, max_padded_tokens=3 * 3 * BLOCK - 1)
    assert big.bucket(decode) is None  # more padded context than graphs pay for
    core.shutdown()


def test_a_moe_model_caps_the_buckets_at_its_dense_batch(model_dirs: dict[str, Path]) -> None:
    runner: ModelRunner = make_core(model_dirs["qwen3_moe"]).runner
    for module in runner.model.modules():
        if hasattr(module, "dense_max_tokens"):
            module.dense_max_tokens = 16
    assert runner.use_decode_graphs(64, 8).max_seqs == 16  # beyond it the layer syncs


class Inputs:
    def __init__(self, value: int, num_samples: int = 1) -> None:
        self.value, self.num_samples = value, num_samples

    def copy_(self, other: Inputs) -> None:
        self.value, self.num_samples = other.value, other.num_samples


def test_buckets_keep_their_inputs_refresh_them_and_drop_the_oldest() -> None:
    seen: list[int] = []

    def forward(inputs: Inputs) -> torch.Tensor:
        seen.append(inputs.value)
        return torch.tensor([float(inputs.value)])

    graphs = DecodeGraphs(forward, max_seqs=8, max_blocks=8, capture=False, max_graphs=2)
    a, b, c = FixedShape(1, 1), FixedShape(2, 1), FixedShape(4, 1)
    first = Inputs(1)
    assert graphs.run(a, first).item() == 1.0
    assert graphs.run(a, Inputs(2)).item() == 2.0 and first.value == 2  # refreshed in place
    graphs.run(b, Inputs(3))
    graphs.run(a, Inputs(4))  # a is now the most recently used
    graphs.run(c, Inputs(5))  # over max_graphs: b goes
    assert len(graphs) == 2 and first.value == 4
    fresh = Inputs(6)
    graphs.run(b, fresh)  # b again: a new bucket keeps the new inputs
    assert seen == [1, 2, 3, 4, 5, 6] and graphs.steps == 6
    graphs.clear()
    assert len(graphs) == 0


def test_rebinding_the_kv_cache_drops_the_buckets(model_dirs: dict[str, Path]) -> None:
    core = make_core(model_dirs["llama"])
    runner: ModelRunner = core.runner
    graphs = runner.use_decode_graphs(8, 24)
    generate(core, late=[])
    assert len(graphs) > 0
    runner.bind_kv_cache(torch.zeros_like(runner.kv_cache))
    assert len(graphs) == 0
