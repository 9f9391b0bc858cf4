"""Host weight store: each model's per-rank shard, loaded once, as one flat host buffer.

The buffer has the model's ``WeightLayout``, the same layout as the device weight region, so
activating the model (or staging it) is one flat copy. Buffers are pinned when CUDA is
present, so those copies run at full host-link speed and can be asynchronous.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from substrate.layout import WeightLayout

FillFn = Callable[[dict[str, torch.Tensor]], None]


@dataclass
class HostModel:
    name: str
    layout: WeightLayout
    buffer: torch.Tensor  # flat uint8, layout.total_bytes long

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    def views(self) -> dict[str, torch.Tensor]:
        return self.layout.views(self.buffer)


class HostWeightStore:
    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._models: dict[str, HostModel] = {}

    def add_model(self, name: str, layout: WeightLayout, fill: FillFn) -> int:
        """Allocate the model's host buffer and let ``fill`` write every tensor into the
        views it is given (name -> typed view in the layout; e.g. the engine's per-parameter
        weight loaders reading this rank's shard from safetensors). Returns its bytes.
        The buffer is zeroed first, so a tensor ``fill`` skips reads as zeros."""
        if name in self._models:
            raise ValueError(f"model {name!r} is already in the host weight store")
        buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, pin_memory=self.pin)
        model = HostModel(name, layout, buffer)
        fill(model.views())
        self._models[name] = model
        return model.nbytes

    def add_model_from_tensors(
        self, name: str, layout: WeightLayout, tensors: dict[str, torch.Tensor]
    ) -> int:
        """Add a model from complete tensors (each copied into its view); every tensor of
        the layout must be given, with its shape, and no others."""
        missing = [spec.name for spec in layout if spec.name not in tensors]
        extra = [key for key in tensors if key not in layout]
        if missing or extra:
            raise ValueError(
                f"model {name!r}: tensors missing from the input {missing[:5]}, "
                f"not in the layout {extra[:5]}"
            )

        def fill(views: dict[str, torch.Tensor]) -> None:
            for key, view in views.items():
                src = tensors[key]
                if tuple(src.shape) != tuple(view.shape):
                    raise ValueError(
                        f"model {name!r}: tensor {key!r} has shape {tuple(src.shape)}, "
                        f"the layout says {tuple(view.shape)}"
                    )
                view.copy_(src)

        return self.add_model(name, layout, fill)

    def remove_model(self, name: str) -> None:
        self.get(name)
        del self._models[name]

    def get(self, name: str) -> HostModel:
        try:
            return self._models[name]
        except KeyError:
            raise KeyError(f"model {name!r} is not in the host weight store") from None

    def __contains__(self, name: object) -> bool:
        return name in self._models

    @property
    def models(self) -> list[str]:
        return list(self._models)

    def nbytes(self, name: str) -> int:
        return self.get(name).nbytes

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self._models.values())
