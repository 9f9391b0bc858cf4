"""A randomized state machine (hypothesis) over an instance on the real multi-model engine (two
tiny models, CPU): calls submitted for either model (so the loop switches models, offloads the
outgoing model's KV to host and restores it when a session returns), calls aborted by their
client, clients that leave while their call waits, sessions the router lets go, and time
passing (reservations expire).

After every step the admission loop is alive and healthy, and the state report's sessions,
kept as they change and sent as deltas, are what a rebuild from the session books gives (as
the report was built before it was kept incrementally). At the end every call has ended
with exactly one terminal event, no KV block is left referenced once the instance stops, and
the host KV store's byte count equals the sum of what it holds, within its capacity."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from real_engine import LLAMA, QWEN, real_engine

from engine.sampling_params import SamplingParams
from talaria.instance.calls import CallHandle
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.protocol import CallEvent, CallRequest, SessionKV
from talaria.protocol.state_delta import SessionsCursor, encode_report

MODELS = [LLAMA, QWEN]


class InstanceMachine(RuleBasedStateMachine):
    models: dict[str, Path] = {}

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.engine = real_engine(self.models, initial=LLAMA)
        policy = PolicyConfig(slot_quantum_s=0.05, reservation_ttl_s=0.15, default_gap_s=0.05,
                              state_refresh_s=0.05, max_running_calls=4)
        self.inst = Instance("sm", self.engine, policy)
        self.loop.run_until_complete(self.inst.start())
        self.prompts: dict[str, list[int]] = {}  # session -> its last prompt
        self.handles: dict[str, CallHandle] = {}
        self.events: dict[str, list[CallEvent]] = {}
        self.collectors: list[asyncio.Task[None]] = []
        self.n = 0
        self.cursor = SessionsCursor()  # a router's copy of the sessions, by deltas

    @initialize()
    def one_session_per_model(self) -> None:
        """A session of each model has run here (the second call switched models, so the
        first session's KV went to host): from here on, returns restore it."""
        for model in MODELS:
            self.submit(model, 0, 20, 3)
            self.loop.run_until_complete(asyncio.gather(self.collectors[-1]))

    def _collect(self, call_id: str, handle: CallHandle) -> None:
        async def run() -> None:
            async for event in handle:
                self.events[call_id].append(event)

        self.events[call_id] = []
        self.collectors.append(self.loop.create_task(run()))

    @rule(model=st.sampled_from(MODELS), session=st.integers(0, 2),
          grow=st.integers(1, 24), max_tokens=st.integers(1, 10))
    def submit(self, model: str, session: int, grow: int, max_tokens: int) -> None:
        sid = f"s{session}-{model}"
        prompt = self.prompts.get(sid, []) + [(self.n * 7 + i) % 400 + 1 for i in range(grow)]
        self.prompts[sid] = prompt
        self.n += 1
        call_id = f"c{self.n}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        handle = self.inst.submit(CallRequest(call_id, sid, model, list(prompt), params))
        self.handles[call_id] = handle
        self._collect(call_id, handle)

    @precondition(lambda self: any(not h.done for h in self.handles.values()))
    @rule(pick=st.integers(0, 1 << 16))
    def abort(self, pick: int) -> None:
        live = [h for h in self.handles.values() if not h.done]
        live[pick % len(live)].abort()

    @precondition(lambda self: any(not h.done for h in self.handles.values()))
    @rule(pick=st.integers(0, 1 << 16))
    def client_leaves(self, pick: int) -> None:
        """Gone before its server noticed: dropped at admission if still queued."""
        live = [h for h in self.handles.values() if not h.done]
        live[pick % len(live)].client_gone = lambda: True

    @rule(seconds=st.sampled_from([0.0, 0.02, 0.1, 0.3]))
    def time_passes(self, seconds: float) -> None:
        self.loop.run_until_complete(asyncio.sleep(seconds))

    @rule(model=st.sampled_from(MODELS), session=st.integers(0, 2))
    def router_lets_go(self, model: str, session: int) -> None:
        """The router dropped the session: the instance forgets it (unless a call of it is
        here), its reservation released."""
        self.inst.forget_sessions([f"s{session}-{model}"])
        self.prompts.pop(f"s{session}-{model}", None)
        self.loop.run_until_complete(asyncio.sleep(0.01))

    @invariant()
    def loop_alive(self) -> None:
        task = self.inst._task
        assert task is not None and not task.done()
        assert self.inst.healthy and self.inst.counters["engine_faults"] == 0

    @invariant()
    def report_is_the_books(self) -> None:
        state = self.inst.state()
        assert state.sessions == rebuilt(self.inst)
        delta = self.inst.sessions.report.since(self.cursor.epoch, self.cursor.version)
        polled = self.cursor.apply(orjson.loads(encode_report(state, delta)))
        assert polled.sessions == state.sessions

    def teardown(self) -> None:
        try:
            for handle in self.handles.values():
                if handle.client_gone is not None:
                    handle.abort()  # its server would have noticed by now

            async def all_ended() -> None:
                await asyncio.wait_for(asyncio.gather(*self.collectors), 60)

            self.loop.run_until_complete(all_ended())
            for call_id, events in self.events.items():
                assert [e.finished for e in events].count(True) == 1, (call_id, events)
                assert events[-1].finished, (call_id, events)
                assert events[-1].finish_reason in ("length", "abort"), events[-1]
            self.loop.run_until_complete(self.inst.stop())
            stats = self.engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks  # nothing referenced
            assert stats.extra["num_pinned_blocks"] == 0
            index = self.engine.rank.memory.host_kv.index
            entries = index.entries()
            assert index.used_bytes == sum(e.nbytes for e in entries) <= index.capacity_bytes
            assert sum(index.bytes_of(m) for m in index.models()) == index.used_bytes
        finally:
            self.engine.shutdown()
            self.loop.close()


def rebuilt(inst: Instance) -> dict[str, SessionKV]:
    """The report's sessions rebuilt from the books: every session with KV here or a
    reservation."""
    books = inst.sessions
    out: dict[str, SessionKV] = {}
    for session_id, hist in books.gaps.sessions.items():
        kv = books.kv_tokens.get(session_id, (0, 0))
        res = books.reservations.get(session_id)
        if kv != (0, 0) or res is not None:
            out[session_id] = SessionKV(session_id, hist.model, *kv,
                                        None if res is None else res.expires,
                                        None if res is None else res.expected_return)
    return out


@pytest.fixture
def machine_models(tiny_models: dict[str, Path]) -> dict[str, Path]:
    InstanceMachine.models = tiny_models
    return tiny_models


def test_instance_state_machine(machine_models: dict[str, Path]) -> None:
    run = InstanceMachine.TestCase
    run.settings = settings(max_examples=10, stateful_step_count=16, deadline=None)
    run().runTest()
