"""The closed-loop replay driver: sessions of a trace against a target, one call at a time.

Each session starts at its ``arrival_s``, sends call 0, waits for its last token, waits the
call's tool gap, sends call 1, and so on. Against the simulator a call carries what an agent
sends, ``max_tokens`` = ``AGENT_MAX_TOKENS`` (or the context left, if less), and the
simulated model ends its answer at the trace's length as at an EOS (``answers``: a registry
only the simulated engines read), so no policy sees an answer's length before it ends.
Against a live engine, whose model cannot be told where to stop, ``max_tokens`` is the
trace's length with ``ignore_eos``. Call k+1's prompt is built from
call k's: the first ``input_tokens[k+1]`` tokens of (call k's prompt + call k's output tokens +
fresh "tool result" tokens), the fresh ones drawn from the session's own seeded generator, so
prompt prefixes repeat exactly where the trace says and prefix caching, KV restore and
cache-aware routing see what they would see live. (When the trace's next prompt is shorter than
prompt + output, as where an agent's thinking tokens are dropped, it is cut there.)

Targets (:class:`Target`): the in-process simulated cluster under the virtual clock
(:func:`run_sim`, via the router core, no HTTP), or a live router over HTTP
(``workloads.replay.live``). Both report, per call, when it was sent, when its first token and its
last token came (loop time: virtual in simulation, monotonic wall time live), and the engine's
usage (prompt tokens served from cache, of which restored from host).

A call that fails is recorded with its error and the session goes on with its next call (its
prompt still grows as the trace says); results count failed calls so none go unnoticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.sampling_params import SamplingParams
from engine.sim.model_spec import ModelSpec
from router.core import CallRejected, NoHealthyInstance
from talaria.clock import run_virtual
from talaria.protocol import CallEvent, CallRequest, InstanceUnavailable, Overloaded
from talaria.protocol.text import BlockChain
from workloads.benchmark.breakdown import attach_splits
from workloads.replay.cluster import ClusterSpec, ClusterTotals, start_cluster
from workloads.replay.dependencies import CallBoard, computed_tokens
from workloads.replay.prompts import PromptView, SessionTokens, next_prompt, prompt_chain
from workloads.replay.systems import SystemConfig
from workloads.traces.trace import CallRef, Session

__all__ = [
    "CallRecord",
    "SessionResult",
    "ReplayResult",
    "CallOutcome",
    "Target",
    "SessionTokens",
    "StandInOutputs",
    "next_prompt",
    "AGENT_MAX_TOKENS",
    "drive",
    "run_sim",
    "replicate",
]

MAX_OVERLOAD_RETRIES = 100
# What a coding agent asks for: Claude Code sends max_tokens 32000 to any model unless
# CLAUDE_CODE_MAX_OUTPUT_TOKENS is set (issue 27's measurement of its requests).
AGENT_MAX_TOKENS = 32_000


@dataclass
class CallRecord:
    index: int
    sent_s: float
    first_token_s: float | None
    done_s: float
    prompt_tokens: int
    output_tokens: int
    reusable_tokens: int  # prompt tokens whose KV an earlier call of the session computed
    cached_tokens: int = 0  # prompt tokens not prefilled (device cache + host restore)
    restored_tokens: int = 0  # of those, restored from host memory
    instance_id: str | None = None
    error: str | None = None
    session_id: str | None = None  # the session the router served it in (inferred when unsent)
    # Simulation only: the call's time in its instance by category (TimeSplit), and what its
    # KV rebuild cost: prefilling the tokens it recomputed, copying those it restored.
    split: dict[str, float] | None = None
    recompute_s: float = 0.0
    restore_s: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def recomputed_tokens(self) -> int:
        """Prompt tokens prefilled again although an earlier call had computed their KV."""
        return max(0, self.reusable_tokens - self.cached_tokens)


@dataclass
class SessionResult:
    session_id: str
    model: str
    arrival_s: float
    calls: list[CallRecord] = field(default_factory=list)

    @property
    def start_s(self) -> float:
        return self.calls[0].sent_s

    @property
    def end_s(self) -> float:
        return self.calls[-1].done_s

    @property
    def sct_s(self) -> float:
        """Session completion time: first call sent -> last call done, tool gaps included."""
        return self.end_s - self.start_s

    @property
    def failed_calls(self) -> int:
        return sum(1 for c in self.calls if c.error is not None)


@dataclass
class ReplayResult:
    policy: str
    sessions: list[SessionResult]
    totals: ClusterTotals | None = None  # engine-side totals (simulation only)
    wall_s: float = 0.0  # wall-clock time the replay took

    @property
    def calls(self) -> list[CallRecord]:
        return [c for s in self.sessions for c in s.calls]

    @property
    def failed_calls(self) -> int:
        return sum(s.failed_calls for s in self.sessions)

    @property
    def makespan_s(self) -> float:
        return max(s.end_s for s in self.sessions) - min(s.start_s for s in self.sessions)


@dataclass
class CallOutcome:
    first_token_s: float | None
    done_s: float
    output_token_ids: list[int]
    cached_tokens: int = 0
    restored_tokens: int = 0
    instance_id: str | None = None
    error: str | None = None


class Target(Protocol):
    """Where calls go. ``output_tokens`` is what the caller expects (the trace's count);
    ``tokens`` gives stand-in output ids when the target cannot return real ones."""

    async def call(self, request: CallRequest, tokens: SessionTokens) -> CallOutcome: ...


async def drive(
    sessions: Sequence[Session],
    target: Target,
    *,
    seed: int = 0,
    vocab_of: Callable[[str], int],
    context_of: Callable[[str], int] | None = None,
    block_size: int = 16,
    progress: bool = False,
    desc: str = "replay",
    time_scale: float = 1.0,
    output_kv_reusable: bool = True,
    send_session_ids: bool = True,
    shared_prefix_tokens: int = 0,
    answers: dict[str, int] | None = None,
    prompt_chains: bool = False,
) -> list[SessionResult]:
    """Replay ``sessions`` closed-loop against ``target`` on the running loop. Arrivals and
    tool gaps are multiplied by ``time_scale``. ``block_size``: KV reuse is counted in whole
    blocks (what a prefix cache can hold). ``output_kv_reusable``: whether the previous
    call's output tokens, as they reappear in the next prompt, could hit its KV (False when
    the target returns no token ids and stand-ins replace them). ``send_session_ids=False``:
    calls go without their session id (the router infers it; each record keeps the one it
    used). ``shared_prefix_tokens``: every session's first prompt of a model starts with the
    same tokens, as an agent's system prompt and tool definitions do (at most all but one of
    the prompt's tokens). ``answers``: the simulated engines' registry of answer lengths (call
    id -> output tokens), filled here while each call runs; calls then ask for
    ``AGENT_MAX_TOKENS`` (None: for the trace's length, as a live target needs).
    ``prompt_chains``: each call carries its prompt's block-hash chain (``CallRequest.
    prompt_chain``), hashed from the last one's: for in-process targets only."""
    if time_scale < 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    bar = _progress_bar(sum(s.num_calls for s in sessions), desc, progress)

    shared = {m: SessionTokens("<shared prefix>", seed, vocab_of(m)).take(shared_prefix_tokens)
              for m in {s.model for s in sessions}}
    board = CallBoard(sessions)

    async def one(session: Session) -> SessionResult:
        start = t0
        if session.start_after is not None or session.calls[0].waits_for:
            await board.wait_start(session)
            start = loop.time()
        await asyncio.sleep(session.arrival_s * time_scale)
        result = SessionResult(session.session_id, session.model, start + session.arrival_s * time_scale)
        tokens = SessionTokens(session.session_id, seed, vocab_of(session.model))
        context = context_of(session.model) if context_of is not None else None
        prompt: Sequence[int] = []
        output: list[int] = []
        chain: BlockChain | None = None  # the last prompt's, when ``prompt_chains``
        for k, call in enumerate(session.calls):
            if k > 0:
                await board.wait(call.waits_for)
                await asyncio.sleep((session.calls[k - 1].tool_gap_s or 0.0) * time_scale)
            reusable, repeated = 0, 0  # repeated: leading tokens of the last prompt + output
            if call.prefix_from is not None and call.prefix_from.session_id != session.session_id:
                prompt = next_prompt(board.tokens(call.prefix_from), [], call.input_tokens, tokens,
                                     call.prefix_tokens)
            elif k == 0:
                first = shared[session.model][: call.input_tokens - 1]
                first.extend(tokens.take(call.input_tokens - len(first)))
                prompt = PromptView(first, len(first))
            else:
                computed = (board.computed(call.prefix_from, output_kv_reusable) if call.prefix_from
                            else computed_tokens(len(prompt), len(output), output_kv_reusable))
                prev, out = (board.tokens(call.prefix_from), []) if call.prefix_from else (prompt, output)
                base_len = len(prev) + len(out)
                kept = base_len if call.prefix_tokens is None else call.prefix_tokens
                reusable = min(kept, computed, call.input_tokens - 1) // block_size * block_size
                if call.prefix_from is None:
                    repeated = min(kept, call.input_tokens)
                prompt = next_prompt(prev, out, call.input_tokens, tokens, call.prefix_tokens)
            if prompt_chains:
                chain = prompt_chain(prompt, chain, repeated, block_size)
            max_tokens = call.output_tokens if answers is None else AGENT_MAX_TOKENS
            if context is not None:
                if len(prompt) >= context:
                    raise ValueError(
                        f"session {session.session_id!r} call {k}: prompt of {len(prompt)} "
                        f"tokens does not fit model {session.model!r} (context {context})"
                    )
                max_tokens = min(max_tokens, context - len(prompt))
            request = CallRequest(
                call_id=f"{session.session_id}#{k}",
                session_id=session.session_id if send_session_ids else "",
                model=session.model,
                prompt_token_ids=prompt,
                params=SamplingParams(max_tokens=max_tokens, ignore_eos=answers is None,
                                      temperature=0.0),
                prompt_chain=chain,
            )
            if answers is not None:
                answers[request.call_id] = call.output_tokens
            sent = loop.time()
            try:
                outcome = await target.call(request, tokens)
            finally:
                if answers is not None:
                    answers.pop(request.call_id, None)
            output = outcome.output_token_ids
            result.calls.append(
                CallRecord(
                    index=k,
                    sent_s=sent,
                    first_token_s=outcome.first_token_s,
                    done_s=outcome.done_s,
                    prompt_tokens=len(prompt),
                    output_tokens=len(output),
                    reusable_tokens=reusable,
                    cached_tokens=outcome.cached_tokens,
                    restored_tokens=outcome.restored_tokens,
                    instance_id=outcome.instance_id,
                    error=outcome.error,
                    session_id=request.session_id or None,
                )
            )
            board.ended(CallRef(session.session_id, k), prompt, output)
            bar.update(1)
        return result

    try:
        return list(await asyncio.gather(*(one(s) for s in sessions)))
    finally:
        bar.close()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, desc: str, enabled: bool) -> _NoBar:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="call", file=sys.stderr, leave=False,
                dynamic_ncols=True)


# --- the simulated cluster ------------------------------------------------------------------
class SimTarget:
    """Calls through the in-process router core (virtual clock, no HTTP)."""

    def __init__(self, router: object) -> None:
        self.router = router

    async def call(self, request: CallRequest, tokens: SessionTokens) -> CallOutcome:
        loop = asyncio.get_running_loop()
        request.step_events = False  # collect_outcome reads the first token and the finish
        for _ in range(MAX_OVERLOAD_RETRIES):
            try:
                async with contextlib.aclosing(self.router.submit(request)) as events:
                    return await collect_outcome(events)
            except Overloaded as exc:
                await asyncio.sleep(max(0.1, exc.retry_after_s))
            except (NoHealthyInstance, CallRejected, InstanceUnavailable) as exc:
                return CallOutcome(None, loop.time(), [], error=f"{type(exc).__name__}: {exc}")
        return CallOutcome(None, loop.time(), [], error="overloaded on every retry")


class StandInOutputs:
    """A target whose outputs come back as stand-in ids from the session's generator, as a
    live target's do (its HTTP answer is text): the same prompts as a live replay."""

    def __init__(self, target: Target) -> None:
        self.target = target

    async def call(self, request: CallRequest, tokens: SessionTokens) -> CallOutcome:
        outcome = await self.target.call(request, tokens)
        outcome.output_token_ids = tokens.take(len(outcome.output_token_ids))
        return outcome


async def collect_outcome(
    events: AsyncIterator[CallEvent], instance_id: str | None = None
) -> CallOutcome:
    """Read one call's event stream to its finish: first-token and done times from the
    loop's clock, the output ids, and the final usage."""
    loop = asyncio.get_running_loop()
    first: float | None = None
    out: list[int] = []
    async for ev in events:
        if first is None and (ev.token_ids or ev.finished):
            first = loop.time()
        out.extend(ev.token_ids)
        if ev.finished:
            usage = ev.usage
            failed = ev.error is not None or ev.finish_reason == "error"
            return CallOutcome(
                first, loop.time(), out,
                cached_tokens=usage.cached_tokens if usage else 0,
                restored_tokens=usage.restored_tokens if usage else 0,
                instance_id=ev.instance_id or instance_id,
                error=(ev.error or "call failed") if failed else None,
            )
    return CallOutcome(first, loop.time(), out, error="stream ended without a finish")


def model_limits(
    models: Sequence[str] | Mapping[str, ModelSpec],
) -> tuple[dict[str, int], dict[str, int]]:
    """(vocab size, context length) of each catalog model (bundled names, or their specs)."""
    specs = dict(models) if isinstance(models, Mapping) else {m: ModelSpec.load(m) for m in models}
    return ({m: s.vocab_size for m, s in specs.items()},
            {m: s.max_position_embeddings for m, s in specs.items()})


def call_contexts(spec: ClusterSpec) -> dict[str, int]:
    """Each model's context as a simulated replay bounds a call (prompt + answer): the model's
    own, and no more than a KV cache of ``spec.kv_tokens`` holds when that is set."""
    _, context = model_limits(spec.catalog())
    if spec.kv_tokens is not None:  # no call may outgrow the KV cache: the room it allows
        context = {m: min(n, spec.kv_tokens) for m, n in context.items()}
    return context


def run_sim(
    sessions: Sequence[Session],
    system: SystemConfig,
    spec: ClusterSpec | None = None,
    *,
    seed: int = 0,
    progress: bool = False,
    send_session_ids: bool = True,
    shared_prefix_tokens: int = 0,
    time_scale: float = 1.0,
    vocab_size: int | None = None,
    output_kv_reusable: bool = True,
    exact_max_tokens: bool = False,
) -> ReplayResult:
    """Replay ``sessions`` on a simulated cluster of ``system`` under a fresh virtual loop
    (``send_session_ids``, ``shared_prefix_tokens``, ``time_scale``: see :func:`drive`).
    ``vocab_size``: prompt ids from ``[0, vocab_size)`` rather than each model's vocabulary;
    ``output_kv_reusable`` False: the next prompt continues with stand-in ids for each
    output, as a live replay's does (the output's KV is then not reused).
    ``exact_max_tokens``: every call asks for exactly its trace's answer, as a live replay
    must (the simulated twin of one); else it asks ``AGENT_MAX_TOKENS`` and the simulated
    model ends its answer where the trace says."""
    spec = spec or ClusterSpec()
    unknown = sorted({s.model for s in sessions} - set(spec.models))
    if unknown:
        raise ValueError(f"trace sessions use model(s) {unknown} that the cluster does not "
                         f"serve ({list(spec.models)}); assign catalog models first")
    vocab, _ = model_limits(spec.catalog())
    context = call_contexts(spec)
    wall = time.perf_counter()

    answers: dict[str, int] | None = None if exact_max_tokens else {}

    async def main() -> ReplayResult:
        cluster = await start_cluster(system, spec, answers=answers)
        target: Target = SimTarget(cluster.router)
        if not output_kv_reusable:
            target = StandInOutputs(target)
        try:
            results = await drive(
                sessions, target, seed=seed,
                vocab_of=vocab.__getitem__ if vocab_size is None else lambda _m: vocab_size,
                context_of=context.__getitem__, block_size=spec.block_size, progress=progress,
                desc=system.name, send_session_ids=send_session_ids,
                shared_prefix_tokens=shared_prefix_tokens, time_scale=time_scale,
                output_kv_reusable=output_kv_reusable, answers=answers, prompt_chains=True,
            )
            totals = cluster.totals()
            attach_splits(results, cluster.call_splits(), cluster.engines)
        finally:
            await cluster.stop()
        return ReplayResult(system.name, results, totals)

    result = run_virtual(main())
    result.wall_s = time.perf_counter() - wall
    return result


def replicate(sessions: Sequence[Session], copies: int) -> list[Session]:
    """``copies`` x the sessions (for a scale-out cluster), copy r's ids suffixed ``@r``."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    if copies == 1:
        return list(sessions)
    return [s.renamed(lambda sid, r=r: f"{sid}@{r}") for r in range(copies) for s in sessions]
