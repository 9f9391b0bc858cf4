"""Step and transfer times of a real server, for the simulated engine.

A step is a roofline: ``max(compute, memory)`` per GPU, where compute is the FLOPs over the
effective FLOP rate and memory the bytes over the effective HBM rate, plus the tensor-parallel
collectives (two all-reduces per layer, the vocab-parallel embedding's all-reduce and the
logits' all-gather) and a fixed per-step engine overhead. FLOPs count the active linear
parameters, the LM head for the rows that sample, and attention over the context (QK^T and
PV). Bytes count the weights a step touches (for MoE layers, the experts a batch of T tokens
is expected to hit) and the KV cache it reads and writes.

Terms a measured server (``talaria calibrate``: a CPU) needs and the GPU presets leave at
their neutral defaults, so the presets price exactly the roofline above:
- ``Efficiency.overlap``: how much of the smaller of compute and memory hides behind the
  larger (1: the roofline's max; a CPU's matrix products overlap little, so nearer the sum);
- the attention kernel's own rates (``DeviceSpec.attention_flops``, ``kv_read_bytes_per_s``,
  and the work per (query, key, head) score beyond its products, for prefill chunks
  (``attention_scores_per_s``: the softmax, which fused GPU kernels hide behind their
  matrix products) and for decodes (``decode_scores_per_s``: one query per sequence leaves
  a tiled kernel's per-tile work unshared));
- host overheads that grow with the work: per layer (launching its ops), per MoE layer, per
  scheduled sequence (bookkeeping, sampling), per step at TP > 1 (sending it to the ranks);
  per token, layer and hidden unit (the element-wise work between the matrix products:
  norms, rotary, activation, residual adds and the copies between them, which fused GPU
  kernels hide and a CPU pays token by token), per decoding sequence and layer (decode
  attention's own work per sequence: its cache writes, the per-sequence slices of its
  batched kernel), and per context token of the decodes (a step's metadata and masks over
  every decoding sequence's context, built once per step);
- ``gemm_s_per_weight_byte``: a matrix product of two or more rows costs this per byte of
  its weights beyond its FLOPs (a blocked kernel's fixed work per weight: at a few rows a
  CPU's products run far below their peak FLOP rate), which a one-row product (a
  matrix-vector kernel, a decode of one sequence) does not pay;
- ``moe_dense_max_tokens``: an engine that runs every expert on batches up to that size.

Switch times of the substrate (a model becoming active on the instance; other engines'
switches are in ``engine.sim.switching``):
- host: Talaria's substrate copies the weights into fixed addresses over the pinned host link;
- staged: the same copy device-to-device from the staging region.
All times are seconds; byte counts are per GPU (every rank moves its own shard in parallel).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.sim.efficiency import Efficiency
from engine.sim.model_spec import ModelSpec
from substrate.devices import ServerSpec, server_preset


@dataclass(frozen=True)
class StepCost:
    """The parts of one step's time; ``seconds`` is what the step takes."""

    compute_s: float
    memory_s: float
    allreduce_s: float
    overhead_s: float
    overlap: float = 1.0  # Efficiency.overlap
    # compute_s and memory_s by part: linear layers and LM head, attention's products and
    # its softmax work; weights and KV read
    parts: tuple[tuple[str, float], ...] = ()

    @property
    def seconds(self) -> float:
        both = combine(self.compute_s, self.memory_s, self.overlap)
        return both + self.allreduce_s + self.overhead_s

    @property
    def memory_bound(self) -> bool:
        return self.memory_s >= self.compute_s


@dataclass(frozen=True)
class StepTerms:
    """A step's time as sums over what it holds, per GPU: a step of T new tokens, R sampling
    rows, P prefill and Q decode (query, key) pairs of attention, S decodes attending X cached
    tokens (X = Q - S), reading K cached KV tokens:

    - compute ``C = T * compute_per_token + R * compute_per_row + P * compute_per_prefill_pair
      + Q * compute_per_decode_pair + gemm(T, R)`` (``gemm``: a measured CPU's blocked
      products' time per weight byte, paid by the layers' products if T > 1 and the LM
      head's if R > 1; 0 on the presets);
    - memory ``M = weights(T) + (K + T) * kv_per_token``;
    - ``collective_fixed + T * collective_per_token + R * collective_per_row`` (TP
      collectives) and ``overhead_fixed + T * overhead_per_token + R * overhead_per_row
      + S * overhead_per_decode + X * overhead_per_decode_context``;
    - the step takes ``combine(C, M, overlap)`` plus those two.

    ``CostModel._step`` prices exactly this (a test holds them equal), except that an engine
    that runs every expert on small batches (``Efficiency.moe_dense_max_tokens``, a measured
    CPU's) computes more for T up to that size: ``compute_per_token`` is then the least.
    ``weights(T)``: the weight bytes a step of T tokens reads, over the HBM rate; concave in T
    and ``weights(T) / T`` falls as T grows. Every term is >= 0 and ``combine`` grows with
    each argument, so leaving a term out prices a step at no more than it costs."""

    compute_per_token: float
    compute_per_row: float
    compute_per_prefill_pair: float
    compute_per_decode_pair: float
    kv_per_token: float
    collective_per_token: float
    collective_per_row: float
    collective_fixed: float
    overhead_per_token: float
    overhead_per_row: float
    overhead_per_decode: float
    overhead_per_decode_context: float
    overhead_fixed: float
    overlap: float
    weights: Callable[[int], float]
    gemm: Callable[[int, int], float]


def combine(compute_s: float, memory_s: float, overlap: float) -> float:
    """Compute and memory time of one step with ``overlap`` of the smaller hidden: the
    larger plus what is not hidden of the smaller (= overlap * max + (1 - overlap) * sum)."""
    return max(compute_s, memory_s) + (1.0 - overlap) * min(compute_s, memory_s)


class CostModel:
    """Step and transfer times of ``model`` on ``tp`` GPUs of ``server``."""

    def __init__(
        self,
        server: ServerSpec,
        model: ModelSpec,
        tp: int = 8,
        efficiency: Efficiency | None = None,
    ) -> None:
        if not 1 <= tp <= server.num_devices:
            raise ValueError(f"tp={tp} must be between 1 and the server's {server.num_devices} GPUs")
        if model.num_attention_heads % tp:
            raise ValueError(
                f"tp={tp} must divide {model.name}'s {model.num_attention_heads} attention heads"
            )
        if model.num_kv_heads % tp and tp % model.num_kv_heads:
            raise ValueError(
                f"tp={tp} and {model.name}'s {model.num_kv_heads} KV heads must divide one another"
            )
        self.server = server
        self.device = server.device
        # host copies run while every rank of the group copies its shard (ServerSpec)
        self.host_link_bytes_per_s = self.host_copy_rate(server.device.host_link_bytes_per_s)
        self.kv_offload_bytes_per_s = self.host_copy_rate(server.device.kv_offload_rate)
        self.kv_restore_bytes_per_s = self.host_copy_rate(server.device.kv_restore_rate)
        self.model = model
        self.tp = tp
        self.eff = efficiency or Efficiency.of_server(server)
        # a step's overhead as a constant plus one rate per variable of overhead_counts
        # (each count is affine in one of them): the hot path multiplies four numbers
        def priced(*shape: int) -> float:
            counts = self.overhead_counts(*shape)
            return sum(getattr(self.eff, term) * n for term, n in counts.items())

        self._overhead_fixed_s = priced(0, 0, 0, 0)
        self._overhead_per_token_s = priced(1, 0, 0, 0) - self._overhead_fixed_s
        self._overhead_per_row_s = priced(0, 1, 0, 0) - self._overhead_fixed_s
        self._overhead_per_decode_s = priced(0, 0, 1, 0) - self._overhead_fixed_s
        self._overhead_per_context_s = priced(0, 0, 0, 1) - self._overhead_fixed_s

    @classmethod
    def from_names(
        cls, server: str = "h200x8", model: str = "qwen3-235b-a22b", tp: int = 8
    ) -> CostModel:
        """A cost model for a server preset and a bundled model, by name."""
        return cls(server_preset(server), ModelSpec.load(model), tp)

    def overhead_counts(
        self, tokens: int, rows: int, decode_seqs: int, decode_context: int
    ) -> dict[str, float]:
        """How many of each host-overhead term (``OVERHEAD_TERMS``) a step of ``tokens``
        new tokens, ``rows`` sampling rows and ``decode_seqs`` decodes over
        ``decode_context`` tokens pays: its overhead is the sum of each count times the
        term's ``Efficiency`` value (and what a calibration fits those values from)."""
        m = self.model
        return {"step_overhead_s": 1.0, "layer_overhead_s": float(m.num_layers),
                "moe_layer_overhead_s": float(m.num_moe_layers), "seq_overhead_s": float(rows),
                "tp_step_overhead_s": 1.0 if self.tp > 1 else 0.0,
                "elementwise_s_per_unit": float(tokens * m.num_layers * m.hidden_size),
                "decode_seq_layer_overhead_s": float(decode_seqs * m.num_layers),
                "decode_context_overhead_s": float(decode_context)}

    # --- memory -----------------------------------------------------------------------------
    def weight_bytes_per_gpu(self) -> int:
        """Every weight matrix is sharded over the TP ranks (vocab-parallel embeddings too)."""
        return math.ceil(self.model.weight_bytes / self.tp)

    @property
    def kv_heads_per_gpu(self) -> int:
        """KV heads are split over ranks; with fewer KV heads than ranks each rank keeps one."""
        return max(1, self.model.num_kv_heads // self.tp)

    def kv_bytes_per_token_per_gpu(self) -> int:
        m = self.model
        return 2 * m.num_layers * self.kv_heads_per_gpu * m.head_dim * m.kv_dtype_bytes

    def usable_hbm_bytes(self) -> int:
        """HBM per GPU that weights, staging and KV may use (the rest is the engine reserve)."""
        return int(self.device.hbm_bytes * (1.0 - self.eff.memory_reserve_fraction))

    def kv_capacity_tokens(
        self, resident_weight_bytes_per_gpu: int | None = None, staging_bytes_per_gpu: int = 0
    ) -> int:
        """Tokens of this model's KV that fit per instance beside the resident weights (default:
        this model's own) and a staging region; 0 when nothing is left."""
        weights = (
            self.weight_bytes_per_gpu()
            if resident_weight_bytes_per_gpu is None
            else resident_weight_bytes_per_gpu
        )
        if weights < 0 or staging_bytes_per_gpu < 0:
            raise ValueError("resident weight and staging bytes must be >= 0")
        free = self.usable_hbm_bytes() - weights - staging_bytes_per_gpu
        return max(0, free // self.kv_bytes_per_token_per_gpu())

    # --- compute ----------------------------------------------------------------------------
    def _experts_touched_fraction(self, num_tokens: int) -> float:
        """Expected share of a MoE layer's routed experts that ``num_tokens`` tokens hit under
        uniform routing: 1 - (1 - k/E)^T; all of them where the engine runs every expert."""
        m = self.model
        if m.num_moe_layers == 0 or num_tokens <= 0:
            return 0.0
        if num_tokens <= self.eff.moe_dense_max_tokens:
            return 1.0
        return 1.0 - (1.0 - m.num_experts_per_tok / m.num_experts) ** num_tokens

    def _linear_flops(self, tokens: int, logit_rows: int) -> float:
        m = self.model
        params = m.active_linear_params
        if m.num_moe_layers and tokens <= self.eff.moe_dense_max_tokens:
            params += m.num_moe_layers * (m.num_experts - m.num_experts_per_tok) * m.expert_params
        return 2.0 * params * tokens + 2.0 * m.vocab_size * m.hidden_size * logit_rows

    def _step(
        self, tokens: int, attention_pairs: float, kv_read_tokens: int, logit_rows: int,
        decode_pairs: float = 0.0, decode_seqs: int = 0,
    ) -> StepCost:
        """One forward pass over ``tokens`` new tokens. ``attention_pairs`` is the number of
        (query, key) pairs attention scores, ``decode_pairs`` of them the decodes' (one query
        per sequence, ``decode_seqs`` of them); ``kv_read_tokens`` the KV tokens it reads."""
        if tokens <= 0:
            return StepCost(0.0, 0.0, 0.0, 0.0)
        m, tp, dev, eff = self.model, self.tp, self.device, self.eff
        flop_rate = dev.bf16_flops * eff.compute
        hbm_rate = dev.hbm_bytes_per_s * eff.memory
        scores = m.num_layers * m.num_attention_heads * attention_pairs / tp
        decode_scores = m.num_layers * m.num_attention_heads * decode_pairs / tp
        layer_bytes, head_bytes = self._gemm_bytes(tokens)
        linear_s = (self._linear_flops(tokens, logit_rows) / tp / flop_rate
                    + self._gemm_of(layer_bytes, head_bytes, tokens, logit_rows))
        attention_s = 4.0 * m.head_dim * scores / (dev.attention_flops or flop_rate)
        prefill_rate, decode_rate = dev.attention_scores_per_s, dev.decode_scores_per_s
        scores_s = ((scores - decode_scores) / prefill_rate if prefill_rate else 0.0) + (
            decode_scores / decode_rate if decode_rate else 0.0)
        weight_bytes = layer_bytes + head_bytes
        kv_bytes = (kv_read_tokens + tokens) * self.kv_bytes_per_token_per_gpu()
        weights_s = weight_bytes / tp / hbm_rate
        kv_s = kv_bytes / (dev.kv_read_bytes_per_s or hbm_rate)
        overhead_s = (self._overhead_fixed_s + tokens * self._overhead_per_token_s
                      + logit_rows * self._overhead_per_row_s
                      + decode_seqs * self._overhead_per_decode_s
                      + (decode_pairs - decode_seqs) * self._overhead_per_context_s)
        return StepCost(linear_s + attention_s + scores_s, weights_s + kv_s,
                        self._collective_seconds(tokens, logit_rows), overhead_s, eff.overlap,
                        (("linear", linear_s), ("attention", attention_s), ("scores", scores_s),
                         ("weights", weights_s), ("kv", kv_s)))

    def _gemm_bytes(self, tokens: int) -> tuple[float, float]:
        """The weight bytes of the decoder layers a step of ``tokens`` tokens touches, and of
        the LM head."""
        m = self.model
        layer_bytes = (
            m.always_active_linear_params
            + self._experts_touched_fraction(tokens) * m.routed_expert_params
        ) * m.weight_dtype_bytes
        return layer_bytes, m.vocab_size * m.hidden_size * max(2, m.weight_dtype_bytes)

    def least_weights_seconds(self, max_tokens: int, min_tokens: int = 1) -> float:
        """The least ``StepTerms.weights`` over steps of ``min_tokens`` to ``max_tokens``
        tokens. It grows with the tokens (more of a MoE layer's experts hit) but for an
        engine that runs every expert up to ``moe_dense_max_tokens`` (``dense_moe``), whose
        next size reads only the experts its tokens hit: the least is at the smallest size or
        just past that range."""
        t = self.terms()
        sizes = {min_tokens}
        dense = self.eff.moe_dense_max_tokens
        if self.dense_moe and min_tokens <= dense < max_tokens:
            sizes.add(dense + 1)
        return min(t.weights(n) for n in sizes)

    @property
    def dense_moe(self) -> bool:
        """Whether a step of a few tokens runs every MoE expert (and so may cost more than
        one of a few more tokens)."""
        return bool(self.model.num_moe_layers) and self.eff.moe_dense_max_tokens > 0

    def terms(self) -> StepTerms:
        """This model's step time as sums over what a step holds (``StepTerms``)."""
        m, tp, dev, eff = self.model, self.tp, self.device, self.eff
        flop_rate = dev.bf16_flops * eff.compute
        hbm_rate = dev.hbm_bytes_per_s * eff.memory
        per_score = m.num_layers * m.num_attention_heads / tp
        attention = 4.0 * m.head_dim / (dev.attention_flops or flop_rate)
        prefill_rate, decode_rate = dev.attention_scores_per_s, dev.decode_scores_per_s
        kv_rate = dev.kv_read_bytes_per_s or hbm_rate
        one_reduce = self._collective_seconds(1, 0)
        two_reduces = self._collective_seconds(2, 0)
        one_row = self._collective_seconds(1, 1)
        per_token_collective = two_reduces - one_reduce
        return StepTerms(
            compute_per_token=2.0 * m.active_linear_params / tp / flop_rate,
            compute_per_row=2.0 * m.vocab_size * m.hidden_size / tp / flop_rate,
            compute_per_prefill_pair=per_score * (
                attention + (1.0 / prefill_rate if prefill_rate else 0.0)),
            compute_per_decode_pair=per_score * (
                attention + (1.0 / decode_rate if decode_rate else 0.0)),
            kv_per_token=self.kv_bytes_per_token_per_gpu() / kv_rate,
            collective_per_token=per_token_collective,
            collective_per_row=one_row - one_reduce,
            collective_fixed=one_reduce - per_token_collective,
            overhead_per_token=self._overhead_per_token_s,
            overhead_per_row=self._overhead_per_row_s,
            overhead_per_decode=self._overhead_per_decode_s,
            overhead_per_decode_context=self._overhead_per_context_s,
            overhead_fixed=self._overhead_fixed_s,
            overlap=eff.overlap,
            weights=lambda tokens: dict(self._step(tokens, 0.0, 0, 0).parts)["weights"],
            gemm=self._gemm_seconds,
        )

    def _gemm_seconds(self, tokens: int, rows: int) -> float:
        return self._gemm_of(*self._gemm_bytes(tokens), tokens, rows)

    def _gemm_of(self, layer_bytes: float, head_bytes: float, tokens: int, rows: int) -> float:
        """The per-weight-byte product time: the layers' products if more than one token,
        the LM head's if more than one row."""
        return ((layer_bytes if tokens > 1 else 0.0) + (head_bytes if rows > 1 else 0.0)
                ) / self.tp * self.eff.gemm_s_per_weight_byte

    def _collective_seconds(self, tokens: int, logit_rows: int) -> float:
        """Two ring all-reduces per layer (after attention, after the MLP/MoE), one for the
        vocab-parallel embedding, and the all-gather of the logits of the sampling rows."""
        tp = self.tp
        if tp == 1:
            return 0.0
        m = self.model
        rate = self.device.nvlink_bytes_per_s * self.eff.nvlink
        act = m.activation_dtype_bytes
        reduce_one = 2.0 * (tp - 1) / tp * tokens * m.hidden_size * act / rate
        gather = (tp - 1) / tp * logit_rows * m.vocab_size * act / rate
        latency = self.eff.allreduce_latency_s
        return (2 * m.num_layers + 1) * (reduce_one + latency) + gather + latency

    def prefill_seconds(self, num_tokens: int, context_tokens: int = 0) -> float:
        """Prefill ``num_tokens`` new tokens of one sequence after ``context_tokens`` cached
        ones, as one pass (the simulated engine chunks long prompts itself)."""
        _check_non_negative(num_tokens=num_tokens, context_tokens=context_tokens)
        return self.step_seconds(prefill_tokens=num_tokens, prefill_context=context_tokens)

    def decode_step_seconds(self, batch_size: int, total_context_tokens: int) -> float:
        """One decode step of ``batch_size`` sequences whose contexts sum to
        ``total_context_tokens``."""
        _check_non_negative(batch_size=batch_size, total_context_tokens=total_context_tokens)
        return self.step_seconds(decode_seqs=batch_size, decode_context=total_context_tokens)

    def step_seconds(
        self,
        prefill_tokens: int = 0,
        prefill_context: int = 0,
        decode_seqs: int = 0,
        decode_context: int = 0,
    ) -> float:
        """A mixed step: a prefill chunk of ``prefill_tokens`` after ``prefill_context`` cached
        tokens of its sequence, plus ``decode_seqs`` decodes over ``decode_context`` tokens in
        all. For several prefill chunks in one step use :meth:`chunks_step_seconds`."""
        _check_non_negative(prefill_tokens=prefill_tokens, prefill_context=prefill_context)
        if prefill_context and not prefill_tokens:
            raise ValueError("prefill_context given without prefill tokens")
        chunks = [(prefill_tokens, prefill_context)] if prefill_tokens > 0 else []
        return self.step_cost(chunks, decode_seqs, decode_context).seconds

    def chunks_step_seconds(
        self, prefill_chunks: Sequence[tuple[int, int]], decode_seqs: int = 0,
        decode_context: int = 0,
    ) -> float:
        """A mixed step with prefill chunks given as ``(new_tokens, cached_context)`` pairs."""
        return self.step_cost(prefill_chunks, decode_seqs, decode_context).seconds

    def step_cost(
        self, prefill_chunks: Sequence[tuple[int, int]], decode_seqs: int = 0,
        decode_context: int = 0,
    ) -> StepCost:
        """The parts of a mixed step's time. Each prefill chunk's last row samples (it may
        finish its prompt); every decode row samples."""
        _check_non_negative(decode_seqs=decode_seqs, decode_context=decode_context)
        if decode_context and not decode_seqs:
            raise ValueError("decode_context given without decode sequences")
        tokens = decode_seqs
        decode_pairs = pairs = float(decode_context + decode_seqs)
        kv_read = decode_context
        rows = decode_seqs
        for new, ctx in prefill_chunks:
            _check_non_negative(prefill_tokens=new, prefill_context=ctx)
            if new == 0:
                continue
            tokens += new
            pairs += new * ctx + new * (new + 1) / 2.0
            kv_read += ctx
            rows += 1
        return self._step(tokens, pairs, kv_read, rows, decode_pairs, decode_seqs)

    # --- moving bytes -----------------------------------------------------------------------
    def host_copy_rate(self, alone_bytes_per_s: float) -> float:
        """What a host copy measured at ``alone_bytes_per_s`` on one GPU copying alone gets
        per GPU here, where every GPU of the server copies at once."""
        return alone_bytes_per_s * self.server.host_link_share

    def switch_seconds_host(self) -> float:
        """Activate from the pinned host weight store into fixed addresses (H2D)."""
        return self.weight_bytes_per_gpu() / self.host_link_bytes_per_s

    def switch_seconds_staged(self) -> float:
        """Activate from the device staging region (D2D copy)."""
        return self.weight_bytes_per_gpu() / self.device.d2d_bytes_per_s

    def kv_copy_seconds(self, tokens: int, bytes_per_s: float) -> float:
        """Copy ``tokens`` tokens of KV between device and host at ``bytes_per_s`` per GPU
        (every rank its own heads)."""
        _check_non_negative(tokens=tokens)
        return tokens * self.kv_bytes_per_token_per_gpu() / bytes_per_s

    def kv_offload_seconds(self, tokens: int) -> float:
        """Copy ``tokens`` tokens of KV to pinned host memory."""
        return self.kv_copy_seconds(tokens, self.kv_offload_bytes_per_s)

    def kv_restore_seconds(self, tokens: int) -> float:
        """Copy ``tokens`` tokens of KV back from pinned host memory."""
        return self.kv_copy_seconds(tokens, self.kv_restore_bytes_per_s)


def _check_non_negative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
