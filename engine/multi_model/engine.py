"""The live multi-model engine: a catalog of models on one device arena, one active at a time.

Implements ``engine.interface.MultiModelEngineProtocol`` with real tensors. Each model has
its own ``EngineCore`` (scheduler, KV cache manager with the host KV store as its secondary
cache, runner bound to the shared weight and KV regions); only the active model's core takes
requests and runs. ``activate`` resets the outgoing core's device KV (its blocks are about to
be overwritten by the incoming model's) and copies the incoming weights into the weight
region (D2D from staging when staged, else H2D from the host weight store). Every move is
timed (``MoveReport`` with measured seconds).

Device work goes through ``RankModels`` (engine.multi_model.rank), whose methods take plain
data; at TP=N ``TensorParallelRankModels`` (engine.multi_model.tp) runs the same activate /
stage / offload / restore on every rank in order, and each model's core drives a
``TensorParallelRunner`` that runs its forward on every rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from pathlib import Path

import structlog
import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.interface import (
    EngineRequest,
    EngineStats,
    ModelLimits,
    MoveReport,
    Residency,
    StepResult,
    TokenEvent,
)
from engine.model_runner import resolve_device
from engine.models.checkpoint_cache import model_dir
from engine.multi_model.catalog import read_catalog
from engine.multi_model.config import MultiModelConfig
from engine.multi_model.rank import RankModels
from engine.multi_model.rates import ModelRateMeter, StagingBook
from engine.multi_model.secondary import RankSecondary
from engine.multi_model.tp import RankBuild, TensorParallelRankModels
from engine.served_models import ServedModels, ServesModels
from substrate.host_kv_index import ChainLookups
from substrate.moves import MoveKind

log = structlog.get_logger(__name__)

RESTORE_REPORTS_KEPT = 4096


class MultiModelEngine(ServesModels):
    simulated = False

    def __init__(
        self, models: Mapping[str, str | Path], config: MultiModelConfig | None = None
    ) -> None:
        if config is None:
            raise ValueError("MultiModelEngine needs a MultiModelConfig (KV sizing)")
        self.config = config
        self.device = resolve_device(config.device)
        models = {name: model_dir(path) for name, path in models.items()}  # GGUF: converted
        self.rank = _build_rank(models, config, self.device)
        self.catalog = self.rank.catalog
        try:
            self._build_cores(config)
            if config.initial_model is not None:
                self.activate(config.initial_model)
        except BaseException:
            self.rank.shutdown()
            raise

    def _build_cores(self, config: MultiModelConfig) -> None:
        self._secondaries: dict[str, RankSecondary] = {}
        self.cores: dict[str, EngineCore] = {}
        for name, entry in self.catalog.items():
            secondary = RankSecondary(self.rank, name)
            self._secondaries[name] = secondary
            self.cores[name] = EngineCore(
                EngineConfig(
                    model=entry.path,
                    max_model_len=config.max_model_len,
                    block_size=config.block_size,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    max_num_seqs=config.max_num_seqs,
                    enable_prefix_caching=config.enable_prefix_caching,
                    device=str(self.device),
                    seed=config.seed,
                    cuda_graphs=config.cuda_graphs and config.tensor_parallel_size == 1,
                ),
                runner=self.rank.runners[name],
                tokenizer=entry.tokenizer,
                secondary=secondary,
            )
        self.served = ServedModels(
            {n: ModelLimits(c.max_model_len, c.vocab_size) for n, c in self.cores.items()}
        )
        self._sessions: dict[str, dict[str, list[int]]] = {name: {} for name in self.catalog}
        self._session_model: dict[str, str] = {}
        self._held: set[str] = set()  # sessions whose host KV is evicted last
        self._host_chains = ChainLookups(self.rank.host_kv_index())
        self._meters = {
            name: ModelRateMeter(entry.kv_bytes_per_token) for name, entry in self.catalog.items()
        }
        self._staging = StagingBook(self._meters)
        # The latest restores, for a benchmark to take; bounded, as nobody takes them live.
        self._restores: deque[MoveReport] = deque(maxlen=RESTORE_REPORTS_KEPT)
        self._carried: list[TokenEvent] = []  # switched-out cores' undelivered events

    # ------------------------------------------------------------------ catalog

    def kv_bytes_per_token(self, model: str) -> float:
        self._check_model(model)
        return float(self.catalog[model].kv_bytes_per_token)

    def residency(self) -> dict[str, Residency]:
        self._poll_staging()
        return {name: Residency(p.value) for name, p in self.rank.placements().items()}

    # ---------------------------------------------------------------- switching
    def activate(self, model: str, lend_staging: bool = False) -> MoveReport:
        """Make ``model`` the active one. Requires no live request; drops every device KV
        block of the outgoing model (offload first to keep them). Events the outgoing core
        has not delivered (aborts') come with the next ``step``. ``lend_staging``: until the
        next activation, ``model``'s KV cache spans the staging region too
        (``kv_capacity_blocks(model, lent=True)`` blocks) and nothing can be staged."""
        live = sum(core.num_live_requests for core in self.cores.values())
        self.served.check_activation(model, live)
        if lend_staging and not self.rank.has_staging_region:
            raise ValueError(f"{model}: no staging region to lend to the KV cache")
        if model == self.served.active:
            if not lend_staging or self.rank.staging_lent:
                return MoveReport(MoveKind.NONE, 0, 0.0)  # lending stays as it is
            return self._lend_to_active(model, live)
        self._poll_staging(block=self.rank.staged_model == model)
        if self.served.active is not None:
            outgoing = self.cores[self.served.active]
            self._carried.extend(outgoing.take_pending_events())
            self._remember_sessions(self.served.active)
            outgoing.reset_kv()
        self.served.active = None  # if the copy fails, no model is runnable (torn weights)
        record = self.rank.activate(model, lend_staging)
        self.cores[model].reset_kv()  # as many blocks as its KV cache now has
        self.served.active = model
        self._meters[model].observe_move(record)
        self._book_staging()  # the activation may have seen a staging copy end
        log.info("multi_model.activate", model=model, kind=record.kind, seconds=record.seconds,
                 lend_staging=lend_staging)
        return record

    def _lend_to_active(self, model: str, live: int) -> MoveReport:
        """Lend the staging region to the active model's KV cache: its KV cache is
        re-viewed over both regions (nothing copied; device KV dropped as at a switch, so
        offload first). Needs no live request: the view's layout changes under them."""
        if live:
            raise RuntimeError(f"cannot lend the staging region to {model!r}'s KV cache: "
                               f"{live} requests are live")
        self._remember_sessions(model)
        record = self.rank.activate(model, lend_staging=True)
        self.cores[model].reset_kv()  # as many blocks as its lent KV cache has
        self._meters[model].observe_move(record)
        self._book_staging()  # lending waited for the staging copy in flight
        log.info("multi_model.lend_to_active", model=model, seconds=record.seconds)
        return record

    def kv_capacity_blocks(self, model: str, lent: bool = False) -> int:
        """Device KV blocks ``model`` gets while active (``lent``: with the staging region
        lent to its KV cache; as many as without when there is none)."""
        self._check_model(model)
        return self.rank.kv_capacity_blocks(model, lent)

    def can_stage(self, model: str) -> bool:
        self._check_model(model)
        return self.rank.can_stage(model)

    def stage(self, model: str) -> MoveReport:
        """Start copying ``model`` into the staging region. ``seconds``: measured when the
        config waits for staging (or when no rate is known yet, so nothing can be predicted),
        else predicted from the measured host-link rate."""
        self._check_model(model)
        self._poll_staging(block=self.rank.staged_model not in (None, model))
        plan, record = self.rank.stage(model, wait=self.config.wait_for_staging)
        if record is None and plan.kind == MoveKind.STAGE:
            estimate = self.rank.estimate(plan)
            if estimate is None:
                record = self.rank.poll_staging(block=True, raise_failure=True)
            else:
                record = MoveReport(MoveKind.STAGE, plan.bytes, estimate)
        self._book_staging()
        return MoveReport(plan.kind, plan.bytes, 0.0) if record is None else record

    def take_staging_failures(self) -> list[str]:
        """Models whose background staging copies failed since the last call, as the last
        poll (``residency``, ``activate``, ``stage``) saw them: each staged nothing (the
        model is in host memory only); a copy ``stage`` waited for raises instead."""
        self._book_staging()
        return self._staging.take_failures()

    def offload_kv(self, session_ids: list[str] | None = None) -> MoveReport:
        """Copy the active model's cached device KV of these sessions (None: every session
        it has served) to the host KV store; blocks already there are only touched, and the
        store evicts least recently used blocks to make room."""
        if self.served.active is None:
            return MoveReport(MoveKind.KV_OFFLOAD, 0, 0.0)
        model = self.served.active
        core = self.cores[model]
        sessions = list(self._sessions[model]) if session_ids is None else session_ids
        nbytes, seconds = 0, 0.0
        for sid in sessions:
            if self._session_model.get(sid) != model:
                continue
            block_ids = core.kv.session_block_ids(sid)
            if not block_ids:
                continue
            hashes = core.kv.session_block_hashes(sid)[: len(block_ids)]
            record = self.rank.offload_kv(model, hashes, block_ids, sid)
            nbytes += record.bytes
            seconds += record.seconds
        report = MoveReport(MoveKind.KV_OFFLOAD, nbytes, seconds)
        self._meters[model].observe_move(report)
        return report

    # ----------------------------------------------------------------- requests
    def add_request(self, request: EngineRequest) -> None:
        model = self.served.resolve_model(request)
        self.cores[model].add_request(request)
        if request.session_id is not None:
            self._session_model[request.session_id] = model
            self._sessions[model].setdefault(request.session_id, [])

    def step(self) -> StepResult:
        """The active core's step; events carried from switched-out cores come first, taken
        only once it has run (a step that raises leaves them for the next one)."""
        if self.served.active is None:
            carried, self._carried = self._carried, []
            return StepResult(events=carried, seconds=0.0)
        model = self.served.active
        result = self.cores[model].step()
        result.events[:0], self._carried = self._carried, []
        meter = self._meters[model]
        meter.observe_step(result)
        for record in self._secondaries[model].drain_records():
            meter.observe_move(record)
            self._restores.append(record)
        return result

    def abort(self, request_id: str, keep_session: bool = False) -> None:
        for core in self.cores.values():
            core.abort(request_id, keep_session)

    def has_unfinished(self) -> bool:
        return bool(self._carried) or any(core.has_unfinished() for core in self.cores.values())

    def take_restore_reports(self) -> list[MoveReport]:
        """KV restores (kind "kv_restore") performed inside steps since the last call (at
        most the latest ``RESTORE_REPORTS_KEPT``)."""
        out = list(self._restores)
        self._restores.clear()
        return out

    # --------------------------------------------------------------- session KV
    def pin_session_kv(self, session_id: str) -> int:
        core = self._active_core_of(session_id)
        return core.pin_session_kv(session_id) if core is not None else 0

    def unpin_session_kv(self, session_id: str) -> None:
        core = self._active_core_of(session_id)
        if core is not None:
            core.unpin_session_kv(session_id)

    def hold_host_kv(self, session_id: str, held: bool = True) -> None:
        """Keep the session's host KV past every block of a session not held: the host
        store evicts it only once nothing else is left to evict (``held=False``: least
        recently used as any other again). The instance holds a session while it has a
        soft reservation. Forgetting the session lets it go, and the host KV it saved."""
        if held != (session_id in self._held):
            (self._held.add if held else self._held.discard)(session_id)
            self.rank.hold_host_kv(session_id, held)

    def forget_session(self, session_id: str) -> None:
        """Forget it on every model it called, not only its last (an earlier model keeps
        its chain while its host KV lasts, which a new session under the id would read)."""
        # the host KV it saved is no longer its (a new session under the id, held, would
        # hold it), nor is it held: one rank op, for a session that ran here or is held
        if self._session_model.pop(session_id, None) is not None or session_id in self._held:
            self.rank.forget_host_kv(session_id)
        self._held.discard(session_id)
        self._host_chains.forget(session_id)
        for name, sessions in self._sessions.items():
            sessions.pop(session_id, None)
            self.cores[name].kv.forget_session(session_id)

    def session_kv_tokens(self, session_id: str) -> tuple[int, int]:
        """(tokens of the session's last prefix cached on device, tokens in the host store)."""
        model = self._session_model.get(session_id)
        if model is None:
            return 0, 0
        bs = self.config.block_size
        core = self.cores[model]
        if model == self.served.active:
            device = core.session_device_tokens(session_id)
            chain = core.kv.session_block_hashes(session_id) or self._sessions[model][session_id]
        else:
            device = 0
            chain = self._sessions[model].get(session_id, [])
        return device, self._host_chains.lookup(session_id, model, chain) * bs

    # -------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        """The active model's scheduler and block counts; token totals over all models."""
        cores = list(self.cores.values())
        active = self.cores[self.served.active] if self.served.active is not None else None
        base = (
            active.stats() if active is not None else EngineStats(block_size=self.config.block_size)
        )
        base.prefill_tokens_total = sum(c.prefill_tokens_total for c in cores)
        base.cached_tokens_total = sum(c.scheduler.cached_tokens_total for c in cores)
        base.restored_tokens_total = sum(c.scheduler.restored_tokens_total for c in cores)
        for kind in MoveKind.ALL:
            nbytes, seconds = self.rank.move_totals(kind)
            base.extra[f"{kind}_bytes_total"] = float(nbytes)
            base.extra[f"{kind}_seconds_total"] = seconds
        used, capacity = self.rank.host_kv_usage()
        base.extra["host_kv_used_bytes"] = float(used)
        base.extra["host_kv_capacity_bytes"] = float(capacity)
        return base

    def model_rates(self, model: str, context_tokens: int = 0) -> dict[str, float]:
        """Measured rates of ``model`` on this instance, the keys of the simulated engine's
        ``model_rates`` plus a few (0.0 where nothing was measured yet):
        prefill_tokens_per_s, decode_step_s, switch_host_s, switch_staged_s, stage_s,
        kv_restore_bytes_per_s, kv_offload_bytes_per_s, kv_bytes_per_token,
        kv_capacity_tokens (the KV region's, as the simulated engine's: never the lent
        view's), weight_bytes. Live rates are averages over every step and move
        measured so far; ``context_tokens`` is accepted for signature parity with the
        simulated engine and does not change them."""
        self._check_model(model)
        rates = self._meters[model].rates()
        rates["kv_capacity_tokens"] = float(
            self.rank.kv_capacity_blocks(model) * self.config.block_size
        )
        rates["weight_bytes"] = float(self.catalog[model].layout.total_bytes)
        return rates

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to stop at TP=1); idempotent."""
        self.rank.shutdown()
        for core in self.cores.values():
            core.shutdown()

    # ------------------------------------------------------------------ helpers
    def _check_model(self, model: str) -> None:
        self.served.check_model(model)

    def _poll_staging(self, block: bool = False) -> None:
        """See whether the staging copy in flight ended (``block``: wait for it); book it."""
        self.rank.poll_staging(block=block)
        self._book_staging()

    def _book_staging(self) -> None:
        """Every staging copy the substrate saw end (inside an activation or a stage too):
        its record to its model's meter, once; a failure for ``take_staging_failures``."""
        self._staging.book(self.rank.take_staging_outcomes())

    def _active_core_of(self, session_id: str) -> EngineCore | None:
        model = self._session_model.get(session_id)
        if model is None or model != self.served.active:
            return None
        return self.cores[model]

    def _remember_sessions(self, model: str) -> None:
        """Keep the outgoing model's session hash chains (its KV manager forgets them on
        reset) so host-store lookups can still answer ``session_kv_tokens``; sessions with
        nothing in the host store are forgotten (their device KV is about to go)."""
        core = self.cores[model]
        sessions = self._sessions[model]
        for sid in list(sessions):
            chain = core.kv.session_block_hashes(sid) or sessions[sid]
            if chain and self.rank.host_kv_lookup(model, chain) > 0:
                sessions[sid] = chain
            else:
                del sessions[sid]
                self._host_chains.forget(sid)
                if self._session_model.get(sid) == model:
                    del self._session_model[sid]

    @property
    def weight_region(self) -> torch.Tensor:
        return self.rank.weight_region

    @property
    def kv_region(self) -> torch.Tensor:
        return self.rank.kv_region


def _build_rank(
    models: Mapping[str, str | Path], config: MultiModelConfig, device: torch.device
) -> RankModels | TensorParallelRankModels:
    """This process's rank at TP=1, or rank 0's proxy over a started group at TP=N."""
    if config.tensor_parallel_size > 1:
        return TensorParallelRankModels.start(
            RankBuild(
                {name: str(path) for name, path in models.items()},
                config.dtype,
                config.block_size,
                config.kv_bytes,
                config.num_kv_blocks,
                config.host_kv_bytes,
                config.staging,
                config.weight_bytes,
                config.attention_backend,
                config.seed,
                config.pin_host_memory,
                config.staging_region,
            ),
            config.tensor_parallel_size,
            device,
            address=config.distributed_address,
            port=config.distributed_port,
            timeout_s=config.distributed_timeout_s,
            load_tokenizers=config.load_tokenizers,
        )
    catalog = read_catalog(
        models, config.dtype, config.block_size, load_tokenizers=config.load_tokenizers
    )
    return RankModels(
        catalog,
        device,
        block_size=config.block_size,
        kv_bytes=config.kv_bytes,
        num_kv_blocks=config.num_kv_blocks,
        host_kv_bytes=config.host_kv_bytes,
        staging=config.staging,
        weight_bytes=config.weight_bytes,
        staging_region=config.staging_region,
        attention_backend=config.attention_backend,
        seed=config.seed,
        pin=config.pin_host_memory,
    )

