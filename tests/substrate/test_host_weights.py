"""Host weight store: one flat buffer per model in the arena's layout; activation = one copy."""

from __future__ import annotations

import pytest
import torch
from substrate_testing import TinyLM, state_of

from substrate.arena import DeviceArena
from substrate.host_weights import HostWeightStore
from substrate.layout import WeightLayout
from substrate.mover import TorchMover


def test_round_trip_through_the_store_and_one_flat_copy() -> None:
    torch.manual_seed(1)
    ref = TinyLM()
    weights = state_of(ref)
    layout = WeightLayout.from_module(ref)
    store = HostWeightStore()
    seen: list[str] = []

    def fill(views: dict[str, torch.Tensor]) -> None:
        for name, view in views.items():
            seen.append(name)
            view.copy_(weights[name])

    assert store.add_model("tiny", layout, fill) == layout.total_bytes
    assert seen == [s.name for s in layout]
    assert store.models == ["tiny"] and store.total_bytes == layout.total_bytes
    host = store.get("tiny")
    assert host.buffer.dtype == torch.uint8 and host.buffer.numel() == layout.total_bytes
    for name, view in host.views().items():
        assert torch.equal(view, weights[name])

    with torch.device("meta"):
        model = TinyLM()
    arena = DeviceArena.for_layouts("cpu", [layout], kv_bytes=0)
    arena.bind_module(model, layout)
    record = TorchMover("cpu").activate_from_host(arena.weight_region, host.buffer, host.nbytes)
    assert record.bytes == layout.total_bytes
    ids = torch.tensor([[0, 3, 9]])
    torch.testing.assert_close(model(ids), ref(ids))


def test_add_from_tensors_checks_names_and_shapes() -> None:
    ref = TinyLM()
    layout = WeightLayout.from_module(ref)
    weights = state_of(ref)
    store = HostWeightStore(pin=False)
    store.add_model_from_tensors("a", layout, weights)
    with pytest.raises(ValueError, match="already in the host weight store"):
        store.add_model_from_tensors("a", layout, weights)
    with pytest.raises(ValueError, match=r"missing from the input \['scale'\]"):
        store.add_model_from_tensors(
            "b", layout, {k: v for k, v in weights.items() if k != "scale"}
        )
    bad = dict(weights, scale=torch.zeros(3))
    with pytest.raises(ValueError, match="'scale' has shape"):
        store.add_model_from_tensors("c", layout, bad)
    assert "c" not in store
    store.remove_model("a")
    with pytest.raises(KeyError, match="not in the host weight store"):
        store.get("a")
