"""What a session's calls cost at the least under the simulator's physics: alone, and as work
the server must do whatever the schedule.

A call's *shape* (``CallShape``) is its prompt, the part of it whose KV any schedule could
have kept from the session's earlier calls (whole blocks of the previous prompt and output,
never the prompt's last token, as the replay counts ``reusable``), and its output.

- ``alone_seconds``: the call with its session alone on the server, its model resident and
  that prefix cached: prefill chunks of the step budget (the remainder first, then whole
  chunks) and one decode step per further output token, at batch 1, priced by the cost
  model. Every step of any schedule that serves the call includes these tokens, and on the
  presets a step never costs less for holding more, so no schedule serves the call faster;
  on an engine that runs every MoE expert for small batches a step of a few more tokens can
  cost less, which ``critical_seconds``, the bound's, allows for.
- ``WorkModel``: a lower bound on the server time the call takes from a busy server, additive
  over calls, for the capacity bound (``workloads.bounds.bound``). A step costs
  ``combine(C, M) + collectives + overhead >= lam * C + (1 - lam) * M + collectives +
  overhead`` for any ``lam`` in [0, 1]; C, the KV part of M and the per-token and per-row
  parts of the collectives and overhead are sums over the step's tokens and rows
  (``engine.sim.cost_model.StepTerms``). What is left, G(T) for a step of T tokens (the
  collectives' latency, the step overhead and ``1 - lam`` of the weights read), has G(T) / T
  falling as T grows (G itself grows, but for an engine that runs every MoE expert for
  small batches: its G drops just past that range), and is shared out three ways, mixed by
  ``shares``: by tokens, G(B) / B each (a step holds at most B = ``max_num_batched_tokens``);
  by decodes, G_D / D each (at most D decodes: ``max_num_seqs``, and one per session of
  the model, as a session has one call in flight; G_D the least G of a step of D to B
  tokens, which is G(D) but past a dense range); by context, G_least * L / K for a decode
  attending L cached tokens (the KV every decode of a step attends is on the device at
  once, at most K = the model's largest KV region; G_least the least G over steps of 1 to
  B tokens, ``CostModel.least_weights_seconds``). Each way gives out at most G(T) per
  step, and so does any mix. Prefill rows and KV reads are counted at their fewest (the
  fewest chunks, the short one first). The host's per-token, per-decode and per-context
  overheads are sums too and count in full; a measured CPU's per-weight-byte product time
  (``StepTerms.gemm``, 0 on the GPU presets) is left out, which only lowers the bound.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from engine.sim.cost_model import CostModel, StepTerms, combine
from engine.sim.step_time import DecodeLine
from workloads.traces.trace import Session

__all__ = ["CallShape", "WorkModel", "alone_seconds", "answer_tokens", "call_shapes",
           "critical_seconds", "prefill_chunks", "prefill_seconds", "replayed_lengths",
           "step_fixed_seconds"]


@dataclass(frozen=True)
class CallShape:
    prompt: int  # prompt tokens
    cached: int  # of those, at most this many could have their KV cached (whole blocks)
    output: int  # output tokens (the first sampled by the prefill's last chunk)

    @property
    def new_tokens(self) -> int:
        return self.prompt - self.cached


def answer_tokens(input_tokens: int, output_tokens: int, max_tokens: int | None,
                  context: int | None) -> int:
    """The answer a simulated replay gets: the trace's, cut where the replay's ``max_tokens``
    stops it and where the prompt leaves no more context (``workloads.replay.driver``)."""
    limits = [output_tokens]
    if max_tokens is not None:
        limits.append(max_tokens)
    if context is not None:
        limits.append(context - input_tokens)
    return max(0, min(limits))


def replayed_lengths(sessions: Sequence[Session], max_tokens: int | None,
                     context: Mapping[str, int] | None) -> dict[tuple[str, int], int]:
    """(session id, call index) -> prompt + answer tokens as the replay makes them (what a
    call ``prefix_from`` it finds)."""
    return {(s.session_id, k): c.input_tokens + answer_tokens(
                c.input_tokens, c.output_tokens, max_tokens, (context or {}).get(s.model))
            for s in sessions for k, c in enumerate(s.calls)}


def call_shapes(session: Session, block_size: int,
                parent_lengths: dict[tuple[str, int], int] | None = None, *,
                max_tokens: int | None = None, context: int | None = None,
                continued: Collection[tuple[str, int]] | None = None) -> list[CallShape]:
    """Each call's shape. A call extending its session's previous one may find the previous
    prompt and output cached, but for the output's last token (its KV is never computed); a
    call starting with an earlier call of its own session (``prefix_from``) that call's
    prompt and whole output (the call after it computed the last token);
    ``prefix_from`` another session's call counts that call's prompt and output
    (``parent_lengths``: (session id, call index) -> prompt + output tokens; missing: none).
    Outputs are the answers the replay gets (``answer_tokens``: cut at ``max_tokens`` and
    at the model's ``context``), not always the trace's. ``continued`` (the bound's count):
    the (session id, call index) of calls another session's prompt continues; another
    session's prefill may then have computed such a call's last token before this session's
    next call, and the parent's next call may have computed it before a continuing session's
    call, so those prefixes count whole (None: as a session alone computes them)."""
    shapes = []
    totals: list[int] = []  # each earlier call's prompt + output tokens of this session
    for k, call in enumerate(session.calls):
        output = answer_tokens(call.input_tokens, call.output_tokens, max_tokens, context)
        computed = 0
        ref = call.prefix_from
        if ref is not None and ref.session_id != session.session_id:
            whole = (parent_lengths or {}).get((ref.session_id, ref.call), 0)
            computed = whole if continued is not None else max(0, whole - 1)
        elif ref is not None and 0 <= ref.call < k - 1:
            # an earlier call than the last: the call after it computed its answer's last token
            computed = totals[ref.call]
        elif k > 0:
            whole = continued is not None and (session.session_id, k - 1) in continued
            computed = totals[-1] if whole else totals[-1] - 1
        if call.prefix_tokens is not None:
            computed = min(computed, call.prefix_tokens)
        cached = min(computed, call.input_tokens - 1) // block_size * block_size
        shapes.append(CallShape(call.input_tokens, max(0, cached), output))
        totals.append(call.input_tokens + output)
    return shapes


def prefill_chunks(shape: CallShape, budget: int, short_first: bool = True) -> list[tuple[int, int]]:
    """The fewest chunks of at most ``budget`` tokens as ``(new tokens, cached context)``
    pairs: the short one first (the fewest KV reads), or last, as the engine's scheduler
    takes them (``short_first`` False: whole budgets while they fit)."""
    new = shape.new_tokens
    count = max(1, math.ceil(new / budget))
    short = new - (count - 1) * budget
    sizes = [short] + [budget] * (count - 1) if short_first else [budget] * (count - 1) + [short]
    chunks = []
    at = shape.cached
    for size in sizes:
        chunks.append((size, at))
        at += size
    return chunks


def prefill_seconds(cost: CostModel, shape: CallShape, budget: int) -> float:
    """The call's prefill alone, as the engine's scheduler chunks it: whole budgets, then the
    rest (its last chunk samples the first output token)."""
    return sum(cost.step_cost([chunk]).seconds
               for chunk in prefill_chunks(shape, budget, short_first=False))


def alone_seconds(cost: CostModel, shape: CallShape, budget: int) -> float:
    """The call alone on the server, as the engine serves it: its model resident, its
    cacheable prefix cached, the prefill (``prefill_seconds``), then one decode step per
    further output token."""
    return prefill_seconds(cost, shape, budget) + _decode_alone(cost, shape)


def critical_seconds(cost: CostModel, shape: CallShape, budget: int) -> float:
    """A lower bound on the call's latency in any schedule: its prefill steps cost at least
    ``max(sum C, sum M)`` over the fewest chunks, short first (the compute is the same
    whatever the chunking; the weights, KV reads and fixed parts are fewest so), plus their
    collectives and overheads; each decode step at least a step of this call alone. On an
    engine that runs every MoE expert for small batches (``CostModel.dense_moe``) a step of
    a few more tokens may cost less than one of this call's alone, so there a chunk reads
    the least weights of any step that could hold it and a decode step is priced from its
    own terms at the least weights and least compute (``_decode_least``)."""
    t = cost.terms()
    chunks = prefill_chunks(shape, budget)
    new = shape.new_tokens
    pairs = new * shape.cached + new * (new + 1) / 2.0
    rows = len(chunks)
    compute = (new * t.compute_per_token + rows * t.compute_per_row
               + pairs * t.compute_per_prefill_pair)
    memory = (sum(cost.least_weights_seconds(budget, n) for n, _ in chunks)
              + (sum(ctx for _, ctx in chunks) + new) * t.kv_per_token)
    rest = (rows * (t.collective_fixed + t.overhead_fixed + t.collective_per_row
                    + t.overhead_per_row) + new * (t.collective_per_token + t.overhead_per_token))
    return combine(compute, memory, t.overlap) + rest + _decode_least(cost, shape, budget)


def step_fixed_seconds(t: StepTerms, lam: float, weights_s: float) -> float:
    """G: what a step costs beyond its tokens' and rows' own terms under ``lam`` (the
    collectives' latency, the step overhead and ``1 - lam`` of the weights read, ``weights_s``:
    ``t.weights(T)`` for a step of T tokens)."""
    return t.collective_fixed + t.overhead_fixed + (1.0 - lam) * weights_s


def _decode_alone(cost: CostModel, shape: CallShape) -> float:
    decodes = shape.output - 1
    return DecodeLine.of(cost, 1).seconds(shape.prompt, decodes) if decodes > 0 else 0.0


def _decode_least(cost: CostModel, shape: CallShape, budget: int) -> float:
    """The call's decode steps at the least any step holding them costs: as alone, but on a
    ``dense_moe`` engine each from the decode's own ``StepTerms`` (one token, one row, its
    attention pairs and KV reads) at the least weights and compute of a step of 1 to
    ``budget`` tokens."""
    decodes = shape.output - 1
    if decodes <= 0:
        return 0.0
    if not cost.dense_moe:
        return _decode_alone(cost, shape)
    t = cost.terms()
    line = DecodeLine(
        num_seqs=1,
        compute0=t.compute_per_token + t.compute_per_row + t.compute_per_decode_pair,
        compute_per_token=t.compute_per_decode_pair,
        memory0=cost.least_weights_seconds(budget) + t.kv_per_token,
        memory_per_token=t.kv_per_token,
        fixed=(t.collective_fixed + t.collective_per_token + t.collective_per_row
               + t.overhead_fixed + t.overhead_per_token + t.overhead_per_row
               + t.overhead_per_decode),
        overlap=t.overlap,
        fixed_per_token=t.overhead_per_decode_context,
    )
    return line.seconds(shape.prompt, decodes)


@dataclass(frozen=True)
class WorkModel:
    """The coefficients of a call's least server time under ``lam`` and ``shares`` (see the
    module doc), read off the cost model's ``StepTerms``."""

    per_prefill_token: float
    per_decode_token: float
    per_decode_context: float  # per cached token a decode attends (its share of the step + host)
    per_row: float
    per_prefill_pair: float
    per_decode_pair: float
    per_kv_read: float
    budget: int

    @classmethod
    def of(cls, cost: CostModel, max_decodes: int, max_num_batched_tokens: int,
           kv_capacity_tokens: int, lam: float, shares: tuple[float, float, float]) -> WorkModel:
        """``max_decodes``: the most decodes a step of this model can hold; ``shares``: how
        a step's fixed cost is shared out (by tokens, by decodes, by decode context)."""
        if abs(sum(shares) - 1.0) >= 1e-9:
            raise ValueError(f"shares must sum to 1, got {shares}")
        return cls._shared(cost, max_decodes, max_num_batched_tokens, kv_capacity_tokens,
                           lam, shares)

    @classmethod
    def token_terms(cls, cost: CostModel, max_num_batched_tokens: int, lam: float) -> WorkModel:
        """The coefficients with no share of a step's fixed cost G: what a call's tokens and
        rows add to the steps that hold them, the steps' own G left to be charged per step
        (``workloads.bounds.decode_steps``)."""
        return cls._shared(cost, 1, max_num_batched_tokens, 1, lam, (0.0, 0.0, 0.0))

    @classmethod
    def _shared(cls, cost: CostModel, max_decodes: int, max_num_batched_tokens: int,
                kv_capacity_tokens: int, lam: float,
                shares: tuple[float, float, float]) -> WorkModel:
        by_tokens, by_decodes, by_context = shares
        if not (0.0 <= lam <= 1.0 and min(shares) >= 0.0):
            raise ValueError(f"lam must be in [0, 1] and shares non-negative, got "
                             f"{lam}, {shares}")
        t = cost.terms()
        seqs, budget = max_decodes, max_num_batched_tokens

        def fixed(tokens: int) -> float:  # a step's cost that no token's own term covers
            return step_fixed_seconds(t, lam, t.weights(tokens))

        least = step_fixed_seconds(t, lam, cost.least_weights_seconds(budget))

        per_token = (lam * t.compute_per_token + (1.0 - lam) * t.kv_per_token
                     + t.collective_per_token + t.overhead_per_token)
        token_share = by_tokens * fixed(budget) / budget
        # a step of D decodes or more: the least G over those sizes (G may drop past a
        # dense range, so a larger step than D decodes may cost less than G(D))
        decode_fixed = step_fixed_seconds(t, lam, cost.least_weights_seconds(max(budget, seqs),
                                                                             seqs))
        return cls(
            per_prefill_token=per_token + token_share,
            per_decode_token=(per_token + token_share + by_decodes * decode_fixed / seqs
                              + t.overhead_per_decode),
            per_decode_context=(by_context * least / kv_capacity_tokens
                                + t.overhead_per_decode_context),
            per_row=lam * t.compute_per_row + t.collective_per_row + t.overhead_per_row,
            per_prefill_pair=lam * t.compute_per_prefill_pair,
            per_decode_pair=lam * t.compute_per_decode_pair,
            per_kv_read=(1.0 - lam) * t.kv_per_token,
            budget=budget,
        )

    def call_seconds(self, shape: CallShape) -> float:
        """A lower bound on the server time ``shape`` takes in any schedule (additive)."""
        chunks = prefill_chunks(shape, self.budget)
        new = shape.new_tokens
        # a prefill token at position p attends p + 1 keys
        pre_pairs = new * shape.cached + new * (new + 1) / 2.0
        pre_reads = sum(ctx for _, ctx in chunks)
        decodes = max(0, shape.output - 1)
        # decode j (0-based) runs after prompt + j computed tokens and attends those and itself
        dec_reads = decodes * shape.prompt + decodes * (decodes - 1) / 2.0
        return (new * self.per_prefill_token + len(chunks) * self.per_row
                + pre_pairs * self.per_prefill_pair + pre_reads * self.per_kv_read
                + decodes * (self.per_decode_token + self.per_row)
                + (dec_reads + decodes) * self.per_decode_pair
                + dec_reads * (self.per_kv_read + self.per_decode_context))
