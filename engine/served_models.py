"""The models a multi-model engine serves, as every such engine keeps them (torch-free).

Which models, each one's limits, which one is active, and the checks a request and a switch
must pass. The live multi-model engine, the simulated engine and test doubles each keep one
``ServedModels``, so they refuse the same requests and the same switches with the same errors
and the admission loop can rely on one set of preconditions.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

from engine.interface import EngineRequest, ModelLimits
from engine.request import validate_prompt

__all__ = ["ModelNotActiveError", "ServedModels", "ServesModels"]


class ModelNotActiveError(ValueError):
    """A request named a model that is not the active one (or none is active)."""


class ServedModels:
    """A catalog of models, one active at a time. ``active`` is set by the engine after a
    successful switch; every check raises, naming the request or model, and changes nothing."""

    def __init__(self, limits: Mapping[str, ModelLimits]) -> None:
        if not limits:
            raise ValueError("the catalog must name at least one model")
        self.limits = dict(limits)
        self.active: str | None = None

    @property
    def names(self) -> list[str]:
        return list(self.limits)

    def check_model(self, model: str) -> str:
        if model not in self.limits:
            raise ValueError(f"unknown model {model!r}; this engine serves {sorted(self.limits)}")
        return model

    def check_request(
        self, request: EngineRequest, in_use: Container[str], checked_prefix: int = 0
    ) -> str:
        """The model ``request`` runs on, after every check a request must pass: its model
        (None: the only one) is known and active, its id is not in use, its prompt fits.
        ``checked_prefix`` leading prompt tokens are known to be valid already."""
        model = self.resolve_model(request)
        rid = request.request_id
        if rid in in_use:
            raise ValueError(f"request id {rid!r} is already in use")
        limits = self.limits[model]
        validate_prompt(
            rid, request.prompt_token_ids, limits.max_model_len, limits.vocab_size, checked_prefix
        )
        return model

    def resolve_model(self, request: EngineRequest) -> str:
        """The request's model (None: the only one), which must be known and active."""
        rid = request.request_id
        model = request.model
        if model is None and len(self.limits) == 1:
            model = next(iter(self.limits))
        if model is None:
            raise ModelNotActiveError(
                f"request {rid!r} names no model; this engine serves {', '.join(self.limits)}"
            )
        self.check_model(model)
        if model != self.active:
            raise ModelNotActiveError(
                f"request {rid!r} is for model {model!r}, but the active model is "
                f"{self.active!r}; activate {model!r} first"
            )
        return model

    def check_activation(self, model: str, unfinished: int) -> None:
        """A switch to ``model`` needs no unfinished request of the outgoing model.
        ``unfinished`` counts live requests: added and neither finished nor aborted. An
        aborted request whose event is not delivered yet is finished (its blocks are free):
        it never blocks a switch, and its event still comes with the engine's next step."""
        self.check_model(model)
        if unfinished and model != self.active:
            raise RuntimeError(
                f"cannot activate {model!r}: {unfinished} requests of {self.active!r} are "
                "unfinished"
            )


class ServesModels:
    """The catalog face of a multi-model engine (``MultiModelEngineProtocol``'s
    ``model_names``, ``active_model``, ``model_limits``), read from its ``served``."""

    served: ServedModels

    @property
    def model_names(self) -> list[str]:
        return self.served.names

    @property
    def active_model(self) -> str | None:
        return self.served.active

    def model_limits(self) -> dict[str, ModelLimits]:
        return dict(self.served.limits)
