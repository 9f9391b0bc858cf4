"""How far a real engine falls short of a server's datasheet (``Efficiency``): the fractions
of its peaks it reaches, fixed latencies, and the host terms a measured server adds (see
``engine.sim.cost_model``'s module doc for what each prices)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from substrate.devices import ServerSpec

__all__ = ["OVERHEAD_TERMS", "Efficiency"]

# The host-overhead terms of Efficiency, each priced per unit of CostModel.overhead_counts.
OVERHEAD_TERMS = ("step_overhead_s", "layer_overhead_s", "moe_layer_overhead_s", "seq_overhead_s",
                  "tp_step_overhead_s", "elementwise_s_per_unit", "decode_seq_layer_overhead_s",
                  "decode_context_overhead_s")


@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peaks a real engine reaches, and fixed latencies. Each is named
    with where it comes from; the ones marked 'assumption' are judgement within public ranges."""

    # Large bf16 GEMMs reach 60-75% of dense peak on Hopper (FlashAttention-3 paper: 740 of 989
    # TFLOP/s for attention; cuBLAS GEMMs similar); MoE grouped GEMMs with TP=8-sharded experts
    # and uneven routing reach less. 0.5 is an assumption inside that range.
    compute: float = 0.5
    # Decode kernels stream weights and KV at 75-90% of HBM peak (assumption, typical of
    # memory-bound kernels on HBM3/HBM3e).
    memory: float = 0.8
    # NCCL all-reduce bus bandwidth on an 8-GPU NVSwitch node reaches roughly 70-85% of the
    # per-direction NVLink rate for large messages (assumption from published nccl-tests
    # all_reduce_perf busbw figures); 0.75 assumed.
    nvlink: float = 0.75
    # Latency of one small all-reduce inside a CUDA graph on NVLink (vLLM's custom all-reduce
    # and NCCL report ~5-15 us for KB-sized messages); 8 us assumed.
    allreduce_latency_s: float = 8e-6
    # Per-step engine overhead outside the GPU kernels (scheduling, sampling, detokenise,
    # launching the graph): assumption, 3 ms, the order of the per-step CPU time that vLLM's V1
    # engine redesign (vLLM blog, 2025-01-27) set out to overlap with GPU work.
    step_overhead_s: float = 3e-3
    # vLLM's default gpu_memory_utilization is 0.9: the other 10% of HBM is left for the CUDA
    # context, NCCL buffers, activations and CUDA graphs (vLLM EngineArgs documentation).
    memory_reserve_fraction: float = 0.10
    # Terms of a measured server (see the module doc); neutral for the GPU presets, whose
    # per-step overhead above stands for the whole host side of a step.
    overlap: float = 1.0
    layer_overhead_s: float = 0.0
    moe_layer_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0
    tp_step_overhead_s: float = 0.0
    elementwise_s_per_unit: float = 0.0
    decode_seq_layer_overhead_s: float = 0.0
    decode_context_overhead_s: float = 0.0
    gemm_s_per_weight_byte: float = 0.0
    moe_dense_max_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("compute", "memory", "nvlink"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Efficiency.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"Efficiency.overlap must be in [0, 1], got {self.overlap!r}")
        for name in ("allreduce_latency_s", *OVERHEAD_TERMS, "gemm_s_per_weight_byte",
                     "moe_dense_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"Efficiency.{name} must be >= 0, got {getattr(self, name)!r}")

    @classmethod
    def of_server(cls, server: ServerSpec) -> Efficiency:
        """The defaults with the server's own overrides (a measured server's)."""
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, float | int] = {}
        for name, value in server.efficiency:
            if name not in known:
                raise ValueError(f"server {server.name!r}: unknown efficiency field {name!r}")
            values[name] = int(value) if known[name] == "int" else value
        return cls(**values)
