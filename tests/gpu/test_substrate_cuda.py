"""Substrate on a real GPU: pinned host buffers, side-stream staging, D2D activation, KV
offload/restore through device scratch. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from substrate.arena import DeviceArena
from substrate.host_kv import HostKVStore
from substrate.host_weights import HostWeightStore
from substrate.layout import TensorSpec, WeightLayout
from substrate.mover import TorchMover
from substrate.staging import Stager, StagingState
from talaria.bench.substrate import bench_switch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_pinned_store_staging_and_d2d_activation_keep_addresses() -> None:
    layout = WeightLayout(
        [TensorSpec("w", (1 << 20,), torch.bfloat16), TensorSpec("b", (7,), torch.float32)]
    )
    hosts = HostWeightStore()
    assert hosts.pin
    hosts.add_model("a", layout, lambda views: [v.normal_() for v in views.values()])
    hosts.add_model("b", layout, lambda views: [v.normal_() for v in views.values()])
    assert hosts.get("a").buffer.is_pinned()
    arena = DeviceArena.for_layouts("cuda", [layout], kv_bytes=1 << 20)
    views = arena.weight_views(layout)
    ptr = views["w"].data_ptr()
    mover, stager = TorchMover("cuda"), Stager(arena.staging_region)

    mover.activate_from_host(arena.weight_region, hosts.get("a").buffer, layout.total_bytes)
    stager.start("b", hosts.get("b").buffer, layout.total_bytes)
    assert stager.state in (StagingState.IN_PROGRESS, StagingState.READY)
    record = stager.wait()
    assert record is not None and record.bytes == layout.total_bytes and record.seconds > 0
    assert stager.state is StagingState.READY
    assert torch.equal(views["w"].cpu(), hosts.get("a").views()["w"])  # a still active
    mover.activate_from_staging(arena.weight_region, arena.staging_region, layout.total_bytes)
    assert torch.equal(views["w"].cpu(), hosts.get("b").views()["w"])
    assert arena.weight_views(layout)["w"].data_ptr() == ptr


def test_kv_offload_and_restore_on_gpu() -> None:
    arena = DeviceArena("cuda", 0, 0, 1 << 22)
    kv = arena.kv_cache(3, 16, 16, 2, 64, torch.bfloat16)
    kv.normal_()
    expected = kv[:, :, [3, 9]].cpu()
    store = HostKVStore(capacity_bytes=1 << 22, kv_chunk_bytes=1)
    store.save("m", [1, 2], [3, 9], kv)
    kv.zero_()
    store.load("m", [1, 2], [0, 15], kv)
    assert torch.equal(kv[:, :, [0, 15]].cpu(), expected)


def test_bench_switch_on_gpu() -> None:
    result = bench_switch(64 << 20, "cuda", repeats=2)
    assert result["pinned"] is True
