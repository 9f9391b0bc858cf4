"""The method behind ``talaria fidelity``'s step time, without timing anything real: the
clock and statistic, the rounds and their spread, the median spec and the pooled points,
the overhead fit (it recovers the terms a cost model priced), and the machine-load
figures."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from engine.sim.cost_model import CostModel
from engine.sim.model_spec import ModelSpec
from substrate.devices import DeviceSpec, ServerSpec
from talaria.bench.calibrate_overheads import TP1_TERMS, _fit_step, fit_overheads, nnls
from talaria.bench.fidelity_rounds import (
    Round,
    format_spread,
    median_server,
    pooled_results,
    run_rounds,
    spread,
)
from talaria.bench.machine_load import (
    CpuSample,
    CpuUse,
    LoadWatch,
    busiest_thread_cpu_s,
    cpu_sample,
    descendants,
    thread_cpu_s,
)
from talaria.bench.step_fidelity import Case, PointResult, price
from talaria.bench.step_points import MeasuredStep, StepPoint, StepShape
from talaria.bench.timing import THREAD_CPU, WALL, Clock, clock_for, median_seconds

DEVICE = DeviceSpec(name="core", hbm_bytes=10**10, hbm_bytes_per_s=8e9, bf16_flops=6e10,
                    nvlink_bytes_per_s=1e9, host_link_bytes_per_s=5e9, d2d_bytes_per_s=5e9,
                    attention_flops=3e10, attention_scores_per_s=1e9, decode_scores_per_s=2e8,
                    kv_read_bytes_per_s=6e9)
BASE = {"compute": 1.0, "memory": 1.0, "overlap": 0.0, "step_overhead_s": 0.0,
        "allreduce_latency_s": 2e-4}
SERVER = ServerSpec("cpu-test", DEVICE, num_devices=2, efficiency=tuple(sorted(BASE.items())))
CASE = Case("tiny", "m", 1, (StepPoint("decode", 4, 64), StepPoint("prefill", 32, 0)))
OTHER = Case("small", "m", 1, (StepPoint("decode", 1, 64),))


def spec(layers: int = 2, hidden: int = 64, moe: bool = False) -> ModelSpec:
    return ModelSpec(
        name="m", hf_repo="", source="test",
        architecture="Qwen3MoeForCausalLM" if moe else "LlamaForCausalLM",
        num_layers=layers, hidden_size=hidden, num_attention_heads=4, num_kv_heads=2,
        head_dim=hidden // 4, vocab_size=512, tie_word_embeddings=False, attention_bias=False,
        num_dense_layers=0 if moe else layers, dense_intermediate_size=2 * hidden,
        num_experts=4 if moe else 0, num_experts_per_tok=2 if moe else 0,
        moe_intermediate_size=hidden if moe else 0, num_shared_experts=0,
        max_position_embeddings=8192, weight_dtype="float32", kv_dtype="float32",
        activation_dtype="float32")


def test_one_thread_in_one_process_is_timed_on_its_cpu_clock_else_on_the_wall() -> None:
    assert clock_for(1) is THREAD_CPU
    assert clock_for(2) is WALL and clock_for(1, ranks=2) is WALL
    with pytest.raises(ValueError):
        clock_for(0)
    reads = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # runs of 1, 3 and 2
    runs = []
    fake = Clock("fake", lambda: next(reads))
    assert median_seconds(lambda: runs.append(1), repeats=3, clock=fake) == 2.0
    assert len(runs) == 4  # the warm-up is run, not timed


def measured(point: StepPoint, seconds: float) -> MeasuredStep:
    chunks = ((point.tokens, point.context),) if point.kind == "prefill" else ()
    seqs = point.tokens if point.kind == "decode" else 0
    return MeasuredStep(point, seconds, StepShape(chunks, seqs, seqs * point.context), 3,
                        2 * seconds, "thread_cpu")


def round_of(server: ServerSpec, scale: float) -> Round:
    results = []
    for case in (CASE, OTHER):
        steps = [measured(p, scale * 1e-3 * (i + 1)) for i, p in enumerate(case.points)]
        results += price(case, spec(), steps, server)
    return Round(server, {"seconds": scale}, results)


def test_rounds_calibrate_then_measure_and_their_spread_is_what_moved() -> None:
    servers = [replace(SERVER, device=replace(DEVICE, bf16_flops=f, decode_scores_per_s=d))
               for f, d in ((5e10, 2e8), (6e10, None), (8e10, 3e8))]
    calls: list[str] = []

    def calibrate() -> tuple[ServerSpec, dict[str, float]]:
        calls.append("calibrate")
        return servers[len(calls) // 2], {}

    def measure(server: ServerSpec) -> list[PointResult]:
        calls.append("measure")
        return round_of(server, [1.0, 1.1, 1.5][len(calls) // 2 - 1]).results

    rounds = run_rounds(3, calibrate, measure, log=lambda _line: None)
    assert calls == ["calibrate", "measure"] * 3
    assert [r.server for r in rounds] == servers
    median = median_server(servers)
    assert median.device.bf16_flops == 6e10
    assert median.device.decode_scores_per_s == 2.5e8  # the median of the two measured
    assert median_server(servers[1:2]).device.decode_scores_per_s is None
    gap = spread(rounds)
    assert gap["rounds"] == 3 and len(gap["per_round"]) == 3
    # every point's time was x1, x1.1 and x1.5: it moved by (1.5 - 1) / 1.1
    assert gap["point_time_spread"]["median"] == pytest.approx(0.5 / 1.1)
    assert gap["constant_spread"]["device.bf16_flops"] == pytest.approx(0.5)
    assert "device.hbm_bytes_per_s" not in gap["constant_spread"]  # it never moved
    lo, hi = gap["median_rel_err_range"]
    assert lo == min(p["median_rel_err"] for p in gap["per_round"]) <= hi
    assert "bf16_flops 50%" in format_spread(gap)
    with pytest.raises(ValueError):
        run_rounds(0, calibrate, measure)


def test_pooling_takes_each_points_median_round_and_prices_it_with_one_spec() -> None:
    rounds = [round_of(SERVER, s) for s in (3.0, 1.0, 2.0, 4.0)]
    priced_cases = []

    def again(results: list[PointResult], server: ServerSpec) -> list[PointResult]:
        priced_cases.append(results[0].case)
        return price(results[0].case, spec(), [r.measured for r in results], server)

    faster = replace(SERVER, device=replace(DEVICE, bf16_flops=1e12))
    pooled = pooled_results(rounds, faster, again)
    assert priced_cases == [CASE, OTHER]  # one case at a time
    assert [p.measured.seconds for p in pooled] == pytest.approx([2e-3, 4e-3, 2e-3])
    want = CostModel(faster, spec(), 1).step_cost([], 4, 4 * 64).seconds
    assert pooled[0].predicted_s == pytest.approx(want)
    with pytest.raises(ValueError, match="different points"):
        pooled_results([rounds[0], replace(rounds[1], results=rounds[1].results[:1])],
                       faster, again)


def test_nnls_keeps_coefficients_non_negative() -> None:
    a = torch.tensor([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], dtype=torch.float64)
    x = nnls(a, torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64))  # unconstrained: 4, -1
    assert x[1] == 0 and x[0] == pytest.approx(2.0)
    exact = nnls(a, a @ torch.tensor([0.5, 2.0], dtype=torch.float64))
    assert exact.tolist() == pytest.approx([0.5, 2.0])


def test_the_fit_recovers_the_terms_a_cost_model_priced() -> None:
    """Steps 'measured' at what a server with known overheads and rates prices them are
    fitted back to those overheads and rates from a server that has none."""
    truth = {"step_overhead_s": 3e-4, "layer_overhead_s": 6e-5, "moe_layer_overhead_s": 4e-5,
             "seq_overhead_s": 1e-5, "elementwise_s_per_unit": 2e-8,
             "decode_seq_layer_overhead_s": 5e-6, "decode_context_overhead_s": 3e-9}
    true_device = replace(DEVICE, hbm_bytes_per_s=4e9, kv_read_bytes_per_s=3e9,
                          decode_scores_per_s=5e8)
    gemm = {"gemm_s_per_weight_byte": 4e-11}
    known = ServerSpec("truth", true_device, 2,
                       efficiency=tuple(sorted({**BASE, **truth, **gemm}.items())))
    points = [StepPoint("decode", b, c) for b in (1, 4, 32) for c in (16, 1024)]
    points += [StepPoint("prefill", n, 0) for n in (48, 320)]
    steps = []
    for model in (spec(1, 64), spec(4, 64), spec(1, 512), spec(4, 512), spec(1, 64, True),
                  spec(4, 512, True)):
        cost = CostModel(known, model, 1)
        for p in points:
            m = measured(p, 1.0)
            s = cost.step_cost(list(m.shape.chunks), m.shape.decode_seqs, m.shape.decode_context)
            steps.append(_fit_step(SERVER, model, replace(m, seconds=s.seconds)))
    fitted = fit_overheads(steps)
    assert set(fitted) == set(TP1_TERMS)
    for term, value in {**truth, **gemm}.items():
        assert fitted[term] == pytest.approx(value, rel=1e-3), term
    assert 1 / fitted["weights_s_per_byte"] == pytest.approx(4e9, rel=1e-3)
    assert 1 / fitted["kv_read_s_per_byte"] == pytest.approx(3e9, rel=1e-3)
    assert 1 / fitted["decode_s_per_score"] == pytest.approx(5e8, rel=1e-3)


def test_cpu_use_is_what_the_others_took_of_the_busy_time() -> None:
    a = CpuSample(at=10.0, busy_s=100.0, steal_s=1.0, ours_s=50.0)
    b = CpuSample(at=20.0, busy_s=118.0, steal_s=2.0, ours_s=60.0)
    use = CpuUse.between(a, b)
    assert (use.seconds, use.ours_cores, use.others_cores, use.steal_cores) == pytest.approx(
        (10.0, 1.0, 0.8, 0.1))
    blind = CpuUse.between(replace(a, busy_s=None), b)
    assert blind.others_cores is None and blind.to_dict()["ours_cores"] == pytest.approx(1.0)
    now = cpu_sample()
    sum(range(200_000))  # some CPU of our own
    later = cpu_sample()
    assert later.ours_s >= now.ours_s > 0
    if os.path.exists("/proc/stat"):
        assert later.busy_s is not None and later.busy_s >= now.busy_s  # type: ignore[operator]
    with LoadWatch(every_s=0.01) as watch:
        pass
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        before = {child.pid: {}}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and busiest_thread_cpu_s(
                before, {child.pid: thread_cpu_s(child.pid)}) < 0.25:
            time.sleep(0.05)
        assert child.pid in descendants(os.getpid())
        assert busiest_thread_cpu_s(before, {child.pid: thread_cpu_s(child.pid)}) >= 0.25
    finally:
        child.kill()
        child.wait()
    summary = watch.summary()
    assert len(watch.samples) >= 2 and summary["max"] >= summary["mean"] >= 0
