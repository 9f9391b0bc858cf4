"""Report statistics, the table and JSON, the policy catalogue, and sweep helpers."""

from __future__ import annotations

import orjson
import pytest

from talaria.policies.config import TALARIA_SETTING, PolicyConfig, preset
from workloads.benchmark.report import benchmark, format_table, summarize, to_json
from workloads.benchmark.sweep import LoadPoint, SweepResult, best_quantum
from workloads.benchmark.sweep_report import format_sweep, regime_summary, sweep_json
from workloads.benchmark.tuning import apply_settings, grid
from workloads.bounds.bound import LowerBound
from workloads.replay.driver import CallRecord, ReplayResult, SessionResult
from workloads.replay.systems import (
    ABLATIONS,
    DEFAULT_POLICIES,
    LEAVE_ONE_OUT_ROWS,
    PEERS,
    SYSTEMS,
    SystemConfig,
    parse_policies,
)
from workloads.suite.stats import percentile
from workloads.traces.arrivals import poisson_arrivals
from workloads.traces.trace import Call, Session


def _result(name: str, scts: list[float], ttft: float = 1.0) -> ReplayResult:
    sessions = []
    for i, sct in enumerate(scts):
        calls = [
            CallRecord(0, 0.0, ttft, sct / 2, prompt_tokens=1000, output_tokens=10,
                       reusable_tokens=0),
            CallRecord(1, sct / 2, sct / 2 + ttft, sct, prompt_tokens=1200, output_tokens=10,
                       reusable_tokens=1000, cached_tokens=600, restored_tokens=200),
        ]
        sessions.append(SessionResult(f"s{i}", "m", 0.0, calls))
    return ReplayResult(name, sessions)


def test_percentile_interpolates_between_order_statistics() -> None:
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4, 5], 95) == pytest.approx(4.8)
    assert percentile([7], 95) == 7
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="percentile"):
        percentile([1], 101)


def test_summary_counts_recomputed_restored_and_device_hits() -> None:
    st = summarize(_result("x", [10.0, 20.0, 30.0], ttft=0.5))
    assert (st.sct_p50_s, st.sct_mean_s) == (20.0, 20.0)
    assert st.ttft_p50_s == 0.5 and st.calls == 6
    assert st.tokens_recomputed == 3 * 400  # 1000 reusable, 600 served from cache
    assert st.tokens_restored == 3 * 200
    assert st.tokens_device_cached == 3 * 400
    assert st.tokens_prefilled == 3 * (1000 + 1200 - 600)


def test_speedups_lower_bound_and_best_quantum() -> None:
    base = _result("baseline", [100.0, 200.0, 400.0])
    fast = _result("talaria", [25.0, 50.0, 100.0])
    lower = _result("isolated", [10.0, 20.0, 30.0])
    bound = LowerBound(15.0, 25.0, 18.0, {"p50": "critical path", "p95": "capacity",
                                          "mean": "capacity"}, [10.0, 15.0, 30.0])
    bench = benchmark([base, fast], lower, {"p50": (10.0, 150.0), "p95": (20.0, 300.0)},
                      bound=bound)
    t = bench.policies["talaria"]
    assert t.speedup_p50 == pytest.approx(4.0)
    assert t.speedup_p95 == pytest.approx(
        percentile([100, 200, 400], 95) / percentile([25, 50, 100], 95))
    assert t.speedup_p50_best_q == pytest.approx(3.0)
    assert t.p50_over_isolated == pytest.approx(2.5)
    assert t.p50_over_bound == pytest.approx(50.0 / 15.0)
    assert t.mean_over_bound == pytest.approx((175.0 / 3) / 18.0)
    table = format_table(bench)
    assert "talaria" in table and "isolated" in table and "x p50 bq" in table
    assert "lower bound" in table and "critical path|capacity" in table
    data = orjson.loads(orjson.dumps(to_json(bench)))
    assert data["policies"]["talaria"]["sct_p50_s"] == 50.0
    assert data["policies"]["baseline"]["speedup_p50"] == 1.0
    assert data["isolated"]["sct_p50_s"] == 20.0
    assert data["lower_bound"] == {"sct_p50_s": 15.0, "sct_p95_s": 25.0, "sct_mean_s": 18.0,
                                   "binding": bound.binding}
    assert data["baseline_best_quantum"]["p50"] == {"slot_quantum_s": 10.0, "sct_s": 150.0}


def test_policy_catalogue_is_consistent() -> None:
    assert list(DEFAULT_POLICIES[:7]) == ["baseline", "+staging", "+host_kv", "+sp",
                                          "+priority", "+priority_switch", "talaria"]
    # -lending is +priority_switch: not run twice
    assert list(LEAVE_ONE_OUT_ROWS) == ["-staging", "-host_kv", "-sp", "-reservations",
                                        "-priority_switch", "-placement", "-layerwise"]
    # -layerwise is talaria whose engine restores host KV before the forward pass
    layerwise = LEAVE_ONE_OUT_ROWS["-layerwise"]
    assert layerwise.policy.with_(name="talaria") == ABLATIONS["talaria"].policy
    assert layerwise.kv_tier == "offload_serial" and ABLATIONS["talaria"].kv_tier == "offload"
    assert set(PEERS) == {"vllm_sleep", "vllm_sleep_lmcache", "sglang_hicache", "continuum_ttl",
                          "autellix", "aegaeon"}
    base = ABLATIONS["baseline"]
    # the reference's baseline: the system itself on the stable substrate, reservations and
    # session-aware placement on; staging, host KV and session-prefill off
    assert base.stable_substrate and base.placement == "talaria" and base.switch == "copy"
    assert base.policy.soft_reservations and not base.policy.session_prefill
    assert not base.policy.session_priority and not base.policy.priority_switch
    # Talaria's staging region holds the largest shard where host KV keeps what the KV region
    # gives up, and leaves it out where it does not; Aegaeon's prefetch keeps its own
    assert ABLATIONS["talaria"].engine_config().staging_region == "largest"
    assert LEAVE_ONE_OUT_ROWS["-layerwise"].engine_config().staging_region == "largest"
    assert ABLATIONS["+staging"].engine_config().staging_region == "second"
    assert LEAVE_ONE_OUT_ROWS["-host_kv"].engine_config().staging_region == "second"
    assert PEERS["aegaeon"].engine_config().staging_region == "largest"
    for peer in PEERS.values():
        assert not peer.policy.session_priority and not peer.policy.priority_switch
        assert not peer.policy.kv_demotion and not peer.policy.lend_staging
    config = base.engine_config()
    assert config.host_kv_bytes == 0 and not config.staging
    assert ABLATIONS["talaria"].placement == "talaria"
    assert ABLATIONS["+host_kv"].engine_config().host_kv_bytes is None
    assert LEAVE_ONE_OUT_ROWS["-placement"].placement == "load"
    assert LEAVE_ONE_OUT_ROWS["-placement"].policy.with_(name="talaria") == ABLATIONS["talaria"].policy
    # no two rows are one configuration
    configs = [(s.policy.with_(name=""), s.placement, s.engine_config()) for s in SYSTEMS.values()]
    assert all(configs.count(c) == 1 for c in configs)
    for name in ("vllm_sleep", "vllm_sleep_lmcache", "sglang_hicache", "continuum_ttl", "autellix"):
        assert PEERS[name].switch == "sleep_wake" and not PEERS[name].stable_substrate
    assert PEERS["aegaeon"].policy.preempt and PEERS["aegaeon"].switch == "scale_up"
    # every peer routes as its stack's own router does: none by load alone
    assert {p.placement for p in PEERS.values()} == {"cache_aware"}
    assert ABLATIONS["baseline"].with_quantum(7.0).policy.slot_quantum_s == 7.0
    assert [s.name for s in parse_policies("talaria, baseline")] == ["talaria", "baseline"]
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        parse_policies("baseline,nope")
    with pytest.raises(ValueError, match="twice"):
        parse_policies("baseline,baseline")
    with pytest.raises(ValueError, match="staging"):
        SystemConfig("bad", "", PolicyConfig(), "talaria", stable_substrate=False,
                     staging=True, host_kv=True)
    with pytest.raises(ValueError, match="host KV"):
        SystemConfig("bad", "", PolicyConfig(), "talaria", True, True, host_kv=False)


def test_a_leave_one_out_name_that_is_a_rung_selects_the_rung() -> None:
    """``-lending`` is the ladder's ``+priority_switch``: ``--policies`` takes the mechanism's
    own name and runs that row once, and the default rows do not gain it."""
    assert [s.name for s in parse_policies("-lending")] == ["+priority_switch"]
    assert [s.name for s in parse_policies("talaria,-lending")] == ["talaria", "+priority_switch"]
    with pytest.raises(ValueError, match="twice"):
        parse_policies("-lending,+priority_switch")
    with pytest.raises(ValueError, match=r"-lending \(the row \+priority_switch\)"):
        parse_policies("-nope")
    assert "-lending" not in DEFAULT_POLICIES


def test_talaria_runs_one_configuration_everywhere_and_only_the_others_are_tuned() -> None:
    """Talaria, the rungs above the baseline and the leave-one-out rows run Talaria's one
    configuration on every trace, whatever a tuned settings file holds for them; the
    baseline and the peers take their tuned settings. `talaria serve`'s default policy
    (PolicyConfig's defaults) is that configuration too."""
    assert PolicyConfig().with_(name="talaria") == preset("talaria")
    assert {"slot_close": PolicyConfig().slot_close,
            "slot_quantum_s": PolicyConfig().slot_quantum_s} == TALARIA_SETTING
    tuned_elsewhere = {"slot_close": "quantum", "slot_quantum_s": 60.0}
    rows = [*ABLATIONS.values(), *LEAVE_ONE_OUT_ROWS.values(), *PEERS.values()]
    applied = {s.name: s for s in apply_settings(rows, {s.name: tuned_elsewhere for s in rows})}
    fixed = [*list(ABLATIONS)[1:], *LEAVE_ONE_OUT_ROWS]
    for name in fixed:
        assert applied[name].setting == TALARIA_SETTING, name
        assert grid(SYSTEMS[name]) == [TALARIA_SETTING]
    for name in ("baseline", *PEERS):
        assert applied[name].setting == tuned_elsewhere, name
        assert len(grid(SYSTEMS[name])) > 1


def test_poisson_arrivals_are_seeded_and_increasing() -> None:
    sessions = [Session(f"s{i}", "m", (Call(10, 1, None),)) for i in range(50)]
    a = poisson_arrivals(sessions, rate=0.5, seed=1)
    assert a[0].arrival_s == 0.0
    times = [s.arrival_s for s in a]
    assert times == sorted(times) and times == [s.arrival_s for s in poisson_arrivals(sessions, 0.5, 1)]
    mean_gap = times[-1] / 49
    assert 1.0 < mean_gap < 4.0  # about 1 / rate
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(sessions, 0.0)


def test_sweep_tables_best_quantum_and_regime() -> None:
    sweep = SweepResult("quantum", [10.0, 30.0])
    sweep.results[(0, "baseline")] = _result("baseline", [100.0, 200.0, 300.0])
    sweep.results[(1, "baseline")] = _result("baseline", [80.0, 260.0, 900.0])
    sweep.results[(0, "talaria")] = _result("talaria", [50.0, 60.0, 70.0])
    sweep.results[(1, "talaria")] = _result("talaria", [40.0, 60.0, 80.0])
    best = best_quantum(sweep)
    assert best["p50"] == (10.0, 200.0)
    assert best["p95"][0] == 10.0
    text = format_sweep(sweep)
    assert "q=10s" in text and "200/290" in text
    assert sweep_json(sweep)["points"][1]["policies"]["talaria"]["sct_p50_s"] == 60.0
    load = SweepResult("load", [LoadPoint("all at once", None, None)])
    load.results[(0, "baseline")] = sweep.results[(0, "baseline")]
    load.results[(0, "talaria")] = sweep.results[(0, "talaria")]
    summary = regime_summary(load)
    assert "all at once: p50 3.33x" in summary and "closest to the reference" in summary
