"""The three multi-model engines (real, simulated, and the tests' fake) agree on what a switch
needs: no live request. An aborted request is finished even while its abort event is still to
be delivered: it never blocks a switch, and its event comes exactly once, with the next step,
after the switch too. A live request blocks the switch with the same error in all three."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from real_engine import LLAMA, QWEN, real_engine

from engine.interface import EngineRequest, FinishReason, MultiModelEngineProtocol, TokenEvent
from engine.sampling_params import SamplingParams
from engine.sim.engine import SimEngine, SimEngineConfig

SIM_A, SIM_B = "qwen3-235b-a22b", "glm-4.5-air"


def fake() -> tuple[MultiModelEngineProtocol, str, str]:
    return FakeEngine(["a", "b"], initial_model="a"), "a", "b"


def sim() -> tuple[MultiModelEngineProtocol, str, str]:
    engine = SimEngine([SIM_A, SIM_B], SimEngineConfig(), clock=lambda: 0.0)
    engine.activate(SIM_A)
    return engine, SIM_A, SIM_B


@pytest.fixture(params=["real", "sim", "fake"])
def engine_ab(
    request: pytest.FixtureRequest, tiny_models: dict[str, Path]
) -> tuple[MultiModelEngineProtocol, str, str]:
    builders: dict[str, Callable[[], tuple[MultiModelEngineProtocol, str, str]]] = {
        "real": lambda: (real_engine(tiny_models), LLAMA, QWEN),
        "sim": sim,
        "fake": fake,
    }
    return builders[request.param]()


def req(rid: str, model: str, n: int = 9) -> EngineRequest:
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, [(i * 5) % 400 + 1 for i in range(n)], params, model=model,
                         session_id=f"s-{rid}")


def drain(engine: MultiModelEngineProtocol) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    for _ in range(200):
        if not engine.has_unfinished():
            return events
        events += engine.step().events
    raise AssertionError("the engine never ran out of work")


@pytest.mark.parametrize("stepped", [True, False], ids=["running", "waiting"])
def test_an_aborted_request_does_not_block_a_switch_and_its_event_comes_once(
    engine_ab: tuple[MultiModelEngineProtocol, str, str], stepped: bool
) -> None:
    engine, a, b = engine_ab
    engine.add_request(req("r1", a))
    if stepped:
        assert not engine.step().events[-1].finished
    engine.abort("r1")
    assert engine.has_unfinished()  # its abort event is not delivered yet
    engine.activate(b)  # the switch the admission loop makes once it has ended the call
    assert engine.active_model == b
    events = drain(engine)
    assert [(e.request_id, e.finished, e.finish_reason) for e in events] == [
        ("r1", True, FinishReason.ABORT)
    ]
    engine.add_request(req("r2", b))
    done = [e for e in drain(engine) if e.finished]
    assert [(e.request_id, e.finish_reason) for e in done] == [("r2", FinishReason.LENGTH)]


def test_a_live_request_blocks_a_switch_with_the_same_error(
    engine_ab: tuple[MultiModelEngineProtocol, str, str],
) -> None:
    engine, a, b = engine_ab
    engine.add_request(req("r1", a))
    engine.step()
    with pytest.raises(RuntimeError, match=rf"cannot activate '{b}': 1 requests of '{a}'"):
        engine.activate(b)
    assert engine.active_model == a
    engine.abort("r1")
    engine.activate(b)
    assert engine.active_model == b


def test_a_forgotten_session_is_no_longer_reported(
    engine_ab: tuple[MultiModelEngineProtocol, str, str],
) -> None:
    engine, a, _ = engine_ab
    engine.add_request(req("r1", a, n=24))
    drain(engine)
    assert engine.session_kv_tokens("s-r1")[0] > 0
    engine.forget_session("s-r1")
    assert engine.session_kv_tokens("s-r1") == (0, 0)
    assert engine.pin_session_kv("s-r1") == 0
