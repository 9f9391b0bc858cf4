"""Staging: background host -> staging copy, its state machine, then D2D activation."""

from __future__ import annotations

import threading

import pytest
import torch

from substrate.arena import DeviceArena
from substrate.mover import TorchMover
from substrate.staging import Stager, StagingState


class GatedStager(Stager):
    """A CPU stager whose copy waits for a gate, so IN_PROGRESS can be observed."""

    def __init__(self, region: torch.Tensor) -> None:
        super().__init__(region)
        self.gate = threading.Event()

    def _cpu_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.gate.wait(timeout=10)
        super()._cpu_copy(dst, src)


def _bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_state_machine_and_staged_copy_equals_host_copy() -> None:
    arena = DeviceArena("cpu", 4096, 4096, 0)
    stager = GatedStager(arena.staging_region)
    assert stager.state is StagingState.NONE and stager.model is None
    assert stager.wait() is None
    host = _bytes(3000, 0)
    stager.start("b", host, 3000)
    assert stager.state is StagingState.IN_PROGRESS and stager.model == "b"
    assert not stager.is_ready("b")
    stager.gate.set()
    record = stager.wait()
    assert record is not None and record.kind == "stage" and record.bytes == 3000
    assert stager.state is StagingState.READY and stager.is_ready("b")
    assert torch.equal(arena.staging_region[:3000], host)

    arena.weight_region.zero_()
    d2d = TorchMover("cpu").activate_from_staging(arena.weight_region, arena.staging_region, 3000)
    assert d2d.kind == "activate_d2d" and d2d.bytes == 3000
    assert torch.equal(arena.weight_region[:3000], host)

    other = _bytes(4096, 1)
    stager.start("c", other, 4096)  # replaces b
    stager.wait()
    assert stager.is_ready("c") and not stager.is_ready("b")
    assert torch.equal(arena.staging_region, other)
    stager.invalidate()
    assert stager.state is StagingState.NONE and stager.model is None


def test_starting_while_in_progress_waits_for_the_first_copy() -> None:
    arena = DeviceArena("cpu", 0, 1024, 0)
    stager = GatedStager(arena.staging_region)
    first, second = _bytes(1024, 2), _bytes(512, 3)
    stager.start("a", first, 1024)
    stager.gate.set()
    stager.start("b", second, 512)
    stager.wait()
    assert stager.is_ready("b")
    assert torch.equal(arena.staging_region[:512], second)
    assert torch.equal(arena.staging_region[512:], first[512:])


def test_staging_errors() -> None:
    arena = DeviceArena("cpu", 0, 256, 0)
    stager = Stager(arena.staging_region)
    with pytest.raises(ValueError, match="do not fit the staging region of 256 bytes"):
        stager.start("big", _bytes(1024, 0), 1024)
    with pytest.raises(ValueError, match="asked from a 16-byte buffer"):
        stager.start("short", _bytes(16, 0), 64)
    two_d = torch.zeros(16, 16, dtype=torch.uint8)  # its first 256 rows do not fit a flat region
    stager.start("broken", two_d, 256)
    with pytest.raises(RuntimeError, match="staging copy failed"):
        stager.wait()
    assert stager.state is StagingState.NONE and stager.model is None
