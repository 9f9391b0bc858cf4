"""The simulated multi-model engine: the live engine's bookkeeping, the cost model's clock.

``SimEngine`` implements ``MultiModelEngineProtocol`` with ``simulated = True``. It drives the
same torch-free ``Scheduler`` / ``KVCacheManager`` / ``BlockPool`` the live ``EngineCore``
drives, in the same order (schedule -> run -> ``update_after_step`` -> append tokens -> finish),
but replaces the model runner and sampler with ``CostModel`` step times and synthetic tokens.
Every operation returns the *modelled* seconds and never sleeps; the caller's executor sleeps
on the virtual clock. The injected ``clock`` is read only to know when a background staging
copy completes.

Memory, per GPU (all byte counts are per TP rank, as in the cost model):
- stable substrate: one arena carved once: a weight region sized for the catalog's largest
  shard, a staging region of the same size when ``staging`` is on, and a fixed KV region (the
  rest of the usable HBM). A model's KV capacity is that region over its bytes per token.
- without it (the baseline): each activation re-allocates, so the KV region is whatever the
  model's own weights leave, and there is no staging region.
Activation of another model drops every device block of the outgoing one (pins included);
``offload_kv`` first keeps sessions' cached prefixes in the host KV index, from which a later
request of the same model restores its longest prefix (charged ``kv_restore_seconds``) instead
of prefilling it.

Simplifications, all deliberate:
- tokens are synthetic and never EOS: a request stops at ``max_tokens`` (or the model's
  context length); stop strings and stop token ids are ignored;
- decode-only steps are fused (``max_fused_decode_steps``): see ``SimEngineConfig``;
- a background staging copy does not slow the active model's steps.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence

from engine.sim.cost_model import CostModel
from engine.interface import (
    EngineRequest,
    EngineStats,
    MoveReport,
    Residency,
    StepResult,
    TokenEvent,
)
from engine.kv_cache_manager import KVCacheManager
from engine.sim.model_spec import ModelSpec
from engine.request import Request, RequestStatus
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.sim.config import HOST_MEMORY_USABLE_FRACTION, SimEngineConfig
from engine.sim.kv import HostKVSecondary, SessionRecord
from engine.sim.step_time import DecodeLine
from substrate.devices import server_preset
from substrate.host_kv_index import HostKVIndex
from substrate.ledger import Ledger, StagingState
from substrate.moves import MoveKind, MoveRecord

# Kind of an activation in an engine without the stable substrate (free, re-allocate, reload,
# re-capture); the admission loop's rate book counts every non-D2D activation as a host one.
ACTIVATE_RELOAD = "activate_reload"

__all__ = ["ACTIVATE_RELOAD", "DecodeLine", "SimEngine", "SimEngineConfig"]


class SimEngine:
    """A catalog of models on one simulated TP group, one active at a time."""

    simulated: bool = True

    def __init__(
        self,
        catalog: Mapping[str, ModelSpec] | Sequence[str],
        config: SimEngineConfig | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config or SimEngineConfig()
        self.clock = clock
        specs = _resolve_catalog(catalog)
        server = server_preset(self.config.server)
        self.costs: dict[str, CostModel] = {
            name: CostModel(server, spec, self.config.tp) for name, spec in specs.items()
        }
        bs = self.config.block_size
        self.weight_region_bytes = max(c.weight_bytes_per_gpu() for c in self.costs.values())
        self.staging_bytes = self.weight_region_bytes if self.config.staging else 0
        self._num_blocks: dict[str, int] = {}
        for name, cost in self.costs.items():
            if self.config.stable_substrate:
                tokens = cost.kv_capacity_tokens(self.weight_region_bytes, self.staging_bytes)
            else:
                tokens = cost.kv_capacity_tokens()
            if tokens < bs:
                raise ValueError(
                    f"model {name!r} leaves no room for KV on a {server.name} GPU at tp="
                    f"{self.config.tp} (weight region {self.weight_region_bytes} B, staging "
                    f"{self.staging_bytes} B)"
                )
            self._num_blocks[name] = tokens // bs
        host_kv = self.config.host_kv_bytes
        if host_kv is None:
            per_rank = int(server.host_memory_bytes * HOST_MEMORY_USABLE_FRACTION) // self.config.tp
            host_kv = max(0, per_rank - sum(c.weight_bytes_per_gpu() for c in self.costs.values()))
        self.host_kv = HostKVIndex(host_kv)
        self.ledger = Ledger(self.weight_region_bytes, self.staging_bytes, self.host_kv)
        for name, cost in self.costs.items():
            self.ledger.add_host_model(name, cost.weight_bytes_per_gpu())
            self.ledger.set_kv_block_bytes(name, bs * cost.kv_bytes_per_token_per_gpu())
        self._staging_ready_at = 0.0
        self._active: str | None = None
        self.kv: KVCacheManager | None = None
        self.scheduler: Scheduler | None = None
        self._secondary: HostKVSecondary | None = None
        self._sessions: dict[str, SessionRecord] = {}
        # session -> (host index version, its record, host tokens): lookups walk a whole
        # chain, and the admission loop asks for every session every refresh
        self._host_tokens: dict[str, tuple[int, SessionRecord, int]] = {}
        self._seeds: dict[str, int] = {}
        self._pending: list[TokenEvent] = []
        self._decode_lines: dict[tuple[str, int], DecodeLine] = {}
        self._totals = {"prefill": 0, "decode": 0, "cached": 0, "restored": 0,
                        "preemptions": 0, "steps": 0, "switches": 0}
        self.busy_seconds = 0.0

    # ------------------------------------------------------------------ catalog
    @property
    def model_names(self) -> list[str]:
        return list(self.costs)

    @property
    def active_model(self) -> str | None:
        return self._active

    def cost_model(self, model: str) -> CostModel:
        return self.costs[self._check_model(model)]

    def kv_capacity_blocks(self, model: str) -> int:
        """Device KV blocks ``model`` gets while active."""
        return self._num_blocks[self._check_model(model)]

    def model_rates(self, model: str, context_tokens: int = 0) -> dict[str, float]:
        """This instance's modelled rates for ``model`` (the fields of a router ModelState):
        prefill throughput of one full chunk and one decode step, both after
        ``context_tokens`` cached tokens; switch times as this engine would pay them."""
        cost = self.cost_model(model)
        chunk = self.config.max_num_batched_tokens
        host_s = self._switch_seconds(model, staged=False)
        staged_s = cost.switch_seconds_staged() if self.config.staging else host_s
        return {
            "prefill_tokens_per_s": chunk / cost.chunks_step_seconds([(chunk, context_tokens)]),
            "decode_step_s": cost.decode_step_seconds(1, context_tokens),
            "switch_host_s": host_s,
            "switch_staged_s": staged_s,
            "kv_restore_bytes_per_s": cost.device.host_link_bytes_per_s,
            "kv_bytes_per_token": float(cost.kv_bytes_per_token_per_gpu()),
            "kv_capacity_tokens": float(self._num_blocks[model] * self.config.block_size),
        }

    # ----------------------------------------------------------------- requests
    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        if self._active is None or self.scheduler is None:
            raise RuntimeError(f"request {rid!r}: no model is active; activate one first")
        if request.model != self._active:
            raise ValueError(
                f"request {rid!r} is for model {request.model!r} but {self._active!r} is active"
            )
        if rid in self.scheduler.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        prompt = request.prompt_token_ids
        spec = self.costs[self._active].model
        if not prompt:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if len(prompt) >= spec.max_position_embeddings:
            raise ValueError(
                f"request {rid!r}: prompt has {len(prompt)} tokens; {self._active!r} has "
                f"max_position_embeddings {spec.max_position_embeddings} and must leave room "
                f"for at least one generated token"
            )
        req = Request(rid, list(prompt), request.params, session_id=request.session_id)
        # Tokens of the session's previous call were checked then: check only the rest.
        req.block_hashes = self._reusable_hashes(req)
        rest = req.prompt_token_ids[len(req.block_hashes) * self.config.block_size :]
        if rest:
            low, high = min(rest), max(rest)
            if low < 0 or high >= spec.vocab_size:
                raise ValueError(
                    f"request {rid!r}: token id {low if low < 0 else high} is outside "
                    f"{self._active!r}'s vocabulary [0, {spec.vocab_size})"
                )
        self.scheduler.add_request(req)
        self._seeds[rid] = zlib.crc32(rid.encode())

    def abort(self, request_id: str) -> None:
        """Abort a waiting or running request, freeing its blocks; unknown ids are ignored.
        The abort's event (no tokens) comes with the next ``step``."""
        if self.scheduler is None:
            return
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if req is not None:
            self._seeds.pop(request_id, None)
            self._pending.append(_event(req, []))

    def has_unfinished(self) -> bool:
        return bool(self._pending) or (
            self.scheduler is not None and self.scheduler.has_unfinished()
        )

    # --------------------------------------------------------------------- step
    def step(self) -> StepResult:
        events, self._pending = self._pending, []
        sched = self.scheduler
        if sched is None or self._active is None:
            return StepResult(events=events, seconds=0.0, num_steps=0)
        assert self._secondary is not None
        cost = self.costs[self._active]
        self._secondary.loaded_blocks = 0
        out = sched.schedule()
        self._totals["preemptions"] += len(out.preempted_ids)
        if out.is_empty:
            # Waiting requests that cannot be admitted (e.g. blocks pinned): the engine
            # still spends its per-step overhead finding that out.
            seconds = cost.eff.step_overhead_s if sched.has_unfinished() else 0.0
            self.busy_seconds += seconds
            return StepResult(events=events, seconds=seconds, num_steps=0)
        chunks: list[tuple[int, int]] = []
        decodes: list[ScheduledRequest] = []
        for s in out.scheduled:
            if s.samples and s.num_new_tokens == 1 and s.request.num_output_tokens > 0:
                decodes.append(s)
            else:
                chunks.append((s.num_new_tokens, s.num_computed_tokens))
        decode_context = sum(s.num_computed_tokens for s in decodes)
        if chunks:
            fused = 1
            seconds = cost.chunks_step_seconds(chunks, len(decodes), decode_context)
        else:
            fused = self._fusable_steps(out, decodes)
            seconds = self._decode_line(len(decodes)).seconds(decode_context, fused)
        restored = self._secondary.loaded_blocks * self.config.block_size
        if restored:
            seconds += cost.kv_restore_seconds(restored)
        sched.update_after_step(out)
        events.extend(self._emit(out, fused))
        num_decode = out.num_decode_tokens * fused
        self._totals["prefill"] += out.num_prefill_tokens
        self._totals["decode"] += num_decode
        self._totals["steps"] += fused
        self.busy_seconds += seconds
        return StepResult(
            events=events,
            seconds=seconds,
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=num_decode,
            num_steps=fused,
        )

    def _decode_line(self, num_seqs: int) -> DecodeLine:
        key = (self._active or "", num_seqs)
        line = self._decode_lines.get(key)
        if line is None:
            line = self._decode_lines[key] = DecodeLine.of(self.costs[key[0]], num_seqs)
        return line

    def _fusable_steps(self, out: SchedulerOutput, decodes: list[ScheduledRequest]) -> int:
        """How many decode steps this decode-only step may stand for (>= 1). Extra KV blocks
        for the fused tokens are allocated here; fusion shrinks until they fit."""
        assert self.scheduler is not None and self.kv is not None
        limit = self.config.max_fused_decode_steps
        if limit == 1 or out.preempted_ids or len(decodes) != self.scheduler.num_running:
            return 1
        max_len = self.scheduler.max_model_len
        for s in decodes:
            r = s.request
            limit = min(limit, r.params.max_tokens - r.num_output_tokens, max_len - r.num_tokens)
        if limit <= 1:
            return 1
        bs = self.config.block_size
        free = self.kv.num_free_blocks
        while limit > 1:
            need = sum(
                max(0, -(-(s.num_computed_tokens + limit) // bs) - len(s.block_ids))
                for s in decodes
            )
            if need <= free:
                break
            limit -= 1
        if limit > 1:
            for s in decodes:
                allocated = self.kv.allocate_slots(s.request, limit)
                assert allocated, "free blocks were counted before allocating"
        return limit

    def _emit(self, out: SchedulerOutput, fused: int) -> list[TokenEvent]:
        """Append synthetic tokens to the requests that sampled, finish those at their length
        limit, and describe it all as events."""
        assert self.scheduler is not None and self.kv is not None
        vocab = self.costs[self._active or ""].model.vocab_size
        max_len = self.scheduler.max_model_len
        events: list[TokenEvent] = []
        for s in out.scheduled:
            req = s.request
            if not s.samples or req.status != RequestStatus.RUNNING:
                continue
            n = fused if s.num_new_tokens == 1 and req.num_output_tokens > 0 else 1
            seed = self._seeds[req.request_id]
            start = req.num_tokens
            tokens = [_synthetic_token(seed, start + k, vocab) for k in range(n)]
            req.output_token_ids.extend(tokens)
            if n > 1:
                req.num_computed_tokens = s.num_computed_tokens + n
                self.kv.cache_computed_blocks(req)
            if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= max_len:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
                self._seeds.pop(req.request_id, None)
                self._remember_session(req)
            events.append(_event(req, tokens))
        return events

    # ----------------------------------------------------------- session chains
    def _remember_session(self, req: Request) -> None:
        sid = req.session_id
        if sid is None or self.kv is None or self._active is None:
            return
        hashes = self.kv.session_block_hashes(sid)
        self._sessions[sid] = SessionRecord(
            self._active, hashes, req.prompt_token_ids, list(req.output_token_ids)
        )

    def _reusable_hashes(self, req: Request) -> list[int]:
        """The leading block hashes of ``req`` already known from its session's last call
        (the longest block prefix whose tokens match), so a 100k-token continuation hashes
        only its new blocks. Hashes depend on tokens only, never on where the KV lives."""
        prev = self._sessions.get(req.session_id) if req.session_id is not None else None
        if prev is None or not prev.block_hashes:
            return []
        bs = self.config.block_size
        prompt = req.prompt_token_ids
        hi = min(len(prev.block_hashes), len(prompt) // bs)
        if prev.starts(prompt, hi * bs):
            return prev.block_hashes[:hi]
        lo = 0  # invariant: the first lo blocks match, block hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if prev.starts(prompt, mid * bs):
                lo = mid
            else:
                hi = mid
        return prev.block_hashes[:lo]

    # --------------------------------------------------------------- switching
    def activate(self, model: str) -> MoveReport:
        """Make ``model`` active. Requires no unfinished request; drops every device KV block
        of the outgoing model, pins included (``offload_kv`` first to keep them). Seconds:
        D2D when ``model`` is STAGED, H2D otherwise (a staging copy still in progress does not
        count); without the stable substrate, the baseline reload."""
        self._check_model(model)
        if self.scheduler is not None and self.scheduler.has_unfinished():
            raise RuntimeError(
                f"cannot activate {model!r}: {len(self.scheduler.requests)} requests of "
                f"{self._active!r} are unfinished"
            )
        self._poll_staging()
        if model == self._active:
            return MoveReport(MoveKind.NONE, 0, 0.0)
        nbytes = self.costs[model].weight_bytes_per_gpu()
        if self.config.stable_substrate:
            kind = self.ledger.plan_activation(model).kind
            seconds = self._switch_seconds(model, staged=kind == MoveKind.ACTIVATE_D2D)
        else:
            kind = ACTIVATE_RELOAD
            seconds = self._switch_seconds(model, staged=False)
        self._base_totals()
        self._secondary = HostKVSecondary(self.host_kv, model)
        self.kv = KVCacheManager(
            self._num_blocks[model],
            self.config.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
            secondary=self._secondary if self.host_kv.capacity_bytes > 0 else None,
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.costs[model].model.max_position_embeddings,
        )
        self.ledger.commit_activation(model)
        self.ledger.record(MoveRecord(kind, nbytes, seconds))
        self._active = model
        self._totals["switches"] += 1
        self.busy_seconds += seconds
        return MoveReport(kind, nbytes, seconds)

    def _switch_seconds(self, model: str, staged: bool) -> float:
        cost = self.costs[model]
        if not self.config.stable_substrate:
            return cost.switch_seconds_baseline()
        return cost.switch_seconds_staged() if staged else cost.switch_seconds_host()

    def stage(self, model: str) -> MoveReport:
        """Start the background copy of ``model`` into the staging region; it is STAGING
        until ``clock()`` reaches the returned seconds from now, then STAGED. Staging the
        model already staged (or being staged) moves nothing and returns the time left."""
        self._check_model(model)
        if not self.config.staging:
            raise ValueError(f"cannot stage {model!r}: this engine has no staging region")
        if model == self._active:
            raise ValueError(f"cannot stage {model!r}: it is the active model")
        if self.clock is None:
            raise RuntimeError(f"cannot stage {model!r}: the engine was built without a clock")
        now = self.clock()
        self._poll_staging()
        plan = self.ledger.plan_staging(model)
        if plan.kind == MoveKind.NONE:
            return MoveReport(MoveKind.NONE, 0, max(0.0, self._staging_ready_at - now))
        seconds = self.costs[model].switch_seconds_host()
        self.ledger.begin_staging(model)
        self.ledger.record(MoveRecord(MoveKind.STAGE, plan.bytes, seconds))
        self._staging_ready_at = now + seconds
        return MoveReport(MoveKind.STAGE, plan.bytes, seconds)

    def _poll_staging(self) -> None:
        ledger = self.ledger
        if (
            ledger.staged_model is not None
            and ledger.staging_state is StagingState.IN_PROGRESS
            and self.clock is not None
            and self.clock() >= self._staging_ready_at
        ):
            ledger.finish_staging(ledger.staged_model)

    def residency(self) -> dict[str, Residency]:
        if not self.config.stable_substrate:
            return {
                m: Residency.ACTIVE if m == self._active else Residency.HOST for m in self.costs
            }
        self._poll_staging()
        return {m: Residency(self.ledger.placement(m).value) for m in self.costs}

    # --------------------------------------------------------------- session KV
    def offload_kv(self, session_ids: list[str] | None = None) -> MoveReport:
        """Copy the active model's cached KV of these sessions (None: all) to the host KV
        index. Blocks already there are only touched; the report counts blocks copied."""
        model = self._active
        if model is None or self.kv is None or self.host_kv.capacity_bytes == 0:
            return MoveReport(MoveKind.KV_OFFLOAD, 0, 0.0)
        wanted = None if session_ids is None else set(session_ids)
        block_bytes = self.ledger.kv_block_bytes(model)
        copied = 0
        for sid, sess in self._sessions.items():
            if sess.model != model or (wanted is not None and sid not in wanted):
                continue
            on_device = len(self.kv.session_block_ids(sid))
            if on_device:
                result = self.host_kv.insert_chain(
                    model, sess.block_hashes[:on_device], block_bytes, session_id=sid
                )
                copied += len(result.inserted)
        seconds = self.costs[model].kv_offload_seconds(copied * self.config.block_size)
        record = MoveRecord(MoveKind.KV_OFFLOAD, copied * block_bytes, seconds)
        self.ledger.record(record)
        self.busy_seconds += seconds
        return MoveReport(record.kind, record.bytes, record.seconds)

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
        self._sessions.pop(session_id, None)
        self._host_tokens.pop(session_id, None)
        if self.kv is not None:
            self.kv.forget_session(session_id)

    def session_kv_tokens(self, session_id: str) -> tuple[int, int]:
        sess = self._sessions.get(session_id)
        if sess is None:
            return (0, 0)
        bs = self.config.block_size
        device = 0
        if sess.model == self._active and self.kv is not None:
            device = len(self.kv.session_block_ids(session_id)) * bs
        cached = self._host_tokens.get(session_id)
        if cached is not None and cached[0] == self.host_kv.version and cached[1] is sess:
            return (device, cached[2])
        host = self.host_kv.lookup(sess.model, sess.block_hashes, touch=False) * bs
        self._host_tokens[session_id] = (self.host_kv.version, sess, host)
        return (device, host)

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
        if model not in self.costs:
            raise ValueError(f"unknown model {model!r}; this engine serves {sorted(self.costs)}")
        return model


def _resolve_catalog(catalog: Mapping[str, ModelSpec] | Sequence[str]) -> dict[str, ModelSpec]:
    if isinstance(catalog, str):
        raise TypeError("catalog must be a list of model names or a name -> ModelSpec mapping")
    if isinstance(catalog, Mapping):
        specs = dict(catalog)
    else:
        specs = {name: ModelSpec.load(name) for name in catalog}
    if not specs:
        raise ValueError("the catalog must name at least one model")
    return specs


def _synthetic_token(seed: int, position: int, vocab_size: int) -> int:
    """A deterministic token id for (request, position): a multiplicative hash."""
    return ((seed ^ (position * 0x9E3779B1)) * 0x85EBCA6B) % vocab_size


def _event(req: Request, tokens: list[int]) -> TokenEvent:
    return TokenEvent(
        request_id=req.request_id,
        new_token_ids=tokens,
        finished=req.is_finished,
        finish_reason=req.status.finish_reason,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
        num_restored_tokens=req.num_restored_tokens,
        num_output_tokens=req.num_output_tokens,
    )
