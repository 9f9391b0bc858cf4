"""The device arena: one allocation per rank, made once, carved into three fixed regions.

    [ weight region | KV region | staging region ]

Invariant: the arena's storage is never freed or reallocated while the process lives. The
active model's parameters are views at fixed offsets of the weight region (activating another
model copies its bytes into the same region), and each model's KV cache is one tensor viewing
the start of the KV region with that model's shapes, so every address a captured CUDA graph
holds stays valid.

The staging region follows the KV region so that a slot may *lend* it to the KV cache: the
model's lent KV cache views both (``kv_cache(..., lent=True)``), from the same base address,
with more blocks. Its layers and V halves sit at other offsets than in the plain view, so a
captured graph is valid for one of the two views: capture per (model, lent). Nothing may be
staged while it is lent; the owner (``InstanceMemory``) decides at each activation, when
the KV region is dropped anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from substrate.layout import WeightLayout, align_up, dtype_size, view_bytes


class ArenaAllocationError(ValueError):
    """The arena's one allocation failed (more memory than the device has); names the sizes."""


class DeviceArena:
    def __init__(
        self, device: torch.device | str, weight_bytes: int, staging_bytes: int, kv_bytes: int
    ) -> None:
        for label, size in (("weight", weight_bytes), ("staging", staging_bytes), ("kv", kv_bytes)):
            if size < 0:
                raise ValueError(f"{label} region size must be >= 0, got {size}")
        self.device = torch.device(device)
        self.weight_bytes = align_up(weight_bytes)
        self.staging_bytes = align_up(staging_bytes)
        self.kv_bytes = align_up(kv_bytes)
        total = self.weight_bytes + self.staging_bytes + self.kv_bytes
        try:
            self.buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # torch.OutOfMemoryError, the CPU allocator's, a bad device
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ArenaAllocationError(
                f"the device arena ({total} bytes: weights {self.weight_bytes}, KV "
                f"{self.kv_bytes}, staging {self.staging_bytes}) cannot be allocated on "
                f"{self.device}: {reason}"
            ) from exc
        w, k = self.weight_bytes, self.weight_bytes + self.kv_bytes
        self.weight_region = self.buffer[:w]
        self.kv_region = self.buffer[w:k]
        self.staging_region = self.buffer[k:]
        self.lendable_kv_region = self.buffer[w:]  # the KV region and the staging region
        self.kv_region.zero_()  # KV slots always hold finite values (see clear_kv)

    def clear_kv(self, lent: bool = False) -> None:
        """Zero the KV region (``lent``: and the staging region lent to it). Attention
        backends may read (and mask out) slots no token wrote; zeros are finite in every
        dtype, whereas bytes left by another model's shapes (or weights) may read as NaN,
        which a mask cannot cancel."""
        (self.lendable_kv_region if lent else self.kv_region).zero_()

    @classmethod
    def for_layouts(
        cls,
        device: torch.device | str,
        layouts: Sequence[WeightLayout],
        kv_bytes: int,
        staging: bool = True,
    ) -> DeviceArena:
        """An arena whose weight region (and staging region, if ``staging``) fits the
        largest of ``layouts``."""
        largest = max((layout.total_bytes for layout in layouts), default=0)
        return cls(device, largest, largest if staging else 0, kv_bytes)

    @property
    def total_bytes(self) -> int:
        return self.buffer.numel()

    @property
    def staging_enabled(self) -> bool:
        return self.staging_bytes > 0

    def check_fits(self, layout: WeightLayout, model: str = "model") -> None:
        """Raise if ``layout`` does not fit the weight region, naming both sizes."""
        if layout.total_bytes > self.weight_bytes:
            raise ValueError(
                f"{model}: weight shard of {layout.total_bytes} bytes "
                f"({layout.total_bytes / 2**30:.3f} GiB) does not fit the weight region of "
                f"{self.weight_bytes} bytes ({self.weight_bytes / 2**30:.3f} GiB)"
            )

    def check_stageable(self, layout: WeightLayout, model: str = "model") -> None:
        if layout.total_bytes > self.staging_bytes:
            raise ValueError(
                f"{model}: weight shard of {layout.total_bytes} bytes does not fit the staging "
                f"region of {self.staging_bytes} bytes"
            )

    def weight_views(self, layout: WeightLayout) -> dict[str, torch.Tensor]:
        self.check_fits(layout)
        return layout.views(self.weight_region)

    def bind_module(self, module: nn.Module, layout: WeightLayout) -> None:
        """Make every parameter and buffer of ``module`` named in ``layout`` a view of the
        weight region (tied parameters stay tied). The module may live on the meta device;
        its tensors' contents are not copied (fill the weight region separately).
        Buffers absent from the layout are left as they are. Parameters become
        ``requires_grad=False`` (inference only)."""
        self.check_fits(layout)
        views = layout.views(self.weight_region)
        names = {id(p): name for name, p in module.named_parameters()}
        names.update({id(b): name for name, b in module.named_buffers()})
        missing = [name for name, _ in module.named_parameters() if name not in layout]
        if missing:
            raise ValueError(f"module parameters missing from the weight layout: {missing[:5]}")
        replaced: dict[int, nn.Parameter] = {}
        for owner in module.modules():
            for attr, param in list(owner._parameters.items()):
                if param is None:
                    continue
                name = names[id(param)]
                view = views[name]
                _check_same(name, tuple(param.shape), param.dtype, view)
                if id(param) not in replaced:
                    replaced[id(param)] = nn.Parameter(view, requires_grad=False)
                owner._parameters[attr] = replaced[id(param)]
            for attr, buf in list(owner._buffers.items()):
                if buf is None or names.get(id(buf)) not in layout:
                    continue
                name = names[id(buf)]
                _check_same(name, tuple(buf.shape), buf.dtype, views[name])
                owner._buffers[attr] = views[name]

    def kv_num_blocks(
        self,
        num_layers: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        lent: bool = False,
    ) -> int:
        """How many KV blocks of these shapes fit the KV region (``lent``: with the staging
        region lent to it)."""
        per_block = 2 * num_layers * block_size * kv_heads * head_dim * dtype_size(dtype)
        if per_block <= 0:
            raise ValueError(
                f"invalid KV shapes: layers={num_layers} block_size={block_size} "
                f"kv_heads={kv_heads} head_dim={head_dim}"
            )
        region = self.kv_bytes + (self.staging_bytes if lent else 0)
        return region // per_block

    def kv_cache(
        self,
        num_layers: int,
        num_blocks: int | None,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        lent: bool = False,
    ) -> torch.Tensor:
        """One model's KV cache, a view at the start of the KV region of shape
        ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (K at ``[l, 0]``, V at
        ``[l, 1]``). ``num_blocks=None`` takes as many as fit; ``lent``: the view spans the
        staging region too."""
        fit = self.kv_num_blocks(num_layers, block_size, kv_heads, head_dim, dtype, lent)
        region = self.kv_bytes + (self.staging_bytes if lent else 0)
        if num_blocks is None:
            num_blocks = fit
        if num_blocks > fit:
            need = (
                2 * num_layers * num_blocks * block_size * kv_heads * head_dim * dtype_size(dtype)
            )
            raise ValueError(
                f"{num_blocks} KV blocks ({need} bytes for {num_layers} layers) do not fit the "
                f"KV region of {region} bytes; at most {fit} blocks fit"
            )
        if num_blocks <= 0:
            raise ValueError(
                f"the KV region of {region} bytes holds no KV block of these shapes"
            )
        shape = (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
        return view_bytes(self.lendable_kv_region if lent else self.kv_region, 0, shape, dtype)


def _check_same(name: str, shape: tuple[int, ...], dtype: torch.dtype, view: torch.Tensor) -> None:
    if shape != tuple(view.shape) or dtype != view.dtype:
        raise ValueError(
            f"tensor {name!r} is {dtype} {shape} in the module but {view.dtype} "
            f"{tuple(view.shape)} in the layout"
        )
