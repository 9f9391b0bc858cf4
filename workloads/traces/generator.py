"""SWE-bench agent session generator, calibrated to the real trace.

The calibration (``workloads/data/swe_calibration.json``) holds empirical quantile tables
(percentiles 0..100) fitted from the shared real trace by :func:`fit_calibration`: calls per
session, first prompt length, prompt growth per turn (one table per range of turns: early turns
read files and grow fast, later ones slower), output tokens, and the tool gap per tool class.
Tool gaps are bimodal because tools are: file tools (Read/Edit/Grep/...) return in tens of
milliseconds, Bash takes seconds, a sub-agent (``Task``) minutes; the generator draws a tool
class per call with the trace's frequencies, then a gap from that class's table. Values between
percentiles are interpolated log-linearly (every quantity is positive and heavy-tailed).

A generated session's prompt contains the previous prompt and output: ``input[k+1] =
input[k] + max(growth, output[k] + MIN_TOOL_RESULT_TOKENS)`` with ``growth`` drawn from the
growth table (in the real trace thinking tokens count as output but are dropped from the next
prompt, so growth is sometimes smaller than the output; a simulated prefix cache needs the
containment; this puts the median growth about a fifth above the real trace's +431 and the
median prompt at a given turn up to ~10% above the real one).

Source of the calibration data: the public AgentCgroup traces (arXiv 2602.09345, repository
yunwei37/agentcgroup at 5af9e7b8f37a, GPL-2.0), as reduced in ``workloads/data/traces/``.
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from workloads.traces.assignment import apportion, assign_models, bundled_contexts
from workloads.traces.readers import read_real_trace, real_trace_path
from workloads.traces.trace import Call, Session, TraceError, load_trace, save_trace

DATA_DIR = Path(__file__).parents[1] / "data"
CALIBRATION_PATH = DATA_DIR / "swe_calibration.json"
DEFAULT_TRACE_PATH = DATA_DIR / "default_trace.jsonl"

DEFAULT_MODELS: tuple[str, ...] = ("qwen3-235b-a22b", "glm-4.5-air", "mistral-large-2407")
DEFAULT_NUM_SESSIONS = 30
DEFAULT_TOTAL_CALLS = 960
DEFAULT_SKEW = 1.0  # Zipf exponent: 16 / 8 / 6 sessions over three models
DEFAULT_SEED = 0
MIN_CALLS_PER_SESSION = 2  # the real trace's minimum
MIN_TOOL_RESULT_TOKENS = 20  # the real trace's smallest growth per turn
# Growth tables cover turns starting at these 0-based call indices (growth from call k to k+1).
GROWTH_BUCKET_STARTS: tuple[int, ...] = (0, 4, 9, 19, 49)

TOOL_CLASSES = ("fast", "bash", "subagent")
SOURCE_NOTE = (
    "Fitted from /work/shared/traces/swe-claude-code.jsonl: AgentCgroup traces (arXiv "
    "2602.09345), yunwei37/agentcgroup@5af9e7b8f37a, GPL-2.0; token counts and times only."
)


def tool_class(tools: Sequence[str]) -> str:
    """``subagent`` if the call started a sub-agent, ``bash`` if it ran a shell command, else
    ``fast`` (file tools, or none)."""
    if "Task" in tools:
        return "subagent"
    if "Bash" in tools:
        return "bash"
    return "fast"


def growth_bucket(call_index: int) -> int:
    """Index of the growth table for the growth from call ``call_index`` to the next."""
    return bisect.bisect_right(GROWTH_BUCKET_STARTS, call_index) - 1


def _percentiles(values: Sequence[float]) -> list[float]:
    """Percentiles 0..100 by linear interpolation between order statistics."""
    if not values:
        raise ValueError("cannot fit a quantile table to no values")
    ordered = sorted(values)
    n = len(ordered)
    table = []
    for p in range(101):
        pos = p / 100 * (n - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, n - 1)
        table.append(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
    return table


@dataclass(frozen=True)
class QuantileTable:
    """An empirical distribution as its percentiles 0..100 (positive values)."""

    points: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.points) != 101:
            raise ValueError(f"a quantile table has 101 points, got {len(self.points)}")
        if any(p <= 0 for p in self.points) or list(self.points) != sorted(self.points):
            raise ValueError("quantile table points must be positive and non-decreasing")

    def sample(self, rng: random.Random) -> float:
        return self.at(rng.random())

    def at(self, u: float) -> float:
        """Inverse CDF at ``u`` in [0, 1], log-linear between percentiles."""
        pos = min(max(u, 0.0), 1.0) * 100
        lo = min(math.floor(pos), 99)
        a, b = self.points[lo], self.points[lo + 1]
        frac = pos - lo
        if frac <= 0.0 or a == b:
            return a
        if frac >= 1.0:
            return b
        return math.exp(math.log(a) + (math.log(b) - math.log(a)) * frac)

    def cdf(self, x: float) -> float:
        """Share of the distribution at or below ``x`` (for tests and reports)."""
        i = bisect.bisect_right(self.points, x)
        if i == 0:
            return 0.0
        if i >= 101:
            return 1.0
        a, b = self.points[i - 1], self.points[i]
        frac = (math.log(x) - math.log(a)) / (math.log(b) - math.log(a)) if b > a else 1.0
        return (i - 1 + frac) / 100


@dataclass(frozen=True)
class Calibration:
    calls_per_session: QuantileTable
    first_input_tokens: QuantileTable
    growth_tokens: tuple[QuantileTable, ...]  # one per GROWTH_BUCKET_STARTS entry
    output_tokens: QuantileTable
    tool_gap_s: dict[str, QuantileTable]  # by tool class
    tool_class_share: dict[str, float]
    tool_names: dict[str, dict[str, int]]  # per class: tool name -> how often it occurs
    source: str = SOURCE_NOTE

    def to_dict(self) -> dict:
        def pts(t: QuantileTable) -> list[float]:
            return [float(f"{x:.6g}") for x in t.points]

        return {
            "source": self.source,
            "calls_per_session": pts(self.calls_per_session),
            "first_input_tokens": pts(self.first_input_tokens),
            "growth_bucket_starts": list(GROWTH_BUCKET_STARTS),
            "growth_tokens": [pts(t) for t in self.growth_tokens],
            "output_tokens": pts(self.output_tokens),
            "tool_gap_s": {k: pts(v) for k, v in self.tool_gap_s.items()},
            "tool_class_share": self.tool_class_share,
            "tool_names": self.tool_names,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        def table(name: str, raw: object) -> QuantileTable:
            try:
                return QuantileTable(tuple(float(x) for x in raw))  # type: ignore[union-attr]
            except (TypeError, ValueError) as exc:
                raise ValueError(f"calibration field {name!r}: {exc}") from None

        gaps = {k: table(f"tool_gap_s.{k}", v) for k, v in data["tool_gap_s"].items()}
        share = {k: float(v) for k, v in data["tool_class_share"].items()}
        if tuple(data["growth_bucket_starts"]) != GROWTH_BUCKET_STARTS:
            raise ValueError(
                f"calibration growth buckets {data['growth_bucket_starts']} differ from "
                f"{list(GROWTH_BUCKET_STARTS)}; refit it (python -m workloads.traces.generator --refit)"
            )
        if set(gaps) != set(share) or not set(share) <= set(TOOL_CLASSES):
            raise ValueError("calibration: tool classes of gaps and shares disagree")
        return cls(
            calls_per_session=table("calls_per_session", data["calls_per_session"]),
            first_input_tokens=table("first_input_tokens", data["first_input_tokens"]),
            growth_tokens=tuple(
                table(f"growth_tokens[{i}]", t) for i, t in enumerate(data["growth_tokens"])
            ),
            output_tokens=table("output_tokens", data["output_tokens"]),
            tool_gap_s=gaps,
            tool_class_share=share,
            tool_names={k: dict(v) for k, v in data["tool_names"].items()},
            source=data.get("source", SOURCE_NOTE),
        )

    @classmethod
    def load(cls, path: str | Path = CALIBRATION_PATH) -> Calibration:
        return cls.from_dict(orjson.loads(Path(path).read_bytes()))

    def save(self, path: str | Path = CALIBRATION_PATH) -> None:
        Path(path).write_bytes(orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2) + b"\n")


def fit_calibration(sessions: Sequence[Session]) -> Calibration:
    """Fit the generator's tables to real sessions (e.g. :func:`read_real_trace`)."""
    firsts: list[float] = []
    outputs: list[float] = []
    counts: list[float] = []
    growths: list[list[float]] = [[] for _ in GROWTH_BUCKET_STARTS]
    gaps: dict[str, list[float]] = {c: [] for c in TOOL_CLASSES}
    names: dict[str, Counter[str]] = {c: Counter() for c in TOOL_CLASSES}
    for s in sessions:
        counts.append(s.num_calls)
        firsts.append(s.calls[0].input_tokens)
        for k, call in enumerate(s.calls):
            outputs.append(call.output_tokens)
            if k + 1 < s.num_calls:
                growth = s.calls[k + 1].input_tokens - call.input_tokens
                growths[growth_bucket(k)].append(growth)
            if call.tool_gap_s is not None and k + 1 < s.num_calls:
                cls = tool_class(call.tools)
                # zero gaps (timestamp resolution) become 1 ms so the log tables stay finite
                gaps[cls].append(max(call.tool_gap_s, 1e-3))
                names[cls].update(call.tools or ("none",))
    total_gaps = sum(len(v) for v in gaps.values())
    present = [c for c in TOOL_CLASSES if gaps[c]]
    return Calibration(
        calls_per_session=QuantileTable(tuple(_percentiles(counts))),
        first_input_tokens=QuantileTable(tuple(_percentiles(firsts))),
        growth_tokens=tuple(QuantileTable(tuple(_percentiles(g))) for g in growths),
        output_tokens=QuantileTable(tuple(_percentiles(outputs))),
        tool_gap_s={c: QuantileTable(tuple(_percentiles(gaps[c]))) for c in present},
        tool_class_share={c: len(gaps[c]) / total_gaps for c in present},
        tool_names={c: dict(names[c].most_common()) for c in present},
    )


def _session_lengths(
    rng: random.Random, cal: Calibration, num_sessions: int, total_calls: int
) -> list[int]:
    """Draw calls per session from the calibration, then rescale so they sum to
    ``total_calls`` exactly (largest remainder), keeping every session >= 2 calls."""
    drawn = [max(MIN_CALLS_PER_SESSION, round(cal.calls_per_session.sample(rng)))
             for _ in range(num_sessions)]
    counts = apportion(total_calls, drawn)
    for i in range(num_sessions):
        while counts[i] < MIN_CALLS_PER_SESSION:
            donor = max(range(num_sessions), key=lambda j: counts[j])
            counts[donor] -= 1
            counts[i] += 1
    return counts


def _draw_tool(rng: random.Random, cal: Calibration) -> tuple[str, str]:
    classes = list(cal.tool_class_share)
    cls = rng.choices(classes, weights=[cal.tool_class_share[c] for c in classes])[0]
    names = cal.tool_names[cls]
    name = rng.choices(list(names), weights=list(names.values()))[0]
    return cls, name


def generate_session(
    rng: random.Random, cal: Calibration, session_id: str, model: str, num_calls: int,
    arrival_s: float = 0.0,
) -> Session:
    calls = []
    prompt = max(1, round(cal.first_input_tokens.sample(rng)))
    for k in range(num_calls):
        output = max(1, round(cal.output_tokens.sample(rng)))
        if k + 1 == num_calls:
            calls.append(Call(prompt, output, None))
            break
        cls, tool = _draw_tool(rng, cal)
        gap = round(cal.tool_gap_s[cls].sample(rng), 4)
        tools = () if tool == "none" else (tool,)
        calls.append(Call(prompt, output, gap, tools))
        growth = round(cal.growth_tokens[growth_bucket(k)].sample(rng))
        prompt += max(growth, output + MIN_TOOL_RESULT_TOKENS)
    return Session(session_id=session_id, model=model, calls=tuple(calls), arrival_s=arrival_s)


def generate_trace(
    num_sessions: int = DEFAULT_NUM_SESSIONS,
    total_calls: int = DEFAULT_TOTAL_CALLS,
    models: Sequence[str] = DEFAULT_MODELS,
    skew: float = DEFAULT_SKEW,
    arrival: str = "all",
    rate: float | None = None,
    seed: int = DEFAULT_SEED,
    calibration: Calibration | None = None,
) -> list[Session]:
    """Generate ``num_sessions`` SWE-bench-like sessions with exactly ``total_calls`` calls.

    ``models`` are assigned with a Zipf-like popularity of exponent ``skew`` (first model most
    popular), each session to a model whose context holds its longest call (bundled models). ``arrival="all"``: every session starts at 0; ``arrival="poisson"``: sessions
    arrive as a Poisson process of ``rate`` sessions per second, the first at 0.
    """
    if num_sessions < 1:
        raise ValueError(f"num_sessions must be >= 1, got {num_sessions}")
    if total_calls < MIN_CALLS_PER_SESSION * num_sessions:
        raise ValueError(
            f"total_calls={total_calls} is below {MIN_CALLS_PER_SESSION} calls for each of "
            f"{num_sessions} sessions"
        )
    if arrival not in ("all", "poisson"):
        raise ValueError(f"arrival must be 'all' or 'poisson', got {arrival!r}")
    if arrival == "poisson" and (rate is None or not rate > 0 or not math.isfinite(rate)):
        raise ValueError(f"arrival='poisson' needs a finite rate > 0 (sessions/s), got {rate!r}")
    if arrival == "all" and rate is not None:
        raise ValueError("rate is only meaningful with arrival='poisson'")
    cal = calibration or Calibration.load()
    rng = random.Random(seed)
    lengths = _session_lengths(rng, cal, num_sessions, total_calls)
    arrivals = [0.0] * num_sessions
    if arrival == "poisson":
        assert rate is not None
        for i in range(1, num_sessions):
            arrivals[i] = round(arrivals[i - 1] + rng.expovariate(rate), 3)
    sessions = [
        generate_session(rng, cal, f"swe-{i:03d}", models[0], n, arrivals[i])
        for i, n in enumerate(lengths)
    ]
    return assign_models(sessions, models, skew=skew, seed=seed,
                         contexts=bundled_contexts(models))


def default_trace() -> list[Session]:
    """The shipped default trace (30 sessions, 960 calls, 3 models)."""
    return load_trace(DEFAULT_TRACE_PATH)


def write_default_trace(path: str | Path = DEFAULT_TRACE_PATH) -> list[Session]:
    sessions = generate_trace()
    save_trace(sessions, path)
    return sessions


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m workloads.traces.generator [--refit]``: rewrite the shipped data files; with
    ``--out``, write another trace there instead (another seed, skew or size: a trace the
    benchmark's settings were not tuned on)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--refit", action="store_true",
                        help="refit the calibration from the real trace first")
    parser.add_argument("--real-trace", default=str(real_trace_path()))
    parser.add_argument("--out", default=None, help="write a new trace here instead")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--skew", type=float, default=DEFAULT_SKEW)
    parser.add_argument("--sessions", type=int, default=DEFAULT_NUM_SESSIONS)
    parser.add_argument("--calls", type=int, default=DEFAULT_TOTAL_CALLS)
    args = parser.parse_args(argv)
    if args.refit:
        fit_calibration(read_real_trace(args.real_trace)).save()
    try:
        if args.out is None:
            path: str | Path = DEFAULT_TRACE_PATH
            sessions = write_default_trace()
        else:
            path = args.out
            sessions = generate_trace(args.sessions, args.calls, skew=args.skew, seed=args.seed)
            save_trace(sessions, path)
    except (TraceError, ValueError) as exc:
        raise SystemExit(f"cannot generate the trace: {exc}") from None
    print(f"wrote {path}: {len(sessions)} sessions, {sum(s.num_calls for s in sessions)} calls")


if __name__ == "__main__":
    main()
