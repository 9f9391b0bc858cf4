"""Cost model sanity: model sizes from real configs, roofline regimes, switch and KV move times,
and the residency constraints the two server presets must impose."""

from __future__ import annotations

import dataclasses

import pytest

from engine.sim.cost_model import CostModel, Efficiency
from engine.sim.model_spec import DEFAULT_CATALOG, ModelSpec, catalog
from substrate.devices import GB, H100, H200, HOST_LINK_SHARE_ALL_GPUS, SERVERS, server_preset
from workloads.traces.generator import default_trace

H200X8 = server_preset("h200x8")
H100X8 = server_preset("h100x8")


def cm(name: str = "qwen3-235b-a22b", server=H200X8, tp: int = 8) -> CostModel:
    return CostModel(server, ModelSpec.load(name), tp)


def test_catalog_bundles_the_default_models() -> None:
    assert set(DEFAULT_CATALOG) <= set(catalog())


@pytest.mark.parametrize("name", catalog())
def test_parameter_counts_match_the_model_cards(name: str) -> None:
    m = ModelSpec.load(name)
    assert m.total_params == pytest.approx(m.reported_total_params, rel=0.03)
    # Model cards count active parameters with or without embeddings; accept either.
    assert m.active_linear_params <= m.reported_active_params * 1.06
    assert m.active_params >= m.reported_active_params * 0.94
    assert m.weight_bytes == pytest.approx(2 * m.total_params, rel=1e-9)  # bf16


def test_kv_bytes_per_token_follows_the_config() -> None:
    qwen = ModelSpec.load("qwen3-235b-a22b")
    assert qwen.kv_bytes_per_token == 2 * 94 * 4 * 128 * 2
    # 4 KV heads on 8 ranks: each rank keeps one (replicated) head.
    assert cm().kv_bytes_per_token_per_gpu() == 2 * 94 * 1 * 128 * 2
    assert cm(tp=4).kv_bytes_per_token_per_gpu() == 2 * 94 * 1 * 128 * 2
    mixtral = cm("mixtral-8x22b")
    assert mixtral.kv_bytes_per_token_per_gpu() * 8 == mixtral.model.kv_bytes_per_token


def test_fp8_weights_halve_the_linear_bytes_but_not_the_embeddings() -> None:
    bf16 = ModelSpec.load("qwen3-235b-a22b")
    fp8 = bf16.with_weight_dtype("float8_e4m3fn")
    assert fp8.weight_bytes == bf16.weight_bytes - (bf16.total_params - bf16.embedding_params)


def test_unknown_model_and_server_are_named() -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt-5'.*qwen3-235b-a22b"):
        ModelSpec.load("gpt-5")
    with pytest.raises(ValueError, match="unknown server preset 'tpu'.*h100x8, h200x8"):
        server_preset("tpu")


def test_tp_must_fit_the_server_and_divide_the_heads() -> None:
    with pytest.raises(ValueError, match="between 1 and"):
        cm(tp=16)
    with pytest.raises(ValueError, match="attention heads"):
        cm("mixtral-8x22b", tp=5)


def test_devices_name_their_datasheet_numbers() -> None:
    assert H200.hbm_bytes == 141 * GB and H100.hbm_bytes == 80 * GB
    assert H200.hbm_bytes_per_s > H100.hbm_bytes_per_s
    assert H200.host_link_bytes_per_s == 50 * GB
    # a D2D copy reads and writes each byte: at most half the HBM rate
    assert H200.d2d_bytes_per_s <= H200.hbm_bytes_per_s / 2
    assert set(SERVERS) == {"h200x8", "h100x8"}


@pytest.mark.parametrize("name", DEFAULT_CATALOG)
def test_decode_is_memory_bound_and_long_prefill_compute_bound(name: str) -> None:
    c = cm(name)
    decode = c.step_cost([], decode_seqs=8, decode_context=8 * 40_000)
    assert decode.memory_bound
    prefill = c.step_cost([(40_000, 0)])
    assert not prefill.memory_bound
    assert c.prefill_seconds(40_000) == pytest.approx(prefill.seconds)


def test_attention_counts_the_context() -> None:
    c = cm()
    assert c.prefill_seconds(2_000, context_tokens=60_000) > c.prefill_seconds(2_000) * 1.5
    assert c.decode_step_seconds(8, 8 * 60_000) > c.decode_step_seconds(8, 8 * 1_000)
    # prefill grows faster than linearly in its length (causal attention is quadratic)
    assert c.prefill_seconds(80_000) > 2.1 * c.prefill_seconds(40_000)


def test_decode_weight_reads_grow_with_the_experts_a_batch_touches() -> None:
    c = cm()
    one = c.step_cost([], 1, 1_000).memory_s
    many = c.step_cost([], 64, 64_000).memory_s
    assert many > one * 1.5  # more distinct experts read ...
    assert many < one * 64  # ... but weights are shared by the batch


def test_mixed_step_costs_at_least_its_parts_and_less_than_their_sum() -> None:
    c = cm()
    prefill = c.step_seconds(prefill_tokens=4_096, prefill_context=30_000)
    decode = c.step_seconds(decode_seqs=16, decode_context=16 * 30_000)
    mixed = c.step_seconds(4_096, 30_000, 16, 16 * 30_000)
    assert max(prefill, decode) <= mixed < prefill + decode
    assert c.chunks_step_seconds([(4_096, 30_000)], 16, 16 * 30_000) == pytest.approx(mixed)


def test_step_inputs_are_checked() -> None:
    c = cm()
    assert c.step_seconds() == 0.0
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        c.prefill_seconds(-1)
    with pytest.raises(ValueError, match="decode_context given without decode sequences"):
        c.step_seconds(decode_context=100)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        c.kv_offload_seconds(-5)


def test_tp1_pays_no_all_reduce() -> None:
    c = cm("glm-4.5-air", tp=1)
    assert c.step_cost([(1_000, 0)]).allreduce_s == 0.0
    assert cm("glm-4.5-air").step_cost([(1_000, 0)]).allreduce_s > 0.0


@pytest.mark.parametrize("server", [H200X8, H100X8])
@pytest.mark.parametrize("name", DEFAULT_CATALOG)
def test_switch_time_is_bytes_over_bandwidth(server, name: str) -> None:
    c = cm(name, server)
    w = c.weight_bytes_per_gpu()
    assert w == pytest.approx(c.model.weight_bytes / 8, abs=1)
    # every GPU copies its shard at once, at its share of its own host link
    assert c.switch_seconds_host() == pytest.approx(
        w / (server.device.host_link_bytes_per_s * HOST_LINK_SHARE_ALL_GPUS))
    assert c.switch_seconds_staged() == pytest.approx(w / server.device.d2d_bytes_per_s)
    assert c.switch_seconds_staged() < c.switch_seconds_host()


def test_kv_moves_are_bytes_over_the_host_link() -> None:
    c = cm()
    assert c.kv_offload_seconds(40_000) == pytest.approx(
        40_000 * 48_128 / (50 * GB * HOST_LINK_SHARE_ALL_GPUS))
    assert c.kv_restore_seconds(40_000) == c.kv_offload_seconds(40_000)
    # restoring a 40k-token prefix beats recomputing it by a wide margin
    assert c.kv_restore_seconds(40_000) * 10 < c.prefill_seconds(40_000)


def test_kv_capacity_accounts_for_what_else_is_resident() -> None:
    c = cm()
    alone = c.kv_capacity_tokens()
    free = c.usable_hbm_bytes() - c.weight_bytes_per_gpu()
    assert alone == free // c.kv_bytes_per_token_per_gpu()
    staged = c.kv_capacity_tokens(staging_bytes_per_gpu=cm("mixtral-8x22b").weight_bytes_per_gpu())
    assert 0 < staged < alone
    assert c.kv_capacity_tokens(resident_weight_bytes_per_gpu=c.usable_hbm_bytes()) == 0
    with pytest.raises(ValueError, match=">= 0"):
        c.kv_capacity_tokens(staging_bytes_per_gpu=-1)


def _session_kv_bytes_per_gpu(server) -> int:
    """KV per GPU that the default trace's sessions hold at their longest (last prompt plus
    output), each in its own model's shapes."""
    models = {n: cm(n, server) for n in DEFAULT_CATALOG}
    return sum(
        (s.calls[-1].input_tokens + s.calls[-1].output_tokens)
        * models[s.model].kv_bytes_per_token_per_gpu()
        for s in default_trace()
    )


def test_h200x8_cannot_hold_all_three_models_and_the_sessions_kv() -> None:
    models = [cm(n) for n in DEFAULT_CATALOG]
    weights = sum(c.weight_bytes_per_gpu() for c in models)
    usable = models[0].usable_hbm_bytes()
    assert weights < usable  # the three models alone fit ...
    assert weights + _session_kv_bytes_per_gpu(H200X8) > usable  # ... not with the sessions' KV
    # one model resident plus a staged second leaves room for every session of the first
    qwen = models[0]
    staged = max(c.weight_bytes_per_gpu() for c in models[1:])
    assert qwen.kv_capacity_tokens(staging_bytes_per_gpu=staged) > 16 * 40_000


def test_h100x8_is_memory_tight() -> None:
    qwen = cm("qwen3-235b-a22b", H100X8)
    # the largest model alone leaves room for fewer tokens than the sessions hold
    assert qwen.kv_capacity_tokens() * qwen.kv_bytes_per_token_per_gpu() < (
        _session_kv_bytes_per_gpu(H100X8)
    )
    assert qwen.kv_capacity_tokens() < 10 * 40_000
    # and there is no room to stage a second large model beside it
    staged = cm("mistral-large-2407", H100X8).weight_bytes_per_gpu()
    assert qwen.kv_capacity_tokens(staging_bytes_per_gpu=staged) == 0


def test_efficiency_factors_scale_the_roofline() -> None:
    slow = CostModel(H200X8, ModelSpec.load("glm-4.5-air"), 8, Efficiency(compute=0.25))
    fast = cm("glm-4.5-air")
    assert slow.step_cost([(40_000, 0)]).compute_s == pytest.approx(
        2 * fast.step_cost([(40_000, 0)]).compute_s
    )


def test_from_names() -> None:
    c = CostModel.from_names("h100x8", "glm-4.5-air", tp=4)
    assert c.server is H100X8 and c.model.name == "glm-4.5-air" and c.tp == 4


def _cpu_like_efficiency() -> Efficiency:
    """Every host term of a measured CPU server non-zero (values of the order a calibration
    fits), so the terms test covers them."""
    return Efficiency(step_overhead_s=2e-4, layer_overhead_s=3e-5, moe_layer_overhead_s=2e-5,
                      seq_overhead_s=1e-5, tp_step_overhead_s=1e-4, elementwise_s_per_unit=1e-11,
                      decode_seq_layer_overhead_s=2e-6, decode_context_overhead_s=3e-9,
                      gemm_s_per_weight_byte=4e-12)


@pytest.mark.parametrize("model", ["qwen3-235b-a22b", "glm-4.5-air", "mistral-large-2407"])
@pytest.mark.parametrize("host_terms", [False, True])
def test_step_terms_price_every_step_as_the_cost_model_does(model: str, host_terms: bool) -> None:
    """``StepTerms`` (what the lower bound reasons with) and ``step_cost`` (what the
    simulator charges) are one rule: random mixed steps cost the same under both, with the
    presets' efficiency and with every host term of a measured CPU switched on."""
    import random

    from engine.sim.cost_model import combine
    from engine.sim.model_spec import ModelSpec
    from substrate.devices import server_preset

    eff = _cpu_like_efficiency() if host_terms else None
    cost = CostModel(server_preset("h200x8"), ModelSpec.load(model), 8, eff)
    t = cost.terms()
    rng = random.Random(0)
    for _ in range(100):
        chunks = [(rng.randint(1, 3000), rng.randint(0, 50_000)) for _ in range(rng.randint(0, 3))]
        decodes = rng.randint(0 if chunks else 1, 200)
        context = rng.randint(0, 40_000) * decodes
        tokens = decodes + sum(n for n, _ in chunks)
        rows = decodes + len(chunks)
        prefill_pairs = sum(n * ctx + n * (n + 1) / 2 for n, ctx in chunks)
        reads = context + sum(ctx for _, ctx in chunks)
        compute = (tokens * t.compute_per_token + rows * t.compute_per_row
                   + prefill_pairs * t.compute_per_prefill_pair
                   + (context + decodes) * t.compute_per_decode_pair + t.gemm(tokens, rows))
        memory = t.weights(tokens) + (reads + tokens) * t.kv_per_token
        seconds = (combine(compute, memory, t.overlap) + t.collective_fixed + t.overhead_fixed
                   + tokens * (t.collective_per_token + t.overhead_per_token)
                   + rows * (t.collective_per_row + t.overhead_per_row)
                   + decodes * t.overhead_per_decode + context * t.overhead_per_decode_context)
        assert seconds == pytest.approx(cost.step_cost(chunks, decodes, context).seconds,
                                        rel=1e-12)
    if host_terms:
        assert min(t.overhead_per_token, t.overhead_per_decode, t.overhead_per_decode_context,
                   t.gemm(2, 1), t.gemm(1, 2) - t.gemm(1, 1)) > 0
        assert t.gemm(1, 1) == 0.0
    weights = [t.weights(n) for n in (1, 2, 16, 256, 8192)]
    assert weights == sorted(weights)
    assert [w / n for w, n in zip(weights, (1, 2, 16, 256, 8192), strict=True)] == sorted(
        (w / n for w, n in zip(weights, (1, 2, 16, 256, 8192), strict=True)), reverse=True)


def test_host_copies_pay_the_servers_share_of_the_link_and_only_there() -> None:
    """A server whose rates were measured with every GPU copying (share 1.0, a calibrated
    one) prices a copy at its link; the presets at each GPU's share while all eight copy."""
    alone = dataclasses.replace(H200X8, host_link_share=1.0)
    shared, own = cm(), cm(server=alone)
    w = own.weight_bytes_per_gpu()
    assert own.switch_seconds_host() == w / (50 * GB)
    assert shared.switch_seconds_host() == pytest.approx(own.switch_seconds_host() / 0.5135,
                                                         rel=1e-3)
    assert shared.kv_restore_seconds(1_000) / own.kv_restore_seconds(1_000) == pytest.approx(
        1 / HOST_LINK_SHARE_ALL_GPUS)
    assert shared.switch_seconds_staged() == own.switch_seconds_staged()  # D2D: no host link
    assert shared.host_copy_rate(40e9) == pytest.approx(40e9 * HOST_LINK_SHARE_ALL_GPUS)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_host_link_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="host_link_share"):
        dataclasses.replace(H200X8, host_link_share=share)
