"""Builders shared by the simulated engine's tests: the default models, a settable clock,
an engine, a request, token ids, and draining an engine to its events."""

from __future__ import annotations

from engine.interface import EngineRequest, StepResult, TokenEvent
from engine.sampling_params import SamplingParams
from engine.sim.cost_model import CostModel
from engine.sim.engine import SimEngine, SimEngineConfig
from engine.sim.model_spec import ModelSpec
from substrate.devices import server_preset

QWEN = "qwen3-235b-a22b"
GLM = "glm-4.5-air"
MISTRAL = "mistral-large-2407"
BS = 64


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(models: tuple[str, ...] = (QWEN, GLM), clock: Clock | None = None, **cfg) -> SimEngine:
    return SimEngine(list(models), SimEngineConfig(**cfg), clock or Clock())


def cost(model: str = QWEN) -> CostModel:
    return CostModel(server_preset("h200x8"), ModelSpec.load(model), 8)


def req(rid: str, prompt: list[int], max_tokens: int = 4, model: str = QWEN,
        session: str | None = None) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), model=model,
                         session_id=session)


def tokens(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 150_000 + 1 for i in range(n)]


def drain(engine: SimEngine) -> tuple[list[StepResult], dict[str, list[TokenEvent]]]:
    steps: list[StepResult] = []
    events: dict[str, list[TokenEvent]] = {}
    while engine.has_unfinished():
        step = engine.step()
        steps.append(step)
        for ev in step.events:
            events.setdefault(ev.request_id, []).append(ev)
    return steps, events


def output(events: list[TokenEvent]) -> list[int]:
    return [t for ev in events for t in ev.new_token_ids]
