"""The replay driver under the virtual clock: SCTs computed by hand from the cost model for
sessions that never overlap on a one-model cluster, the isolated lower bound, prompt
construction, and contention between policies on a small trace."""

from __future__ import annotations

import array
import math
import random
import zlib

import pytest

from engine.sim.cost_model import CostModel
from engine.sim.model_spec import ModelSpec
from substrate.devices import server_preset
from workloads.benchmark.report import summarize
from workloads.bounds.isolated import run_isolated
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import replicate, run_sim
from workloads.replay.prompts import SessionTokens, next_prompt
from workloads.replay.systems import SYSTEMS
from workloads.traces.generator import generate_trace
from workloads.traces.trace import Call, CallRef, Session

MODEL = "glm-4.5-air"
BS = 64
SPEC = ClusterSpec(models=(MODEL,), block_size=BS, max_fused_decode_steps=8)
COST = CostModel(server_preset("h200x8"), ModelSpec.load(MODEL), 8)

# (input tokens, output tokens, tool gap); no prompt is a multiple of the block size.
SHAPES = [
    [(1000, 20, 0.5), (1300, 30, 2.0), (1700, 10, None)],
    [(3001, 5, 7.25), (3500, 12, None)],
    [(500, 40, 0.0), (700, 3, 1.5), (2500, 17, 3.0), (2600, 9, None)],
]
ARRIVALS = [0.0, 1000.0, 2000.0]  # far apart: each session runs alone


def _trace() -> list[Session]:
    return [
        Session(f"s{i}", MODEL, tuple(Call(p, o, g) for p, o, g in shape), arrival_s=ARRIVALS[i])
        for i, shape in enumerate(SHAPES)
    ]


def _call_seconds(prompt: int, output: int, cached: int) -> tuple[float, float]:
    """(TTFT, call time) of a lone call: one prefill step of the uncached suffix (it samples
    the first token), then one decode step per further token over a context growing by one."""
    ttft = COST.chunks_step_seconds([(prompt - cached, cached)])
    decode = sum(COST.decode_step_seconds(1, prompt + j) for j in range(output - 1))
    return ttft, ttft + decode


def _expected(first_switch_s: float) -> tuple[list[float], list[list[float]]]:
    scts, ttfts = [], []
    for i, shape in enumerate(SHAPES):
        total = first_switch_s if i == 0 else 0.0
        session_ttfts = []
        prev = None
        for k, (p, o, g) in enumerate(shape):
            cached = 0
            if prev is not None:
                computed = prev[0] + prev[1] - 1  # the last output token is never fed back
                cached = min(computed // BS, (p - 1) // BS) * BS
            ttft, secs = _call_seconds(p, o, cached)
            session_ttfts.append(ttft + (first_switch_s if i == 0 and k == 0 else 0.0))
            total += secs + (g or 0.0)
            prev = (p, o)
        scts.append(total)
        ttfts.append(session_ttfts)
    return scts, ttfts


def test_sct_equals_hand_computed_sum_of_calls_and_gaps() -> None:
    result = run_sim(_trace(), SYSTEMS["baseline"], SPEC)
    # The baseline's one activation is the substrate's copy from host.
    scts, ttfts = _expected(COST.switch_seconds_host())
    assert result.failed_calls == 0
    got = {s.session_id: s for s in result.sessions}
    for i, want in enumerate(scts):
        s = got[f"s{i}"]
        assert s.sct_s == pytest.approx(want, rel=1e-9, abs=1e-9)
        assert s.start_s == pytest.approx(ARRIVALS[i])
        assert [c.ttft_s for c in s.calls] == pytest.approx(ttfts[i], rel=1e-9, abs=1e-9)
        assert [c.output_tokens for c in s.calls] == [o for _, o, _ in SHAPES[i]]
        assert [c.prompt_tokens for c in s.calls] == [p for p, _, _ in SHAPES[i]]
        # Alone on the device, every reusable block is served from the prefix cache.
        assert all(c.recomputed_tokens == 0 for c in s.calls)
        assert all(c.restored_tokens == 0 for c in s.calls)
    assert result.totals is not None and result.totals.switches == 0
    assert result.totals.activations == 1


def test_lower_bound_is_the_same_sum_without_the_activation() -> None:
    result = run_isolated(_trace(), SPEC)
    scts, _ = _expected(0.0)
    got = {s.session_id: s.sct_s for s in result.sessions}
    assert got == {f"s{i}": pytest.approx(v, rel=1e-9, abs=1e-9) for i, v in enumerate(scts)}
    assert [s.arrival_s for s in result.sessions] == ARRIVALS


def test_next_prompt_extends_the_previous_prompt_and_output() -> None:
    tokens = SessionTokens("s", seed=1, vocab_size=50)
    prompt, output = tokens.take(10), [7, 8, 9]
    grown = next_prompt(prompt, output, 20, tokens)
    assert len(grown) == 20 and grown[:13] == prompt + output
    assert all(1 <= t < 50 for t in grown)
    # A next prompt shorter than prompt + output (thinking dropped) is cut there.
    assert next_prompt(prompt, output, 11, tokens) == prompt + output[:1]


def test_session_tokens_are_seeded_per_session() -> None:
    a = SessionTokens("s1", 0, 1000).take(100)
    assert a == SessionTokens("s1", 0, 1000).take(100)
    # The ids every replay and its saved results rest on (changing them moves every table),
    # as plain ints (numpy's would miss the plain-int fast paths downstream: the router's
    # 5-byte digest form, the engine's prompt check).
    assert a[:6] == [386, 63, 537, 247, 572, 62] and all(type(t) is int for t in a)
    # A vocabulary past 32 bits: every raw 32-bit draw is below vocab - 1, so each id is it + 1.
    raw = array.array("I", random.Random(zlib.crc32(b"0/s1")).randbytes(4 * 100))
    assert SessionTokens("s1", 0, 2**33).take(100) == [x + 1 for x in raw]
    assert a != SessionTokens("s2", 0, 1000).take(100)
    assert a != SessionTokens("s1", 1, 1000).take(100)
    with pytest.raises(ValueError, match="vocab_size"):
        SessionTokens("s", 0, 1)


def test_replicate_renames_copies() -> None:
    trace = _trace()
    copies = replicate(trace, 3)
    assert len(copies) == 9
    assert len({s.session_id for s in copies}) == 9
    assert copies[4].session_id == "s1@1" and copies[4].calls == trace[1].calls


def test_unknown_model_is_refused_with_its_name() -> None:
    bad = [Session("x", "no-such-model", (Call(10, 1, None),))]
    with pytest.raises(ValueError, match="no-such-model"):
        run_sim(bad, SYSTEMS["baseline"], SPEC)


def test_contention_policies_on_a_small_two_model_trace() -> None:
    trace = generate_trace(num_sessions=4, total_calls=20, models=("glm-4.5-air",
                                                                   "mistral-large-2407"), seed=3)
    spec = ClusterSpec(models=("glm-4.5-air", "mistral-large-2407"))
    lower = summarize(run_isolated(trace, spec))
    stats = {}
    for name in ("baseline", "+host_kv", "talaria"):
        result = run_sim(trace, SYSTEMS[name], spec)
        assert result.failed_calls == 0
        assert len(result.calls) == 20
        stats[name] = summarize(result)
    # Nobody beats a session running alone with its model resident.
    for st in stats.values():
        assert st.sct_p50_s >= lower.sct_p50_s - 1e-9
        assert st.sct_mean_s >= lower.sct_mean_s - 1e-9
    # Without host KV nothing is ever restored; with it, switched-out KV comes back.
    assert stats["baseline"].tokens_restored == 0
    assert stats["+host_kv"].tokens_restored > 0
    assert stats["+host_kv"].tokens_recomputed < stats["baseline"].tokens_recomputed
    assert math.isfinite(stats["talaria"].ttft_p95_s)


def test_a_call_may_wait_minutes_for_its_slot_in_the_simulated_cluster() -> None:
    """The simulated cluster has no call deadlines: a session of a second model waits for
    the first model's long slot (far beyond the live router's 300 s first-token deadline)
    and still completes, so the benchmark measures the wait instead of failing the call."""
    two = ("glm-4.5-air", "qwen3-235b-a22b")
    spec = ClusterSpec(models=two, block_size=BS, max_fused_decode_steps=8)
    busy = Session("busy", two[0], tuple(Call(2000 + 100 * k, 2000, 0.0) for k in range(40))
                   + (Call(7000, 10, None),))
    waiting = Session("waiting", two[1], (Call(1000, 10, None),), arrival_s=1.0)
    system = SYSTEMS["baseline"].with_policy(slot_close="quantum", slot_quantum_s=2000.0)
    result = run_sim([busy, waiting], system, spec)
    assert result.failed_calls == 0
    (call,) = [c for s in result.sessions if s.session_id == "waiting" for c in s.calls]
    assert call.ttft_s is not None and call.ttft_s > 300.0


@pytest.mark.parametrize("output_kv_reusable", [True, False])
def test_reusable_counts_the_kv_of_the_call_a_prompt_continues(output_kv_reusable: bool) -> None:
    """A call that continues an earlier call of its session than the last (the context
    before a compaction) can reuse what that call computed: its prompt, and its output but
    the last token when an output's KV is reused. It was read from the last call's."""
    ref = CallRef("s", 0)
    session = Session("s", MODEL, (
        Call(2000, 100, 0.5), Call(500, 20, 0.5, prefix_tokens=2 * BS),
        Call(2200, 20, None, prefix_from=ref)))
    result = run_sim([session], SYSTEMS["talaria"], SPEC, output_kv_reusable=output_kv_reusable)
    last = max(result.calls, key=lambda c: c.index)
    computed = 2000 + (99 if output_kv_reusable else 0)
    assert last.reusable_tokens == min(computed, 2200 - 1) // BS * BS
    assert last.cached_tokens == last.reusable_tokens  # nothing evicted on an idle server
