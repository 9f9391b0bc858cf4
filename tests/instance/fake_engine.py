"""A small exact multi-model engine for admission-loop tests (simulated: it never sleeps).

Rules, all deterministic:
- a step takes ``step_s`` + ``prefill_s_per_token`` per prefilled token; a new request is
  prefilled whole in its first step and emits its first token there; every running request
  emits one token per step; a request finishes (LENGTH) at ``params.max_tokens`` tokens;
- a session's KV on device is ``tokens`` (prompt + output of its last call) while its model
  is active; a new call of the session whose prompt extends it reuses it (cached), else
  restores from the host copy if one is there (restored), else prefills everything;
- blocks: running requests hold ceil((prompt + output) / block_size); cached session KV holds
  ceil(tokens / block_size) and is evicted LRU when room is needed, unless pinned;
- requests and switches pass the same checks as every real engine (``ServedModels``):
  ``activate`` needs no running request and drops the outgoing model's device KV (pins
  included); D2D if the model was staged, else H2D;
- ``activate(model, lend_staging=True)`` gives the model ``lendable_blocks`` more blocks
  until the next activation and drops what was staged; nothing can be staged meanwhile;
- ``offload_kv`` copies device KV of the active model's sessions to the host store (never
  bounded; with ``host_kv_capacity_bytes`` set, ``stats().extra`` reports its fill).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.interface import (
    EngineRequest,
    EngineStats,
    FinishReason,
    ModelLimits,
    MoveReport,
    Residency,
    StepResult,
    TokenEvent,
)
from engine.served_models import ServedModels, ServesModels


@dataclass
class _Req:
    request: EngineRequest
    out: int = 0
    started: bool = False
    cached: int = 0
    restored: int = 0


@dataclass
class _SessionKV:
    model: str
    device: int = 0
    host: int = 0
    pinned: bool = False
    last_used: int = 0


@dataclass
class FakeEngine(ServesModels):
    models: list[str]
    num_blocks: int = 1000
    block_size: int = 16
    step_s: float = 0.1
    prefill_s_per_token: float = 0.0
    switch_host_s: float = 2.0
    switch_staged_s: float = 0.2
    stage_s: float = 1.0
    offload_s_per_token: float = 0.0
    kv_token_bytes: int = 100  # KV bytes per token, every model
    lendable_blocks: int = 0  # blocks the staging region adds to a KV cache it is lent to
    host_kv_capacity_bytes: int | None = None  # reported in stats().extra when set
    initial_model: str | None = None
    max_model_len: int = 1 << 20
    vocab_size: int = 1 << 20
    simulated: bool = True
    # observable counters
    log: list[tuple[str, str]] = field(default_factory=list)
    prefilled_tokens: int = 0
    cached_tokens: int = 0
    restored_tokens: int = 0
    offloaded_tokens: int = 0
    evicted: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    pins: int = 0
    unpins: int = 0

    def __post_init__(self) -> None:
        limits = ModelLimits(self.max_model_len, self.vocab_size)
        self.served = ServedModels({m: limits for m in self.models})
        self.served.active = self.initial_model
        self._reqs: dict[str, _Req] = {}
        self._kv: dict[str, _SessionKV] = {}
        self._staged: str | None = None
        self.lent = False
        self._tick = 0
        self._abort_events: list[str] = []

    # protocol ---------------------------------------------------------------------------

    @property
    def active(self) -> str | None:
        return self.served.active

    def add_request(self, request: EngineRequest) -> None:
        self.served.check_request(request, self._reqs)
        self._reqs[request.request_id] = _Req(request)
        self.log.append(("add", request.request_id))

    def step(self) -> StepResult:
        events: list[TokenEvent] = []
        prefill = 0
        decode = 0
        for rid in self._abort_events:
            events.append(TokenEvent(rid, [], finished=True, finish_reason=FinishReason.ABORT))
        self._abort_events.clear()
        for rid, req in list(self._reqs.items()):
            if not req.started:
                prefill += self._start(req)
            else:
                decode += 1
            req.out += 1
            finished = req.out >= req.request.params.max_tokens
            n_prompt = len(req.request.prompt_token_ids)
            events.append(
                TokenEvent(
                    request_id=rid,
                    new_token_ids=[(n_prompt + req.out) % 500],
                    finished=finished,
                    finish_reason=FinishReason.LENGTH if finished else None,
                    num_prompt_tokens=n_prompt,
                    num_cached_tokens=req.cached + req.restored,
                    num_restored_tokens=req.restored,
                    num_output_tokens=req.out,
                )
            )
            if finished:
                del self._reqs[rid]
                self._end_session(req)
        self.log.append(("step", ""))
        seconds = self.step_s + prefill * self.prefill_s_per_token
        return StepResult(events, seconds, num_prefill_tokens=prefill, num_decode_tokens=decode)

    def step_without(self, request_id: str) -> StepResult:
        """A step in which request ``request_id`` does nothing, no token and no event (as a
        request the engine preempted, or one inside a chunked prefill); the rest step on."""
        req = self._reqs.pop(request_id, None)
        try:
            return FakeEngine.step(self)
        finally:
            if req is not None:
                self._reqs[request_id] = req

    def abort(self, request_id: str, keep_session: bool = False) -> None:
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        self.aborted.append(request_id)
        self._abort_events.append(request_id)
        sid = req.request.session_id
        if keep_session:
            self._end_session(req)
        elif sid is not None and sid in self._kv:
            self._kv[sid].device = 0

    def has_unfinished(self) -> bool:
        return bool(self._reqs) or bool(self._abort_events)

    def stats(self) -> EngineStats:
        pinned = sum(self._blocks(s.device) for s in self._active_kv() if s.pinned)
        cached = sum(self._blocks(s.device) for s in self._active_kv() if not s.pinned)
        extra: dict[str, float] = {}
        if self.host_kv_capacity_bytes is not None:
            used = sum(kv.host for kv in self._kv.values()) * self.kv_token_bytes
            extra = {
                "host_kv_used_bytes": float(used),
                "host_kv_capacity_bytes": float(self.host_kv_capacity_bytes),
            }
        return EngineStats(
            num_running=len(self._reqs),
            num_free_blocks=self.blocks - self._running_blocks() - pinned,
            num_cached_blocks=cached,
            num_total_blocks=self.blocks,
            block_size=self.block_size,
            prefill_tokens_total=self.prefilled_tokens,
            cached_tokens_total=self.cached_tokens,
            restored_tokens_total=self.restored_tokens,
            extra=extra,
        )

    def kv_bytes_per_token(self, model: str) -> float:
        self.served.check_model(model)
        return float(self.kv_token_bytes)

    @property
    def blocks(self) -> int:
        """Device KV blocks of the active model now."""
        return self.num_blocks + (self.lendable_blocks if self.lent else 0)

    def kv_capacity_blocks(self, model: str, lent: bool = False) -> int:
        self.served.check_model(model)
        return self.num_blocks + (self.lendable_blocks if lent else 0)

    def activate(self, model: str, lend_staging: bool = False) -> MoveReport:
        self.served.check_activation(model, len(self._reqs))
        if lend_staging and not self.lendable_blocks:
            raise ValueError("no staging region to lend")
        if model == self.active and (self.lent or not lend_staging):
            self.log.append(("activate", model))  # as the real engines: lending stays
            return MoveReport("none", 0, 0.0)
        relend = model == self.active
        if relend and self._reqs:
            raise RuntimeError("cannot lend the staging region: requests are live")
        for kv in self._kv.values():
            if kv.model == self.active:
                kv.device = 0
                kv.pinned = False
        if relend:  # the KV cache re-viewed over both regions: nothing copied
            self._staged, self.lent = None, True
            self.log.append(("lend", model))
            return MoveReport("none", 0, 0.0)
        staged = self._staged == model
        if staged or lend_staging:
            self._staged = None
        self.lent = lend_staging
        self.served.active = model
        self.log.append(("activate_lent" if lend_staging else "activate", model))
        kind = "activate_d2d" if staged else "activate_h2d"
        return MoveReport(kind, 1000, self.switch_staged_s if staged else self.switch_host_s)

    def stage(self, model: str) -> MoveReport:
        if model == self.active:
            raise ValueError(f"{model!r} is active; nothing to stage")
        if self.lent:
            raise ValueError("the staging region is lent to the KV cache")
        self._staged = model
        self.log.append(("stage", model))
        return MoveReport("stage", 1000, self.stage_s)

    def can_stage(self, model: str) -> bool:
        return model in self.models

    def residency(self) -> dict[str, Residency]:
        out = {}
        for m in self.models:
            if m == self.active:
                out[m] = Residency.ACTIVE
            elif m == self._staged:
                out[m] = Residency.STAGED
            else:
                out[m] = Residency.HOST
        return out

    def offload_kv(self, session_ids: list[str] | None = None) -> MoveReport:
        tokens = 0
        for sid, kv in self._kv.items():
            if kv.model != self.active or kv.device == 0:
                continue
            if session_ids is not None and sid not in session_ids:
                continue
            kv.host = kv.device
            tokens += kv.device
            self.log.append(("offload", sid))
        self.offloaded_tokens += tokens
        return MoveReport(
            "kv_offload", tokens * self.kv_token_bytes, tokens * self.offload_s_per_token
        )

    def pin_session_kv(self, session_id: str) -> int:
        kv = self._kv.get(session_id)
        if kv is None or kv.model != self.active or kv.device == 0:
            return 0
        kv.pinned = True
        self.pins += 1
        self.log.append(("pin", session_id))
        return self._blocks(kv.device)

    def unpin_session_kv(self, session_id: str) -> None:
        kv = self._kv.get(session_id)
        if kv is not None and kv.pinned:
            kv.pinned = False
            self.unpins += 1
            self.log.append(("unpin", session_id))

    def session_kv_tokens(self, session_id: str) -> tuple[int, int]:
        kv = self._kv.get(session_id)
        if kv is None:
            return (0, 0)
        return (kv.device if kv.model == self.active else 0, kv.host)

    def forget_session(self, session_id: str) -> None:
        self._kv.pop(session_id, None)
        self.log.append(("forget", session_id))

    # test helpers -----------------------------------------------------------------------

    def pinned(self, session_id: str) -> bool:
        kv = self._kv.get(session_id)
        return kv is not None and kv.pinned

    # internals --------------------------------------------------------------------------

    def _blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def _active_kv(self) -> list[_SessionKV]:
        return [kv for kv in self._kv.values() if kv.model == self.active and kv.device > 0]

    def _running_blocks(self) -> int:
        return sum(
            self._blocks(len(r.request.prompt_token_ids) + r.out) for r in self._reqs.values()
        )

    def _start(self, req: _Req) -> int:
        """Prefill a new request: reuse device KV, else restore host KV, else compute."""
        req.started = True
        n_prompt = len(req.request.prompt_token_ids)
        sid = req.request.session_id
        kv = self._kv.get(sid) if sid is not None else None
        if kv is not None and kv.model == self.active:
            if 0 < kv.device <= n_prompt:
                req.cached = kv.device
            elif 0 < kv.host <= n_prompt:
                req.restored = kv.host
            kv.device = 0
            kv.pinned = False
        self._evict_for(0)
        computed = n_prompt - req.cached - req.restored
        self.prefilled_tokens += computed
        self.cached_tokens += req.cached
        self.restored_tokens += req.restored
        return computed

    def _evict_for(self, need: int) -> None:
        def free() -> int:
            used = self._running_blocks() + sum(self._blocks(s.device) for s in self._active_kv())
            return self.blocks - used

        victims = sorted(
            ((sid, kv) for sid, kv in self._kv.items() if kv.model == self.active and kv.device),
            key=lambda item: item[1].last_used,
        )
        for sid, kv in victims:
            if free() >= need:
                return
            if kv.pinned:
                continue
            kv.device = 0
            self.evicted.append(sid)
            self.log.append(("evict", sid))
        if free() < need:
            raise RuntimeError("fake engine: out of KV blocks")

    def _end_session(self, req: _Req) -> None:
        sid = req.request.session_id
        if sid is None:
            return
        self._tick += 1
        kv = self._kv.setdefault(sid, _SessionKV(model=req.request.model or ""))
        kv.device = len(req.request.prompt_token_ids) + req.out
        kv.last_used = self._tick
        self.log.append(("end", req.request.request_id))
