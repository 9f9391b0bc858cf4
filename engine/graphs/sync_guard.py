"""A guard that fails on host synchronisation: checks, on a CPU, that code could be captured
in a CUDA graph.

Inside ``no_host_sync()``, an op that needs device data on the host raises
``HostSyncError``: reading a value (``.item()``, ``int()``/``float()``/``bool()`` of a
tensor: ``aten._local_scalar_dense``, ``equal``, ``is_nonzero``, ``allclose``), an output
shape that depends on the data (``nonzero``, ``masked_select``, ``unique``, ``bincount``,
indexing with a boolean mask, ``repeat_interleave`` without ``output_size``), and a tensor
made from host data inside the guarded code (``torch.tensor``: ``lift_fresh``), which a
captured graph would freeze. ``.tolist()`` and ``.numpy()`` of a CPU tensor read its memory
without any op: run the guarded code on meta tensors too, where every read of data raises.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_SYNC_PACKETS = frozenset(
    getattr(aten, name)
    for name in (
        "_local_scalar_dense",
        "equal",
        "is_nonzero",
        "allclose",
        "nonzero",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "bincount",
        "lift_fresh",
        "lift_fresh_copy",
    )
    if hasattr(aten, name)
)
_INDEXING = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})


class HostSyncError(RuntimeError):
    """Guarded code did something that synchronises with the host."""


def _has_bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )


class no_host_sync(TorchDispatchMode):  # noqa: N801 (used as a context manager, like no_grad)
    """``with no_host_sync(): ...`` raises ``HostSyncError`` at the first syncing op."""

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        syncs = packet in _SYNC_PACKETS
        syncs |= packet in _INDEXING and _has_bool_index(args)
        syncs |= (
            packet is aten.repeat_interleave
            and func._overloadname != "self_int"
            and kwargs.get("output_size") is None
        )
        if syncs:
            raise HostSyncError(
                f"{func} synchronises with the host (or has a data-dependent shape)"
            )
        return func(*args, **kwargs)
