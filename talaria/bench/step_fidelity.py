"""Step time, predicted against measured: the cost model with a calibrated server spec
against the live engine on this machine (the first half of ``talaria fidelity``).

The grid: prefill chunks of 16 to 2048 tokens (and 256 after 2048 cached), decode batches of
1 to 64 sequences at contexts of 64 to 4000 tokens, on the tiny models at TP=1 and TP=2.
The "small" catalog (tens of millions of parameters, what the fidelity replay serves) is
where compute and memory matter; its decode batches are capped at ``SMALL_DECODE_TOKENS``
context tokens in all (64 x 4000 would hold 8 GB of KV and gathered contexts). The "tiny"
catalog (what ``talaria serve`` serves beside the real model) is where the host overheads are
the step. ``real_model_cases`` adds the real checkpoint, SmolLM2-135M-Instruct.
Each prediction prices the work the timed step actually ran (``talaria.bench.step_points``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.sim.cost_model import CostModel, StepCost
from engine.sim.model_spec import ModelSpec
from substrate.devices import ServerSpec
from talaria.bench.step_points import MeasuredStep, StepPoint, measure_steps

__all__ = ["Case", "PointResult", "default_cases", "real_model_cases", "run_cases", "price",
           "quantile", "summarize",
           "format_table"]

PREFILL: tuple[tuple[int, int], ...] = (
    (16, 0), (64, 0), (256, 0), (1024, 0), (2048, 0), (256, 2048))
DECODE_BATCHES = (1, 8, 64)
DECODE_CONTEXTS = (64, 512, 4000)
SMALL_DECODE_TOKENS = 40_000


@dataclass(frozen=True)
class Case:
    size: str  # "small" | "tiny": which tiny catalog; "real": the real model
    model: str
    tp: int
    points: tuple[StepPoint, ...]

    @property
    def label(self) -> str:
        return f"{self.size} {self.model} TP={self.tp}"


def _grid(
    max_decode_tokens: int, prefill: Sequence[tuple[int, int]] = PREFILL
) -> tuple[StepPoint, ...]:
    points = [StepPoint("prefill", n, c) for n, c in prefill]
    points += [StepPoint("decode", b, c) for c in DECODE_CONTEXTS for b in DECODE_BATCHES
               if b * c <= max_decode_tokens]
    return tuple(points)


def default_cases() -> list[Case]:
    """Every model of the small catalog at TP=1, its llama at TP=2; the tiny catalog's llama
    and MoE at TP=1 and its llama at TP=2."""
    small = _grid(SMALL_DECODE_TOKENS)
    tiny = _grid(64 * 4000, prefill=((16, 0), (256, 0), (2048, 0)))
    cases = [Case("small", m, 1, small) for m in ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")]
    cases.append(Case("small", "tiny-llama", 2, small))
    cases += [Case("tiny", m, 1, tiny) for m in ("tiny-llama", "tiny-qwen3-moe")]
    cases.append(Case("tiny", "tiny-llama", 2, tiny))
    return cases


REAL_DECODE_TOKENS = 16_000  # SmolLM2-135M holds 46 KB of fp32 KV per token


def real_model_cases(model: str) -> list[Case]:
    """The real checkpoint (SmolLM2-135M-Instruct, catalog ``"real"``) at TP=1: wider than
    the tiny models in every dimension but depth, and a 49k vocabulary."""
    return [Case("real", model, 1, _grid(REAL_DECODE_TOKENS))]


@dataclass(frozen=True)
class PointResult:
    case: Case
    measured: MeasuredStep
    predicted: StepCost

    @property
    def predicted_s(self) -> float:
        return self.predicted.seconds

    @property
    def rel_err(self) -> float:
        """(predicted - measured) / measured."""
        return self.predicted_s / self.measured.seconds - 1.0

    @property
    def regime(self) -> str:
        return f"{self.measured.point.kind} {self.case.size} TP={self.case.tp}"

    def terms(self) -> dict[str, float]:
        """The prediction by term, in seconds (compute and memory parts as they add up
        before overlap; collectives; host overheads)."""
        c = self.predicted
        return {**dict(c.parts), "collectives": c.allreduce_s, "overhead": c.overhead_s}

    @property
    def main_term(self) -> str:
        terms = self.terms()
        return max(terms, key=lambda t: terms[t])


def run_cases(
    cases: Sequence[Case], server: ServerSpec, models: Callable[[str], dict[str, Path]],
    *, repeats: int = 3, log: Callable[[str], None] = print,
) -> list[PointResult]:
    """Measure every case's points and price them; ``models(size)`` gives that catalog's
    directories by name."""
    out: list[PointResult] = []
    for case in cases:
        path = models(case.size)[case.model]
        measured = measure_steps(path, case.points, tp=case.tp, repeats=repeats)
        results = price(case, ModelSpec.from_hf_config(path, case.model), measured, server)
        errors = [abs(r.rel_err) for r in results]
        log(f"  {case.label}: {len(results)} points, median |error| "
            f"{quantile(errors, 0.5):.0%}, worst {max(errors):.0%}")
        out.extend(results)
    return out


def price(case: Case, spec: ModelSpec, measured: Sequence[MeasuredStep],
          server: ServerSpec) -> list[PointResult]:
    """The cost model's prediction (with ``server``) of the work each measured step ran."""
    cost = CostModel(server, spec, case.tp)
    return [PointResult(case, m, cost.step_cost(list(m.shape.chunks), m.shape.decode_seqs,
                                                m.shape.decode_context)) for m in measured]


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 < q < 1, linear between order statistics; 0 for no values)."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def summarize(results: Sequence[PointResult]) -> dict[str, object]:
    """Median and p90 of |relative error|, overall and per regime, and every point."""
    def stats(rs: Sequence[PointResult]) -> dict[str, float]:
        errors = [abs(r.rel_err) for r in rs]
        return {"num_points": len(rs), "median_rel_err": quantile(errors, 0.5),
                "p90_rel_err": quantile(errors, 0.9),
                "median_signed_err": quantile([r.rel_err for r in rs], 0.5)}

    regimes = sorted({r.regime for r in results})
    return {
        **stats(results),
        "by_regime": {g: stats([r for r in results if r.regime == g]) for g in regimes},
        "points": [
            {"case": r.case.label, "point": r.measured.point.label,
             "measured_ms": r.measured.seconds * 1e3,
             "measured_wall_ms": r.measured.wall_seconds * 1e3, "clock": r.measured.clock,
             "predicted_ms": r.predicted_s * 1e3,
             "rel_err": r.rel_err, "main_term": r.main_term,
             "terms_ms": {k: v * 1e3 for k, v in r.terms().items()}}
            for r in results
        ],
    }


def format_table(results: Sequence[PointResult], worst: int = 8) -> str:
    """The per-regime error table and the worst points with their terms."""
    summary = summarize(results)
    lines = [f"{'regime':28s} {'points':>6s} {'median |err|':>12s} {'p90 |err|':>10s} "
             f"{'median signed':>13s}"]
    rows = [("all", summary), *summary["by_regime"].items()]  # type: ignore[union-attr]
    for name, s in rows:
        lines.append(f"{name:28s} {s['num_points']:6d} {s['median_rel_err']:12.0%} "
                     f"{s['p90_rel_err']:10.0%} {s['median_signed_err']:+13.0%}")
    lines.append("")
    lines.append(f"worst {worst} points (predicted vs measured; the prediction's largest "
                 "terms, ms):")
    for r in sorted(results, key=lambda r: -abs(r.rel_err))[:worst]:
        terms = sorted(r.terms().items(), key=lambda kv: -kv[1])[:3]
        parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in terms)
        lines.append(f"  {r.case.label:26s} {r.measured.point.label:22s} "
                     f"{r.predicted_s * 1e3:8.2f} vs {r.measured.seconds * 1e3:8.2f} ms "
                     f"({r.rel_err:+.0%}): {parts}")
    return "\n".join(lines)

