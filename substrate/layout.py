"""Byte layout of a model's weights: ordered tensors at aligned offsets of one flat buffer.

The same layout describes a model's slice of the device weight region, its staging copy and
its host weight-store buffer, so moving a whole model is one flat byte copy between them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

ALIGNMENT = 256  # bytes; every tensor starts at a multiple of this


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """Round ``nbytes`` up to a multiple of ``alignment``."""
    return (nbytes + alignment - 1) // alignment * alignment


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def view_bytes(
    region: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A typed view of ``shape``/``dtype`` at byte ``offset`` of a flat uint8 ``region``."""
    nbytes = math.prod(shape) * dtype_size(dtype)
    if offset < 0 or offset + nbytes > region.numel():
        raise ValueError(
            f"view of {nbytes} bytes at offset {offset} exceeds a region of {region.numel()} bytes"
        )
    return region[offset : offset + nbytes].view(dtype).view(shape)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)


class WeightLayout:
    """Ordered tensor specs, each at an ``ALIGNMENT``-aligned byte offset; ``total_bytes``
    is the end of the last tensor rounded up to the alignment."""

    def __init__(self, specs: Iterable[TensorSpec]) -> None:
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self.offsets: dict[str, int] = {}
        offset = 0
        for spec in self.specs:
            if spec.name in self.offsets:
                raise ValueError(f"duplicate tensor name {spec.name!r} in weight layout")
            self.offsets[spec.name] = offset
            offset = align_up(offset + spec.nbytes)
        self.total_bytes: int = offset
        self._by_name = {spec.name: spec for spec in self.specs}

    @classmethod
    def from_module(cls, module: nn.Module, include_buffers: bool = True) -> WeightLayout:
        """Layout of a module's parameters (tied ones once), then its buffers if asked.

        Works on a module built on the meta device: only shapes and dtypes are read.
        """
        specs = [TensorSpec(name, tuple(p.shape), p.dtype) for name, p in module.named_parameters()]
        if include_buffers:
            specs += [
                TensorSpec(name, tuple(b.shape), b.dtype) for name, b in module.named_buffers()
            ]
        return cls(specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.specs)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WeightLayout) and self.specs == other.specs

    def __hash__(self) -> int:
        return hash(self.specs)

    def __repr__(self) -> str:
        return f"WeightLayout({len(self.specs)} tensors, {self.total_bytes} bytes)"

    def spec(self, name: str) -> TensorSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the weight layout") from None

    def views(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of every tensor over a flat uint8 ``region`` of at least
        ``total_bytes`` bytes (the weight region, a staging copy or a host buffer)."""
        if region.dtype != torch.uint8 or region.dim() != 1:
            raise ValueError(
                f"a layout views a flat uint8 region, got {region.dtype} {tuple(region.shape)}"
            )
        if region.numel() < self.total_bytes:
            raise ValueError(
                f"region of {region.numel()} bytes is smaller than the layout's {self.total_bytes} bytes"
            )
        return {
            spec.name: view_bytes(region, self.offsets[spec.name], spec.shape, spec.dtype)
            for spec in self.specs
        }
