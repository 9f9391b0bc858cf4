"""Measured step times of the live engine at chosen shapes (prefill chunks, decode batches).

One ``EngineCore`` per (model, TP size) runs every point in turn. A point's steps are the
engine's own ``StepResult.seconds`` (schedule, forward, sampling, bookkeeping: what the
simulated engine's step stands for), and what each step ran is read from the scheduler's
output, so a prediction prices exactly the work that was timed:
- ``prefill`` (chunk N after C cached tokens): a request of C random tokens is prefilled and
  finished first, then ones of those C tokens plus N fresh ones, whose prefill after the
  cached prefix is the timed step (fresh tokens at every repeat, so only the C are cached).
- ``decode`` (B sequences at context C): one request of C random tokens is prefilled, then B-1
  more with the same prompt join it from the prefix cache; once all B decode, steps after
  ``WARMUP_STEPS`` are timed (the first ones gather the contexts into the decode buffers).
Points of the same context share its prompt, so its prefill is paid once per engine.
A point's time is the median of its timed steps on the clock of ``talaria.bench.timing`` (at
TP=1 with one torch thread, the driver thread's CPU time around ``EngineCore.step``: what the
step takes on a core of its own however busy the machine is; else the wall clock), the
clock and statistic the calibration's micro-benchmarks use as well. The wall-clock median is
kept beside it: where the two differ, the machine was busy.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore, StepResult
from engine.interface import EngineRequest
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.sim.step_time import split_scheduled
from talaria.bench.timing import WALL, Clock, clock_for

__all__ = ["StepPoint", "StepShape", "MeasuredStep", "measure_steps", "kv_blocks_for"]

BLOCK_SIZE = 16
WARMUP_STEPS = 3
SPARE_TOKENS = 8  # decode steps beyond the timed ones (the lead's while the batch joins)
KINDS = ("prefill", "decode")


@dataclass(frozen=True)
class StepPoint:
    kind: str  # KINDS
    tokens: int  # prefill: the chunk's new tokens; decode: the batch's sequences
    context: int  # prefill: cached tokens before the chunk; decode: each sequence's prompt

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"step point kind must be one of {KINDS}, got {self.kind!r}")
        if self.tokens < 1 or self.context < 0 or (self.kind == "decode" and self.context < 1):
            raise ValueError(f"step point {self} needs tokens >= 1 and a context >= 0 "
                             "(>= 1 for a decode)")

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.tokens}" + (f" after {self.context}" if self.context else "")
        return f"decode {self.tokens} x {self.context}"


@dataclass(frozen=True)
class StepShape:
    """The work of one step as the cost model prices it."""

    chunks: tuple[tuple[int, int], ...]  # (new tokens, cached context) per prefill chunk
    decode_seqs: int
    decode_context: int  # summed over the decodes


@dataclass(frozen=True)
class MeasuredStep:
    point: StepPoint
    seconds: float  # the median timed step on ``clock``
    shape: StepShape  # its work
    samples: int  # timed steps
    wall_seconds: float  # the median on the wall clock
    clock: str = "wall"

def kv_blocks_for(points: Sequence[StepPoint], max_new_tokens: int) -> int:
    """KV blocks an engine needs for ``points``: the largest point's blocks, twice over for
    a decode batch (its gathered decode contexts may take as many bytes as the cache)."""
    need = 0
    for p in points:
        per_seq = -(-(p.context + p.tokens + max_new_tokens) // BLOCK_SIZE) + 4
        need = max(need, 2 * p.tokens * per_seq if p.kind == "decode" else 2 * per_seq)
    return need + 16


def measure_steps(
    model_dir: str | Path,
    points: Sequence[StepPoint],
    *,
    tp: int = 1,
    repeats: int = 5,
    seed: int = 0,
    max_model_len: int | None = None,
    clock: Clock | None = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> list[MeasuredStep]:
    """Time every point on one engine of ``model_dir`` (``dtype`` on ``device``) at ``tp``
    ranks; ``repeats`` timed steps per point, on ``clock`` (default: ``clock_for`` the
    caller's torch threads and ``tp`` on a CPU; the wall clock on a GPU, where the step
    waits for its kernels when it reads the sampled tokens). Torch threads are the caller's
    (rank 0) and the launcher's (the other ranks)."""
    if clock is None:
        on_cpu = torch.device(device).type == "cpu"
        clock = clock_for(torch.get_num_threads(), tp) if on_cpu else WALL
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    new_tokens = repeats + WARMUP_STEPS + SPARE_TOKENS
    widest = max(p.context + p.tokens for p in points) + new_tokens
    config = EngineConfig(
        model=model_dir, dtype=dtype, device=device, block_size=BLOCK_SIZE,
        max_model_len=max_model_len, num_kv_blocks=kv_blocks_for(points, new_tokens),
        max_num_batched_tokens=max(2048, widest), max_num_seqs=max(p.tokens for p in points),
        tensor_parallel_size=tp,
    )
    core = EngineCore(config)
    if widest > core.max_model_len:
        core.shutdown()
        raise ValueError(f"a point needs {widest} tokens; {model_dir} holds {core.max_model_len}")
    recorder = _ShapeRecorder(core, clock)
    prompts = _Prompts(seed, core.vocab_size)
    try:
        core.add_request(EngineRequest("warm-up", prompts.fresh(BLOCK_SIZE),
                                       SamplingParams(max_tokens=2, **_GREEDY)))
        _drain(core)
        out = []
        for point in points:
            run = _prefill if point.kind == "prefill" else _decode
            out.append(run(core, recorder, point, repeats, prompts))
        return out
    finally:
        core.shutdown()


class _Prompts:
    """Random prompts: fresh ones, and one per context length that points share (its KV
    stays in the prefix cache between them, so a long context is prefilled once)."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self._contexts: dict[int, list[int]] = {}

    def fresh(self, n: int) -> list[int]:
        return torch.randint(3, self.vocab, (n,), generator=self.generator).tolist()

    def context(self, n: int) -> list[int]:
        if n not in self._contexts:
            self._contexts[n] = self.fresh(n)
        return self._contexts[n]


class _ShapeRecorder:
    """Keeps the shape of the step the engine is about to run (wraps its scheduler) and
    times its steps on ``clock`` (``step``). It holds no reference to the engine: the
    scheduler holds it, and a cycle back would keep the engine's KV cache (GBs) alive until
    a garbage collection."""

    def __init__(self, core: EngineCore, clock: Clock) -> None:
        self.last = StepShape((), 0, 0)
        self.clock = clock
        schedule = core.scheduler.schedule

        def recording() -> SchedulerOutput:
            out = schedule()
            chunks, decodes = split_scheduled(out)
            self.last = StepShape(tuple(chunks), len(decodes),
                                  sum(s.num_computed_tokens for s in decodes))
            return out

        core.scheduler.schedule = recording  # type: ignore[method-assign]

    def step(self, core: EngineCore) -> _Timed:
        """One step of ``core``: its time on the clock, on the wall clock, its work, result."""
        start = self.clock.read()
        result = core.step()
        return _Timed(self.clock.read() - start, result.seconds, self.last, result)


@dataclass(frozen=True)
class _Timed:
    seconds: float
    wall_seconds: float
    shape: StepShape
    result: StepResult


_GREEDY = dict(temperature=0.0, ignore_eos=True)


def _drain(core: EngineCore) -> None:
    while core.has_unfinished():
        core.step()


def _prefill(core: EngineCore, rec: _ShapeRecorder, point: StepPoint, repeats: int,
             prompts: _Prompts) -> MeasuredStep:
    """The chunk after a cached context: the context is prefilled (once, shared) and each
    repeat adds fresh tokens after it. Chunks of 1024 tokens and more are timed at most
    twice (each is a long step, and a long step's best is a steady figure)."""
    context = prompts.context(point.context) if point.context else []
    if context:
        core.add_request(EngineRequest(f"context-{point.context}", context,
                                       SamplingParams(max_tokens=1, **_GREEDY)))
        _drain(core)
    timed: list[_Timed] = []
    for r in range(min(repeats, 2) if point.tokens >= 1024 else repeats):
        prompt = context + prompts.fresh(point.tokens)
        params = SamplingParams(max_tokens=1, **_GREEDY)
        core.add_request(EngineRequest(f"chunk-{r}", prompt, params))
        step = rec.step(core)
        if step.result.num_prefill_tokens:
            timed.append(step)
        _drain(core)
    return _median(point, timed, rec.clock)


def _decode(core: EngineCore, rec: _ShapeRecorder, point: StepPoint, repeats: int,
            prompts: _Prompts) -> MeasuredStep:
    prompt = prompts.context(point.context)
    params = SamplingParams(max_tokens=repeats + WARMUP_STEPS + SPARE_TOKENS, **_GREEDY)
    core.add_request(EngineRequest("lead", prompt, params))
    lead = core.scheduler.requests["lead"]
    while lead.num_computed_tokens < point.context:
        core.step()
    for i in range(1, point.tokens):
        core.add_request(EngineRequest(f"follow-{i}", prompt, params))
    timed: list[_Timed] = []
    seen = 0
    while core.has_unfinished() and len(timed) < repeats:
        step = rec.step(core)
        if step.shape.chunks or step.shape.decode_seqs != point.tokens:
            continue
        seen += 1
        if seen > WARMUP_STEPS:
            timed.append(step)
    _drain(core)
    if not timed:
        raise RuntimeError(f"{point.label}: no step decoded all {point.tokens} sequences")
    return _median(point, timed, rec.clock)


def _median(point: StepPoint, timed: list[_Timed], clock: Clock) -> MeasuredStep:
    """The median step (the lower middle one of an even count) and its work."""
    if not timed:
        raise RuntimeError(f"{point.label}: nothing was timed")
    ordered = sorted(timed, key=lambda t: t.seconds)
    middle = ordered[(len(ordered) - 1) // 2]
    wall = statistics.median(t.wall_seconds for t in timed)
    return MeasuredStep(point, middle.seconds, middle.shape, len(timed), wall, clock.name)
