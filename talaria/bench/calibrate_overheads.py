"""The live engine's host overheads and the rates it reads memory at, fitted for ``talaria
calibrate``: what its steps take beyond the matrix products and attention's compute,
priced with the rates the micro-benchmarks measured.

The steps are those of checkpoints made for it, of the two widths the tiny catalogs have
(``tiny`` and ``small``), dense and MoE, of 1 and 4 layers (the catalogs' models have 2 and
8): decodes of 1, 4 and 32 sequences after 16 tokens and of 4 after 1024 and 16 after 384
and 2048 (where reading the KV is most of the step), and prefill chunks of 48 and 512
tokens, shapes the step-time check does not time. Each term
of ``CostModel.overhead_counts`` is one column, and so are the weight bytes a step reads,
those its products of two or more rows pay their fixed work on (``Efficiency.
gemm_s_per_weight_byte``), the decodes' KV bytes and their (query, key, head) scores:
memory is priced at the rates
the engine reads it at between its other ops (its weights slower than a loop of bare
products streams them: the ops between evict what the prefetcher brought), and decode
attention at what the engine's own decode path costs. The fit is the non-negative
least-squares one of the residuals relative to each step's time (a 1 ms step weighs as
much as a 100 ms one); compute and memory add up there, as a CPU's do (its measured
``Efficiency.overlap`` is 0). The tensor-parallel terms come after, from the 1- and
4-layer dense checkpoints of the first width at TP=2 against their TP=1 fit: a TP step costs a fixed send
to the ranks and ``2 L + 2`` collectives, each priced at the latency seen inside a step
(several times an isolated ping's on a 2-core machine, where a collective also waits for
the slower rank).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.sim.cost_model import CostModel
from engine.sim.efficiency import OVERHEAD_TERMS
from engine.sim.model_spec import ModelSpec
from substrate.devices import ServerSpec
from talaria.bench.step_points import MeasuredStep, StepPoint, measure_steps

__all__ = ["OVERHEAD_POINTS", "FitStep", "fit_engine", "fit_overheads", "nnls"]

OVERHEAD_LAYERS = (1, 4)
OVERHEAD_POINTS = (StepPoint("decode", 1, 16), StepPoint("decode", 4, 16),
                   StepPoint("decode", 32, 16), StepPoint("decode", 4, 1024),
                   StepPoint("decode", 16, 384), StepPoint("decode", 16, 2048),
                   StepPoint("prefill", 48, 0), StepPoint("prefill", 512, 0))
TP_POINT = StepPoint("decode", 1, 16)
WEIGHTS_TERM = "weights_s_per_byte"
GEMM_TERM = "gemm_s_per_weight_byte"
KV_TERM = "kv_read_s_per_byte"
DECODE_SCORE_TERM = "decode_s_per_score"
# fitted at TP=1 (the TP step's own terms come after)
TP1_TERMS = (*(t for t in OVERHEAD_TERMS if t != "tp_step_overhead_s"), GEMM_TERM, WEIGHTS_TERM,
             KV_TERM, DECODE_SCORE_TERM)


@dataclass(frozen=True)
class FitStep:
    """One timed step as the fit sees it: its time beyond the physics the fit does not
    price, and how many of each fitted term it paid."""

    residual_s: float
    measured_s: float
    counts: dict[str, float]


def fit_engine(
    server: ServerSpec, log: Callable[[str], None], repeats: int = 7,
    sizes: Sequence[str] = ("tiny", "small"), points: Sequence[StepPoint] = OVERHEAD_POINTS,
) -> tuple[ServerSpec, dict[str, float]]:
    """``server`` (whose overhead terms are still 0) with every overhead term, the memory
    and decode attention rates and the all-reduce latency inside a step fitted as the module
    doc says (on checkpoints of ``sizes``, at ``points``); and how well the TP=1 fit
    explains its own steps."""
    from engine.models.tiny import write_random_checkpoint

    steps: list[FitStep] = []
    tp_residual: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="talaria-calibrate-") as tmp:
        checkpoints = []
        for size in sizes:
            for arch in ("llama", "qwen3_moe"):
                for layers in OVERHEAD_LAYERS:
                    path = write_random_checkpoint(Path(tmp) / f"{size}-{arch}-{layers}", arch,
                                                   size=size, num_hidden_layers=layers)
                    checkpoints.append((size, arch, layers, path))
        for _size, _arch, _layers, path in checkpoints:
            spec = ModelSpec.from_hf_config(path)
            for m in measure_steps(path, points, tp=1, repeats=repeats):
                steps.append(_fit_step(server, spec, m))
        coefficients = fit_overheads(steps)
        fitted = _with_coefficients(server, coefficients)
        for size, arch, layers, path in checkpoints:
            if size == sizes[0] and arch == "llama":  # the TP terms: at the first size
                spec = ModelSpec.from_hf_config(path)
                # TP steps vary far more (two processes on the cores): more repeats
                (m,) = measure_steps(path, [TP_POINT], tp=2, repeats=2 * repeats)
                cost = CostModel(fitted, spec, 2).step_cost(list(m.shape.chunks),
                                                            m.shape.decode_seqs,
                                                            m.shape.decode_context)
                tp_residual[layers] = m.seconds - cost.seconds
    lo, hi = OVERHEAD_LAYERS
    # a TP step's cost beyond its TP=1 terms and its collectives at the isolated latency:
    # tp_step + (2 L + 2) x the latency's excess inside a step
    in_step_extra = max(0.0, (tp_residual[hi] - tp_residual[lo]) / (2 * (hi - lo)))
    isolated = dict(server.efficiency)["allreduce_latency_s"]
    tp_terms = {"tp_step_overhead_s": max(0.0, tp_residual[lo] - (2 * lo + 2) * in_step_extra),
                "allreduce_latency_s": isolated + in_step_extra}
    fitted = replace(fitted, efficiency=tuple(sorted({**dict(fitted.efficiency),
                                                      **tp_terms}.items())))
    quality = {"steps": float(len(steps)),
               "median_abs_error": _median_abs_error(steps, coefficients)}
    shown = {**coefficients, **tp_terms}
    log("  engine fit: " + ", ".join(_describe(n, v) for n, v in shown.items())
        + f" (all-reduce alone {isolated * 1e6:.0f} us); over {len(steps)} steps, "
        f"median |error| {quality['median_abs_error']:.0%}")
    return fitted, quality


def _with_coefficients(server: ServerSpec, coefficients: dict[str, float]) -> ServerSpec:
    """``server`` with the fitted overhead terms and rates (a memory rate the fit put at 0 s
    per byte is left as the micro-benchmark measured it)."""
    device = server.device
    weights, kv = coefficients[WEIGHTS_TERM], coefficients[KV_TERM]
    per_score = coefficients[DECODE_SCORE_TERM]
    if weights > 0:
        device = replace(device, hbm_bytes_per_s=1.0 / weights)
    if kv > 0:
        device = replace(device, kv_read_bytes_per_s=1.0 / kv)
    device = replace(device, decode_scores_per_s=1.0 / per_score if per_score > 0 else None)
    overheads = {t: v for t, v in coefficients.items() if t in (*OVERHEAD_TERMS, GEMM_TERM)}
    return replace(server, device=device,
                   efficiency=tuple(sorted({**dict(server.efficiency), **overheads}.items())))


def _fit_step(server: ServerSpec, spec: ModelSpec, m: MeasuredStep) -> FitStep:
    """The step's residual beyond the compute the fit does not price, and its counts: the
    overhead terms', and its weight and decode KV bytes and decode scores (read off the
    cost model itself at unit rates; a calibrated server's memory efficiency is 1)."""
    chunks, seqs, context = list(m.shape.chunks), m.shape.decode_seqs, m.shape.decode_context
    unit = replace(server.device, hbm_bytes_per_s=1.0, kv_read_bytes_per_s=1.0,
                   decode_scores_per_s=1.0)
    gemm = tuple(sorted({**dict(server.efficiency), GEMM_TERM: 1.0}.items()))
    at_unit = CostModel(replace(server, device=unit, efficiency=gemm), spec, 1).step_cost(
        chunks, seqs, context)
    no_decode = replace(server.device, decode_scores_per_s=None)
    cost = CostModel(replace(server, device=no_decode), spec, 1)
    base = cost.step_cost(chunks, seqs, context)
    unit_parts, base_parts = dict(at_unit.parts), dict(base.parts)
    tokens = sum(n for n, _ in chunks) + seqs
    rows = len([n for n, _ in chunks if n]) + seqs
    counts = {**cost.overhead_counts(tokens, rows, seqs, context),
              GEMM_TERM: unit_parts["linear"] - base_parts["linear"],
              WEIGHTS_TERM: unit_parts["weights"], KV_TERM: unit_parts["kv"],
              DECODE_SCORE_TERM: unit_parts["scores"] - base_parts["scores"]}
    return FitStep(m.seconds - base.compute_s - base.allreduce_s, m.seconds, counts)


def fit_overheads(steps: Sequence[FitStep], terms: Sequence[str] = TP1_TERMS) -> dict[str, float]:
    """The non-negative ``terms`` that best explain the steps' residuals, each step's error
    relative to its measured time."""
    if not steps:
        raise ValueError("no steps to fit the overheads on")
    a = torch.tensor([[s.counts[t] / s.measured_s for t in terms] for s in steps],
                     dtype=torch.float64)
    b = torch.tensor([s.residual_s / s.measured_s for s in steps], dtype=torch.float64)
    scale = a.abs().amax(dim=0).clamp(min=1e-300)  # columns of one magnitude
    x = nnls(a / scale, b) / scale
    return {t: float(v) for t, v in zip(terms, x, strict=True)}


def nnls(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-12) -> torch.Tensor:
    """argmin ||a x - b|| over x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    x = torch.zeros(n, dtype=a.dtype)
    passive = torch.zeros(n, dtype=torch.bool)
    for _ in range(3 * n + 10):
        w = a.T @ (b - a @ x)
        candidates = (~passive) & (w > tol)
        if not bool(candidates.any()):
            break
        passive[int(torch.where(candidates, w, torch.full_like(w, -torch.inf)).argmax())] = True
        while True:
            z = torch.zeros(n, dtype=a.dtype)
            idx = passive.nonzero().flatten()
            z[idx] = torch.linalg.lstsq(a[:, idx], b.unsqueeze(1)).solution.flatten()
            if bool((z[idx] > 0).all()):
                x = z
                break
            bad = idx[z[idx] <= 0]
            alpha = float((x[bad] / (x[bad] - z[bad])).min())
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


def _median_abs_error(steps: Sequence[FitStep], coefficients: dict[str, float]) -> float:
    errors = sorted(abs(s.residual_s - sum(coefficients[t] * s.counts[t] for t in coefficients))
                    / s.measured_s for s in steps)
    return errors[(len(errors) - 1) // 2]


def _describe(name: str, value: float) -> str:
    if name == GEMM_TERM:
        return f"gemm {value * 1e12:.1f} ps/weight byte"
    if name == WEIGHTS_TERM:
        return f"weights read at {1 / value / 1e9:.2f} GB/s" if value else "weights read free"
    if name == KV_TERM:
        return f"decode KV read at {1 / value / 1e9:.2f} GB/s" if value else "decode KV read free"
    if name == DECODE_SCORE_TERM:
        return f"decode {1 / value / 1e9:.2f} G scores/s" if value else "decode scores free"
    if name == "elementwise_s_per_unit":
        return f"elementwise {value * 1e9:.2f} ns/unit"
    if name == "decode_context_overhead_s":
        return f"decode_context {value * 1e9:.1f} ns/token"
    return f"{name.removesuffix('_s').removesuffix('_overhead')} {value * 1e6:.1f} us"
