"""The simulated multi-model engine: the live engine's bookkeeping, the cost model's clock.

``SimEngine`` implements ``MultiModelEngineProtocol`` with ``simulated = True``. It drives the
same torch-free ``Scheduler`` / ``KVCacheManager`` / ``BlockPool`` the live ``EngineCore``
drives, in the same order (schedule -> run -> ``update_after_step`` -> append tokens -> finish),
but replaces the model runner and sampler with ``CostModel`` step times and synthetic tokens.
Every operation returns the *modelled* seconds and never sleeps; the caller's executor sleeps
on the virtual clock. The injected ``clock`` is read only to know when a background staging
copy completes.

Memory, per GPU (all byte counts are per TP rank, as in the cost model), is ``SimMemory``
(memory.py); requests and the host KV index share the live engine's checks (``ServedModels``)
and session bookkeeping is ``SimSessions`` (kv.py).
Activation of another model drops every device block of the outgoing one (pins included);
``offload_kv`` first keeps sessions' cached prefixes in the host KV index, from which a later
request of the same model restores its longest prefix instead of prefilling it; a
write-through tier (``config.kv_tier``) fills the index as blocks are computed instead, and
prices its copies its own way (``HostTier``). ``suspend`` parks the unfinished requests of
the active model (token-level preemption) until it is activated again.

Simplifications, all deliberate:
- tokens are synthetic; an answer ends where ``answer_lengths`` (written by the replay only,
  never seen by a policy) says, as at an EOS, else at ``max_tokens`` or the context length;
  stop strings, stop token ids and thinking budgets (``engine.thinking_budget``) are ignored;
- decode-only steps are fused (``max_fused_decode_steps``, ``cut_fused_steps``): ``SimEngineConfig``;
- a background staging copy does not slow the active model's steps, but it shares the host
  link with KV restored from host meanwhile: both run at half rate while they overlap.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence

from engine.interface import (
    EngineRequest,
    EngineStats,
    ModelLimits,
    MoveReport,
    Residency,
    StepResult,
    TokenEvent,
)
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus, token_event
from engine.scheduler import Scheduler, SchedulerOutput, remembers_session
from engine.served_models import ServedModels, ServesModels
from engine.sim.config import SimEngineConfig
from engine.sim.cost_model import CostModel
from engine.sim.fused import FusedRun
from engine.sim.host_tier import HostTier
from engine.sim.kv import HostKVSecondary, SimSessions
from engine.sim.kv_tier import kv_tier
from engine.sim.memory import ACTIVATE_WAKE, SimMemory
from engine.sim.model_spec import ModelSpec, resolve_catalog
from engine.sim.parking import Parking
from engine.sim.step_time import DecodeLine, fusable_steps, split_scheduled
from engine.sim.tokens import token_ids
from substrate.devices import server_preset
from substrate.moves import MoveKind, MoveRecord

__all__ = ["ACTIVATE_WAKE", "DecodeLine", "SimEngine", "SimEngineConfig"]


class SimEngine(ServesModels):
    """A catalog of models on one simulated TP group, one active at a time."""

    simulated: bool = True

    def __init__(
        self,
        catalog: Mapping[str, ModelSpec] | Sequence[str],
        config: SimEngineConfig | None = None,
        clock: Callable[[], float] | None = None,
        answer_lengths: Mapping[str, int] | None = None,
    ) -> None:
        self.config = config or SimEngineConfig()
        self.clock = clock
        self.answer_lengths = {} if answer_lengths is None else answer_lengths  # id -> its EOS
        specs = resolve_catalog(catalog)
        server = server_preset(self.config.server)
        self.costs: dict[str, CostModel] = {
            name: CostModel(server, spec, self.config.tp) for name, spec in specs.items()
        }
        bs = self.config.block_size
        self.memory = SimMemory(self.costs, self.config, server, clock)
        self.host_kv = self.memory.host_kv
        self.host_tier = HostTier(self.host_kv, kv_tier(self.config.kv_tier), bs)
        self.parking = Parking()  # requests suspended by token-level preemption
        limits = {name: ModelLimits(cost.model.max_position_embeddings, cost.model.vocab_size)
                  for name, cost in self.costs.items()}
        self.served = ServedModels(limits)
        self.kv: KVCacheManager | None = None
        self.scheduler: Scheduler | None = None
        self._secondary: HostKVSecondary | None = None
        self.sessions = SimSessions(self.host_kv, bs, clock, self.config.session_tokens_s)
        self._seeds: dict[str, int] = {}
        self._pending: list[TokenEvent] = []
        self._decode_lines: dict[tuple[str, int], DecodeLine] = {}
        self._fused: FusedRun | None = None  # the last step, while it can still be cut
        self._totals = {"prefill": 0, "decode": 0, "cached": 0, "restored": 0,
                        "preemptions": 0, "steps": 0, "switches": 0, "swapped": 0}
        self.busy_seconds = 0.0

    # ------------------------------------------------------------------ catalog

    def cost_model(self, model: str) -> CostModel:
        return self.costs[self._check_model(model)]

    def kv_bytes_per_token(self, model: str) -> float:
        return float(self.cost_model(model).kv_bytes_per_token_per_gpu())

    def kv_capacity_blocks(self, model: str, lent: bool = False) -> int:
        """Device KV blocks ``model`` gets while active (``lent``: with the staging region
        lent to its KV cache; as many as without when there is none)."""
        blocks = self.memory.lent_blocks if lent else self.memory.num_blocks
        return blocks[self._check_model(model)]

    def model_rates(self, model: str, context_tokens: int = 0) -> dict[str, float]:
        """This instance's modelled rates for ``model`` (the fields of a router ModelState):
        prefill throughput of one full chunk and one decode step, both after
        ``context_tokens`` cached tokens; switch times as this engine would pay them."""
        cost = self.cost_model(model)
        chunk = self.config.max_num_batched_tokens
        outgoing = self.served.active if self.served.active != model else None
        host_s = self.memory.switch_seconds(model, False, outgoing)
        staged_s = self.memory.switch_seconds(model, True, outgoing) if self.config.staging else host_s
        return {
            "prefill_tokens_per_s": chunk / cost.chunks_step_seconds([(chunk, context_tokens)]),
            "decode_step_s": cost.decode_step_seconds(1, context_tokens),
            "switch_host_s": host_s,
            "switch_staged_s": staged_s,
            "kv_restore_bytes_per_s": self.host_tier.restore_bytes_per_s(cost),
            "kv_bytes_per_token": float(cost.kv_bytes_per_token_per_gpu()),
            "kv_capacity_tokens": float(self.kv_capacity_blocks(model) * self.config.block_size),
        }

    # ----------------------------------------------------------------- requests
    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        self.served.resolve_model(request)
        assert self.scheduler is not None  # a model is active
        req = Request(rid, request.prompt_token_ids, request.params, request.session_id, request.priority)
        # Tokens of the session's previous call were checked then: check only the rest.
        req.block_hashes, checked = self.sessions.prompt_hashes(req, request.prompt_chain)
        self.served.check_request(request, self.scheduler.requests,
                                  checked * self.config.block_size)
        self.scheduler.add_request(req)
        self._seeds[rid] = zlib.crc32(rid.encode())

    def abort(self, request_id: str, keep_session: bool = False) -> None:
        """Abort a waiting or running request, freeing its blocks; unknown ids are ignored.
        The abort's event (no tokens) comes with the next ``step``. ``keep_session``: its
        chain becomes the session's record, as a finished request's (``remembers_session``)."""
        req = None
        if self.scheduler is not None:
            req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED, keep_session)
            if req is not None and remembers_session(req, keep_session):
                self.sessions.remember(self.served.active or "", req, self.kv)
        if req is None:
            req = self.parking.abort(request_id)
        if req is not None:
            self._seeds.pop(request_id, None)
            self.host_tier.forget(request_id)
            self._pending.append(token_event(req, []))

    def has_unfinished(self) -> bool:
        """Requests still to finish, suspended ones included."""
        return bool(self._pending) or len(self.parking) > 0 or (
            self.scheduler is not None and self.scheduler.has_unfinished()
        )

    # --------------------------------------------------------------------- step
    def step(self) -> StepResult:
        events, self._pending, self._fused = self._pending, [], None
        sched = self.scheduler
        if sched is None or self.served.active is None:
            return StepResult(events=events, seconds=0.0, num_steps=0)
        assert self._secondary is not None
        cost = self.costs[self.served.active]
        self._secondary.loaded_blocks = 0
        out = sched.schedule()
        self._totals["preemptions"] += len(out.preempted_ids)
        if out.is_empty:
            # Waiting requests that cannot be admitted (e.g. blocks pinned): the engine
            # still spends its per-step overhead finding that out.
            seconds = cost.eff.step_overhead_s if sched.has_unfinished() else 0.0
            self.busy_seconds += seconds
            return StepResult(events=events, seconds=seconds, num_steps=0)
        chunks, decodes = split_scheduled(out)
        decode_context = sum(s.num_computed_tokens for s in decodes)
        if chunks:
            fused = 1
        else:
            assert self.kv is not None
            fused = fusable_steps(sched, self.kv, out, decodes, self.config.max_fused_decode_steps,
                                  self._tokens_left, self.config.cut_fused_steps)
        if chunks:
            seconds = cost.chunks_step_seconds(chunks, len(decodes), decode_context)
        else:
            seconds = self._decode_line(len(decodes)).seconds(decode_context, fused)
        restored = self._secondary.loaded_blocks * self.config.block_size
        restore_s = 0.0
        if restored:
            # a restore shares the host link with a staging copy in flight
            self.memory.poll_staging()
            restore_s = self.host_tier.restore_seconds(cost, restored)
            restore_s += self.memory.share_host_link(restore_s)
        seconds = self.host_tier.step_seconds(cost, seconds, restore_s)
        sched.update_after_step(out)
        assert self.kv is not None
        store_s = self.host_tier.write_through(
            self.served.active or "", (s.request for s in out.scheduled), self.kv, cost
        )
        seconds = self.host_tier.with_store(cost, seconds, store_s)
        first = len(events)
        events.extend(self._emit(out, fused))
        num_decode = out.num_decode_tokens * fused
        self._totals["prefill"] += out.num_prefill_tokens
        self._totals["decode"] += num_decode
        self._totals["steps"] += fused
        self.busy_seconds += seconds
        result = StepResult(events, seconds, out.num_prefill_tokens, num_decode, fused)
        if fused > 1 and self.config.cut_fused_steps:
            reqs = {s.request.request_id: s.request for s in decodes}
            self._fused = FusedRun(result, self._decode_line(len(decodes)), decode_context, fused,
                                   [(first + i, reqs[e.request_id], e.new_token_ids)
                                    for i, e in enumerate(events[first:])])
        return result

    def cut_fused(self, elapsed_s: float) -> float | None:
        """End the fused decode step in flight at its first step boundary at or after
        ``elapsed_s`` from its start (``engine.sim.fused``): its seconds now, or None."""
        run = self._fused
        if run is None or (keep := run.steps_by(elapsed_s)) >= run.steps:
            return None
        self._totals["decode"] -= (run.steps - keep) * len(run.decoded)
        self._totals["steps"] -= run.steps - keep
        self.busy_seconds -= run.cut(keep)
        return run.result.seconds

    def _tokens_left(self, req: Request) -> int:
        """Output tokens ``req`` may still sample (answer's end, max_tokens, context)."""
        assert self.scheduler is not None
        end = min(req.params.max_tokens, self.answer_lengths.get(req.request_id, req.params.max_tokens))
        return min(end - req.num_output_tokens, self.scheduler.max_model_len - req.num_tokens)

    def _decode_line(self, num_seqs: int) -> DecodeLine:
        key = (self.served.active or "", num_seqs)
        line = self._decode_lines.get(key)
        if line is None:
            line = self._decode_lines[key] = DecodeLine.of(self.costs[key[0]], num_seqs)
        return line

    def _emit(self, out: SchedulerOutput, fused: int) -> list[TokenEvent]:
        """Append synthetic tokens to the requests that sampled, finish those at a limit."""
        assert self.scheduler is not None and self.kv is not None
        vocab = self.costs[self.served.active or ""].model.vocab_size
        max_len, ids = self.scheduler.max_model_len, token_ids(vocab)
        events: list[TokenEvent] = []
        seeds, answers, running = self._seeds, self.answer_lengths, RequestStatus.RUNNING
        for s in out.scheduled:
            req = s.request
            if not s.samples or req.status is not running:
                continue
            output = req.output_token_ids
            seed, start = seeds[req.request_id], req.num_prompt_tokens + len(output)
            n = fused if s.num_new_tokens == 1 and output else 1
            tokens = _synthetic_tokens(ids, seed, start, n, vocab)
            output.extend(tokens)
            if n > 1:
                req.num_computed_tokens = s.num_computed_tokens + n
                self.kv.cache_computed_blocks(req)
            answer, num_output = answers.get(req.request_id), len(output)
            ended = answer is not None and num_output >= answer
            if ended or num_output >= req.params.max_tokens or start + len(tokens) >= max_len:
                status = RequestStatus.FINISHED_STOPPED if ended else RequestStatus.FINISHED_LENGTH
                self.scheduler.finish_request(req.request_id, status)
                self._seeds.pop(req.request_id, None)
                self.host_tier.forget(req.request_id)
                self.sessions.remember(self.served.active or "", req, self.kv)
            events.append(token_event(req, tokens))
        return events

    # --------------------------------------------------------------- switching
    def activate(self, model: str, lend_staging: bool = False) -> MoveReport:
        """Make ``model`` active. Requires no unfinished request of the outgoing model
        (``suspend`` parks them); drops every device KV block of the outgoing one, pins
        included (``offload_kv`` first to keep them); priced by ``SimMemory.activate``, plus
        copying back the KV of ``model``'s suspended requests, which resume.
        ``lend_staging``: its KV cache spans the staging region too until the next
        activation (``kv_capacity_blocks(model, lent=True)``); nothing can be staged. For the
        active model not lent yet: ``SimMemory.lend_to_active``, no unfinished request."""
        unfinished = len(self.scheduler.requests) if self.scheduler is not None else 0
        self.served.check_activation(model, unfinished)
        if lend_staging and not self.memory.staging_bytes:
            raise ValueError(f"{model}: no staging region to lend to the KV cache")
        self.memory.poll_staging()
        if model == self.served.active:
            if not lend_staging or self.memory.ledger.staging_lent:  # lending stays as it is
                return self._resume_parked(model, MoveReport(MoveKind.NONE, 0, 0.0))
            if unfinished:
                raise RuntimeError(f"cannot lend the staging region to {model!r}'s KV cache: "
                                   f"{unfinished} of its requests are unfinished")
            record = self.memory.lend_to_active()
            self._new_kv_cache(model)
            self.busy_seconds += record.seconds  # the wait for a staging copy in flight
            return record
        if self.served.active is not None:
            self.host_tier.switched_out(self.served.active)
        record = self.memory.activate(model, lend_staging)
        self._new_kv_cache(model)
        self.served.active = model
        self._totals["switches"] += 1
        self.busy_seconds += record.seconds
        return self._resume_parked(model, record)

    def _new_kv_cache(self, model: str) -> None:
        """A fresh KV cache (and scheduler) over the blocks ``model`` has now."""
        self._base_totals()
        self._secondary = HostKVSecondary(self.host_kv, model)
        cfg, secondary = self.config, self._secondary if self.host_kv.capacity_bytes else None
        self.kv = KVCacheManager(self.memory.kv_blocks(model), cfg.block_size,
                                 enable_prefix_caching=cfg.enable_prefix_caching,
                                 secondary=secondary)
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   max_num_seqs=cfg.max_num_seqs,
                                   max_model_len=self.costs[model].model.max_position_embeddings)

    def _resume_parked(self, model: str, record: MoveReport) -> MoveReport:
        """Resume ``model``'s suspended requests (just activated): their KV copy is added
        to the activation's time."""
        assert self.scheduler is not None
        swapped = self.parking.resume_all(model, self.scheduler)
        if not swapped:
            return record
        self._totals["swapped"] += swapped
        seconds = self.host_tier.restore_seconds(self.costs[model], swapped)
        self.busy_seconds += seconds
        kind = MoveKind.KV_RESTORE if record.kind == MoveKind.NONE else record.kind
        return MoveRecord(kind, record.bytes, record.seconds + seconds)

    def suspend(self) -> MoveReport:
        """Token-level preemption: park every unfinished request of the active model, its
        computed KV copied to host (charged at the host link); the requests resume, KV
        copied back, when the model is next activated. Their events continue then."""
        model = self.served.active
        if model is None or self.scheduler is None or not self.scheduler.has_unfinished():
            return MoveReport(MoveKind.NONE, 0, 0.0)
        tokens = self.parking.park_all(model, self.scheduler)
        cost = self.costs[model]
        record = MoveRecord(MoveKind.KV_OFFLOAD, tokens * cost.kv_bytes_per_token_per_gpu(),
                            self.host_tier.offload_seconds(cost, tokens))
        self.memory.ledger.record(record)
        self.busy_seconds += record.seconds
        return record

    def stage(self, model: str) -> MoveReport:
        """Start the background copy of ``model`` into the staging region (SimMemory.stage)."""
        self._check_model(model)
        if model == self.served.active:
            raise ValueError(f"cannot stage {model!r}: it is the active model")
        return self.memory.stage(model)

    def residency(self) -> dict[str, Residency]:
        return self.memory.residency(self.served.active)

    def can_stage(self, model: str) -> bool:
        return self.memory.ledger.can_stage(self._check_model(model))

    # --------------------------------------------------------------- session KV
    def offload_kv(self, session_ids: list[str] | None = None) -> MoveReport:
        """Copy the active model's cached KV of these sessions (None: all) to the host KV
        index. Blocks already there are only touched; the report counts blocks copied."""
        model = self.served.active
        if model is None or self.kv is None or self.host_kv.capacity_bytes == 0:
            return MoveReport(MoveKind.KV_OFFLOAD, 0, 0.0)
        block_bytes = self.memory.ledger.kv_block_bytes(model)
        copied = self.sessions.offload(model, self.kv, session_ids, block_bytes)
        seconds = self.host_tier.offload_seconds(self.costs[model], copied * self.config.block_size)
        record = MoveRecord(MoveKind.KV_OFFLOAD, copied * block_bytes, seconds)
        self.memory.ledger.record(record)
        self.busy_seconds += seconds
        return record

    def pin_session_kv(self, session_id: str) -> int:
        if self.kv is None:
            return 0
        return self.kv.pin_session(session_id)

    def unpin_session_kv(self, session_id: str) -> None:
        if self.kv is not None:
            self.kv.unpin_session(session_id)

    def forget_session(self, session_id: str) -> None:
        """Drop what the engine remembers of a finished session (its pin, its prefix chain
        and tokens); its blocks stay cached until evicted, unreachable by the session."""
        self.sessions.forget(session_id)
        if self.kv is not None:
            self.kv.forget_session(session_id)

    def session_kv_tokens(self, session_id: str) -> tuple[int, int]:
        return self.sessions.kv_tokens(session_id, self.served.active, self.kv)

    # -------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        t = self._totals
        sched, kv = self.scheduler, self.kv
        cached = t["cached"] + (sched.cached_tokens_total if sched else 0)
        restored = t["restored"] + (sched.restored_tokens_total if sched else 0)
        preemptions = t["preemptions"]
        return EngineStats(
            num_running=sched.num_running if sched else 0,
            num_waiting=sched.num_waiting if sched else 0,
            num_free_blocks=kv.num_free_blocks if kv else 0,
            num_cached_blocks=kv.num_cached_blocks if kv else 0,
            num_total_blocks=kv.num_total_blocks if kv else 0,
            block_size=self.config.block_size,
            prefill_tokens_total=t["prefill"],
            cached_tokens_total=cached,
            restored_tokens_total=restored,
            extra={
                "num_preemptions": float(preemptions),
                "num_pinned_blocks": float(kv.num_pinned_blocks if kv else 0),
                "decode_tokens_total": float(t["decode"]),
                "num_steps": float(t["steps"]),
                "num_switches": float(t["switches"]),
                "swapped_in_tokens": float(t["swapped"]),
                "num_suspended": float(len(self.parking)),
                "busy_seconds": self.busy_seconds,
                "host_kv_used_bytes": float(self.host_kv.used_bytes),
                "host_kv_capacity_bytes": float(self.host_kv.capacity_bytes),
            },
        )

    # ---------------------------------------------------------------- internals
    def _base_totals(self) -> None:
        """Fold the outgoing scheduler's running totals into the engine's."""
        if self.scheduler is not None:
            self._totals["cached"] += self.scheduler.cached_tokens_total
            self._totals["restored"] += self.scheduler.restored_tokens_total

    def _check_model(self, model: str) -> str:
        return self.served.check_model(model)


def _synthetic_tokens(ids: Sequence[int], seed: int, start: int, n: int, vocab: int) -> list[int]:
    """Token ids for positions ``start`` on: a multiplicative hash of (seed, position)."""
    return [ids[((seed ^ (p * 0x9E3779B1)) * 0x85EBCA6B) % vocab] for p in range(start, start + n)]

