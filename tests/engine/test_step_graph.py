"""A decode step that CUDA graphs could capture, checked on the CPU.

The guard (``engine.graphs.sync_guard``) is shown to catch each kind of host synchronisation; then
the fixed-shape decode step of every architecture runs under it on meta tensors (where any
read of data fails too), and on real tensors gives the eager step's logits and KV writes.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, EngineCore, SamplingParams
from engine.attention.metadata import FixedShape
from engine.attention.torch_paged import TorchPagedAttention
from engine.graphs.sync_guard import HostSyncError, no_host_sync
from engine.interface import EngineRequest
from engine.layers.moe import SparseMoE
from engine.model_runner import ModelRunner
from engine.models.registry import build_model
from engine.models.tiny import ARCHS, write_random_checkpoint
from engine.parallel_context import SINGLE
from engine.scheduler import SchedulerOutput

BLOCK = 4
BUCKET = FixedShape(num_seqs=8, num_blocks=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: write_random_checkpoint(root / arch, arch, seed=2) for arch in ARCHS}


def to_meta(obj: Any) -> Any:
    """The same structure with every tensor replaced by a meta tensor of its shape."""
    if isinstance(obj, torch.Tensor):
        return obj.to("meta")
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: to_meta(getattr(obj, f.name)) for f in fields(obj)})
    if isinstance(obj, list):
        return [to_meta(x) for x in obj]
    return obj


def decoding_core(path: Path, prompt_lens: list[int]) -> tuple[EngineCore, SchedulerOutput]:
    """A core whose requests have all prefilled, and its next (decode-only) schedule."""
    config = EngineConfig(
        model=path, max_model_len=64, num_kv_blocks=64, block_size=BLOCK, device="cpu"
    )
    core = EngineCore(config)
    for i, n in enumerate(prompt_lens):
        core.add_request(EngineRequest(f"r{i}", [(7 * i + j) % 200 + 3 for j in range(n)], GREEDY))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()
    core.step()
    out = core.scheduler.schedule()
    assert out.scheduled and all(s.num_new_tokens == 1 for s in out.scheduled)
    return core, out


def test_guard_catches_each_kind_of_host_sync() -> None:
    x = torch.arange(6.0)
    syncing = {
        "item": lambda: x[0].item(),
        "int": lambda: int(x[1]),
        "bool": lambda: bool(x[1] > 0),
        "nonzero": lambda: x.nonzero(),
        "bool mask": lambda: x[x > 2],
        "where(cond)": lambda: torch.where(x > 2),
        "unique": lambda: torch.unique(x),
        "repeat_interleave(tensor)": lambda: torch.repeat_interleave(x, x.long()),
        "tensor from host data": lambda: torch.tensor([1, 2]),
        "equal": lambda: torch.equal(x, x),
    }
    for name, fn in syncing.items():
        with pytest.raises(HostSyncError), no_host_sync():
            fn()
            pytest.fail(f"{name} was not caught")
        fn()  # outside the guard it runs
    meta = x.to("meta")
    for read in (meta.tolist, meta.numpy):  # no op the guard sees: meta tensors catch them
        with pytest.raises((NotImplementedError, RuntimeError, TypeError)):
            read()
    with no_host_sync():  # fixed-shape work passes
        idx = torch.arange(3)
        y = x.index_select(0, idx).masked_fill(idx > 0, 0.0) @ torch.ones(3)
        torch.repeat_interleave(x, 2)
    assert y.shape == ()


@pytest.mark.parametrize("arch", ARCHS)
def test_fixed_shape_decode_step_syncs_nothing_and_matches_eager(
    arch: str, model_dirs: dict[str, Path]
) -> None:
    core, out = decoding_core(model_dirs[arch], [5, 11, 2])
    runner: ModelRunner = core.runner
    eager = runner.prepare(out)
    fixed = runner.prepare(out, BUCKET)
    assert fixed.input_ids.shape == (BUCKET.num_seqs,) and fixed.num_samples == 3
    assert fixed.attn.block_tables.shape == (BUCKET.num_seqs, BUCKET.num_blocks)

    kv_before = runner.kv_cache.clone()
    with torch.inference_mode():
        want = runner.forward_step(eager)
        kv_eager = runner.kv_cache.clone()
        runner.kv_cache.copy_(kv_before)
        with no_host_sync():
            got = runner.forward_step(fixed)
    assert want is not None and got is not None and got.shape[0] == BUCKET.num_seqs
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        runner.kv_cache, kv_eager, atol=1e-6, rtol=0
    )  # padding left no trace

    with torch.device("meta"):
        meta_model = build_model(runner.hf_config, runner.dtype, SINGLE, TorchPagedAttention())
    meta_runner = ModelRunner(
        meta_model,
        num_blocks=runner.num_blocks,
        block_size=BLOCK,
        vocab_size=runner.vocab_size,
        device=torch.device("cpu"),
        dtype=runner.dtype,
        kv_cache=runner.kv_cache.to("meta"),
    )
    with torch.inference_mode(), no_host_sync():
        logits = meta_runner.forward_step(to_meta(fixed))
    assert logits is not None and logits.shape == (BUCKET.num_seqs, runner.vocab_size)


def test_guard_catches_the_sparse_moe_path(model_dirs: dict[str, Path]) -> None:
    """Above ``dense_max_tokens`` the MoE layer lists the picked experts on the host."""
    core, out = decoding_core(model_dirs["qwen3_moe"], [5, 11, 2])
    runner: ModelRunner = core.runner
    inputs = runner.prepare(out, BUCKET)
    for module in runner.model.modules():
        if isinstance(module, SparseMoE):
            module.dense_max_tokens = 0
    with torch.inference_mode(), pytest.raises(HostSyncError), no_host_sync():
        runner.forward_step(inputs)


def test_static_inputs_refreshed_in_place_give_the_new_steps_result(
    model_dirs: dict[str, Path],
) -> None:
    """What a graph replay does: copy a new step's inputs into the captured ones."""
    core, first = decoding_core(model_dirs["llama"], [3, 9])
    runner: ModelRunner = core.runner
    static = runner.prepare(first, BUCKET)
    core.scheduler.update_after_step(first)
    for s in first.scheduled:
        s.request.output_token_ids.append(5)
    second = core.scheduler.schedule()
    fresh = runner.prepare(second, BUCKET)
    kv_before = runner.kv_cache.clone()
    with torch.inference_mode():
        want = runner.forward_step(fresh)
        runner.kv_cache.copy_(kv_before)
        static.copy_(fresh)
        got = runner.forward_step(static)
    assert want is not None and got is not None
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(static.positions, fresh.positions)
    other = runner.prepare(second, FixedShape(num_seqs=4, num_blocks=16))
    with pytest.raises(ValueError, match="cannot copy"):
        static.copy_(other)


def test_fixed_shapes_reject_batches_that_do_not_fit(model_dirs: dict[str, Path]) -> None:
    core, out = decoding_core(model_dirs["llama"], [5, 11, 2])
    runner: ModelRunner = core.runner
    with pytest.raises(ValueError, match="exceed the bucket of 2"):
        runner.prepare(out, FixedShape(num_seqs=2, num_blocks=16))
    with pytest.raises(ValueError, match="exceeds the bucket's 2"):
        runner.prepare(out, FixedShape(num_seqs=8, num_blocks=2))
    prefill = SchedulerOutput(scheduled=[replace(out.scheduled[0], num_new_tokens=2)])
    prefill.scheduled[0].num_computed_tokens -= 1
    with pytest.raises(ValueError, match="decode-only"):
        runner.prepare(prefill, BUCKET)


@pytest.mark.parametrize("renormalize", [True, False])
def test_dense_and_sparse_moe_paths_agree(renormalize: bool) -> None:
    torch.manual_seed(0)
    moe = SparseMoE(8, 2, 32, 16, renormalize, SINGLE, torch.float32)
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(12, 32)
    moe.dense_max_tokens = 12
    dense = moe(x)
    moe.dense_max_tokens = 11
    sparse = moe(x)
    torch.testing.assert_close(dense, sparse, atol=1e-5, rtol=1e-5)
    assert dense.abs().mean() > 1e-2
