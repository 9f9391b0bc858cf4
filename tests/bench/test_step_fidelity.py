"""The step-time check's machinery (no timing is asserted): the live engine is timed at the
shapes asked for and each prediction prices the work the timed step ran; the calibration's
micro-benchmarks and fits run and produce a spec the cost model loads."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from engine.engine_core import EngineCore
from engine.models.tiny import write_random_checkpoint
from engine.sim.cost_model import CostModel
from engine.sim.model_spec import ModelSpec
from substrate.devices import DeviceSpec, ServerSpec, server_from_dict
from talaria.bench import calibrate_kernels as k
from talaria.bench.calibrate import _overlap, calibration_dict
from talaria.bench.calibrate_overheads import fit_engine
from talaria.bench.step_fidelity import Case, format_table, run_cases, summarize
from talaria.bench.step_points import StepPoint, measure_steps
from talaria.bench.timing import THREAD_CPU, WALL

SERVER = ServerSpec(
    "cpu-test",
    DeviceSpec(name="core", hbm_bytes=10**10, hbm_bytes_per_s=8e9, bf16_flops=6e10,
               nvlink_bytes_per_s=1e9, host_link_bytes_per_s=5e9, d2d_bytes_per_s=5e9,
               attention_flops=3e10, attention_scores_per_s=1e9, decode_scores_per_s=2e8,
               kv_read_bytes_per_s=6e9),
    num_devices=2,
    efficiency=(("allreduce_latency_s", 2e-4), ("compute", 1.0), ("memory", 1.0),
                ("moe_dense_max_tokens", 64.0), ("overlap", 0.0), ("step_overhead_s", 0.0)),
)
POINTS = (StepPoint("prefill", 16, 0), StepPoint("prefill", 32, 48), StepPoint("decode", 4, 40))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("step") / "tiny-llama", "llama")


def test_points_are_validated() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        StepPoint("verify", 4, 0)
    with pytest.raises(ValueError, match="needs tokens >= 1"):
        StepPoint("decode", 4, 0)
    assert StepPoint("prefill", 256, 2048).label == "prefill 256 after 2048"


def test_each_timed_step_ran_the_work_of_its_point(llama: Path) -> None:
    first, after, decode = measure_steps(llama, POINTS, repeats=3, clock=THREAD_CPU)
    assert first.shape.chunks == ((16, 0),) and first.shape.decode_seqs == 0
    assert after.shape.chunks == ((32, 48),)  # the 48 cached tokens came from the prefix cache
    assert decode.shape.chunks == () and decode.shape.decode_seqs == 4
    assert 4 * 40 <= decode.shape.decode_context <= 4 * (40 + 16)
    for m in (first, after, decode):
        assert m.samples == 3 and m.clock == "thread_cpu"
        assert 0 < m.seconds and 0 < m.wall_seconds
    (walled,) = measure_steps(llama, POINTS[:1], repeats=1, clock=WALL)
    assert walled.clock == "wall" and walled.seconds >= walled.wall_seconds  # around step()


def test_a_measured_engine_is_freed_without_waiting_for_a_collection(llama: Path) -> None:
    """Its KV cache is GBs at the check's shapes: held in a reference cycle, one engine's
    stayed resident while the next was measured (16 GB at the peak of make fidelity)."""
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) is EngineCore}  # other tests' fixtures
    gc.disable()
    try:
        measure_steps(llama, POINTS[:1], repeats=1)
        alive = [o for o in gc.get_objects() if type(o) is EngineCore and id(o) not in before]
    finally:
        gc.enable()
    assert alive == []


def test_predictions_price_the_measured_shapes_and_summarize(llama: Path) -> None:
    case = Case("tiny", "tiny-llama", 1, POINTS)
    results = run_cases([case], SERVER, lambda size: {"tiny-llama": llama}, repeats=2,
                        log=lambda _line: None)
    cost = CostModel(SERVER, ModelSpec.from_hf_config(llama, "tiny-llama"), 1)
    for r in results:
        want = cost.step_cost(list(r.measured.shape.chunks), r.measured.shape.decode_seqs,
                              r.measured.shape.decode_context).seconds
        assert r.predicted_s == pytest.approx(want)
        assert r.rel_err == pytest.approx(want / r.measured.seconds - 1)
        assert sum(r.terms().values()) >= r.predicted_s * (1 - 1e-9)  # no overlap: they add up
    summary = summarize(results)
    assert summary["num_points"] == 3 and len(summary["points"]) == 3  # type: ignore[arg-type]
    assert set(summary["by_regime"]) == {"prefill tiny TP=1", "decode tiny TP=1"}  # type: ignore[arg-type]
    errors = sorted(abs(r.rel_err) for r in results)
    assert summary["median_rel_err"] == pytest.approx(errors[1])
    assert errors[1] <= summary["p90_rel_err"] <= errors[2]  # type: ignore[operator]
    assert "worst 3 points" in format_table(results, worst=3)


def test_the_micro_benchmarks_measure_positive_rates() -> None:
    tiny = k.LayerShapes(64, 4, 2, 16, 128)
    small = k.LayerShapes(128, 4, 2, 32, 256)
    assert k.matmul_flops(tiny, rows=64) > 0
    stream = k.weight_stream(tiny, total_bytes=1 << 20)
    assert stream.bytes_per_s > 0 and set(stream.seconds_by_rows) == {1, 16}
    attn = k.attention_rates(small, tiny, length=128, decode_seqs=2, decode_context=256)
    assert attn.flops > 0 and attn.kv_read_bytes_per_s > 0
    offload, restore = k.kv_copy_rates(2, 2, 16, num_blocks=8, clock=THREAD_CPU)
    assert offload > 0 and restore > 0
    copies = k.weight_copy_rates(1 << 20, THREAD_CPU)
    assert set(copies) == {"activate_h2d", "activate_d2d"} and min(copies.values()) > 0
    latency, bandwidth = k.allreduce_costs(sizes=(256, 1 << 16, 1 << 18), repeats=2)
    assert latency > 0 and bandwidth > 0


def test_overlap_is_read_off_the_streamed_layers() -> None:
    def stream(t16: float) -> k.StreamResult:  # memory 1 s, compute 16 x 0.125 = 2 s at 16 rows
        return k.StreamResult(1e9, {1: 1.0, 16: t16}, flops=125_000_000, bytes=10**9)

    assert _overlap(stream(2.0), flops=1e9) == 1.0  # cost the larger: all hidden
    assert _overlap(stream(3.0), flops=1e9) == 0.0  # cost the sum: nothing hidden
    assert _overlap(stream(2.5), flops=1e9) == pytest.approx(0.5)
    assert _overlap(stream(9.0), flops=1e9) == 0.0  # clamped


@pytest.mark.slow  # TP=2 ranks are processes
def test_the_engine_fit_makes_a_spec_the_cost_model_loads() -> None:
    points = (StepPoint("decode", 4, 64), StepPoint("prefill", 32, 0))
    server, quality = fit_engine(SERVER, log=lambda _line: None, repeats=1, sizes=("tiny",),
                                 points=points)
    assert quality["steps"] == 4 * len(points)  # dense and MoE, 1 and 4 layers
    eff = dict(server.efficiency)
    assert {"elementwise_s_per_unit", "decode_seq_layer_overhead_s", "decode_context_overhead_s",
            "tp_step_overhead_s"} <= set(eff)
    assert all(v >= 0 for v in eff.values())
    # the latency inside a step: never below the isolated ping's it starts from
    assert eff["allreduce_latency_s"] >= dict(SERVER.efficiency)["allreduce_latency_s"]
    assert server.device.hbm_bytes_per_s > 0 and server.device.kv_read_bytes_per_s
    loaded = server_from_dict(calibration_dict(server, {"threads_per_rank": 1}))
    assert loaded == server
    cost = CostModel(loaded, ModelSpec.load("glm-4.5-air"), 1)
    assert cost.eff.elementwise_s_per_unit == eff["elementwise_s_per_unit"]
