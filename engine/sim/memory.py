"""What lives where on one simulated TP group, and what moving it costs (per GPU).

- stable substrate: one arena carved once: a weight region sized for the catalog's largest
  shard, a staging region of the same size when staging is on (or of the second largest
  shard's: ``staging_region``), and a fixed KV region (the rest of the usable HBM). A
  model's KV capacity is that region over its bytes per token.
- without it (one plain engine per model, as vLLM or SGLang processes that sleep and wake):
  the KV region is whatever the model's own weights leave, and there is no staging region.
- ``kv_tokens`` set: every model gets that many tokens of KV, whatever the layout leaves.
A switch is priced by ``engine.sim.switching`` for the configured kind. The host KV index
holds what the host memory leaves after every model's weight shards (or ``host_kv_bytes``).
A background staging copy completes when the injected clock says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from engine.interface import MoveReport, Residency
from engine.sim.config import HOST_MEMORY_USABLE_FRACTION, SimEngineConfig
from engine.sim.cost_model import CostModel
from engine.sim.switching import SleepWakeRates, switch_seconds
from substrate.devices import ServerSpec
from substrate.host_kv_index import HostKVIndex
from substrate.ledger import Ledger, StagingState, staging_region_bytes
from substrate.moves import MoveKind, MoveRecord

# Kind of an activation by sleep and wake (vLLM sleep mode, SGLang memory release); the
# admission loop's rate book counts every non-D2D activation as a host one.
ACTIVATE_WAKE = "activate_wake"

__all__ = ["ACTIVATE_WAKE", "SimMemory"]


class SimMemory:
    def __init__(
        self,
        costs: Mapping[str, CostModel],
        config: SimEngineConfig,
        server: ServerSpec,
        clock: Callable[[], float] | None,
    ) -> None:
        self.costs = costs
        self.config = config
        self.clock = clock
        bs = config.block_size
        shards = sorted(c.weight_bytes_per_gpu() for c in costs.values())
        self.weight_region_bytes = shards[-1]
        self.staging_bytes = 0
        if config.staging:
            self.staging_bytes = staging_region_bytes(config.staging_region, shards, shards[-1])
        self.num_blocks: dict[str, int] = {}  # with the staging region lent: lent_blocks
        self.sleep_wake = SleepWakeRates(efficiency=config.sleep_wake_efficiency)
        for name, cost in costs.items():
            if config.kv_tokens is not None:
                tokens = config.kv_tokens
            elif config.stable_substrate:
                tokens = cost.kv_capacity_tokens(self.weight_region_bytes, self.staging_bytes)
            else:
                tokens = cost.kv_capacity_tokens()
            if tokens < bs:
                raise ValueError(
                    f"model {name!r} leaves no room for KV on a {server.name} GPU at tp="
                    f"{config.tp} (weight region {self.weight_region_bytes} B, staging "
                    f"{self.staging_bytes} B)"
                )
            self.num_blocks[name] = tokens // bs
        self.lent_blocks = self._lent_blocks(config)
        host_kv = config.host_kv_bytes
        if host_kv is None:
            per_rank = int(server.host_memory_bytes * HOST_MEMORY_USABLE_FRACTION) // config.tp
            host_kv = max(0, per_rank - sum(c.weight_bytes_per_gpu() for c in costs.values()))
        self.host_kv = HostKVIndex(host_kv)
        self.ledger = Ledger(self.weight_region_bytes, self.staging_bytes, self.host_kv)
        for name, cost in costs.items():
            self.ledger.add_host_model(name, cost.weight_bytes_per_gpu())
            self.ledger.set_kv_block_bytes(name, bs * cost.kv_bytes_per_token_per_gpu())
        self._staging_ready_at = 0.0

    def _lent_blocks(self, config: SimEngineConfig) -> dict[str, int]:
        """Each model's KV blocks with the staging region lent to its KV cache: the KV region
        and the staging region over its bytes per block. With ``kv_tokens`` the KV region is
        sized, as the live arena's is, for the model with the most KV bytes per token."""
        bs = config.block_size
        if not (config.stable_substrate and self.staging_bytes):
            return dict(self.num_blocks)
        if config.kv_tokens is None:
            return {name: cost.kv_capacity_tokens(self.weight_region_bytes, 0) // bs
                    for name, cost in self.costs.items()}
        per_token = {name: cost.kv_bytes_per_token_per_gpu() for name, cost in self.costs.items()}
        region = config.kv_tokens * max(per_token.values()) + self.staging_bytes
        return {name: region // (bs * nbytes) for name, nbytes in per_token.items()}

    def switch_seconds(self, model: str, staged: bool, outgoing: str | None = None) -> float:
        """Seconds to activate ``model`` (from staging when ``staged``) after ``outgoing``."""
        return switch_seconds(
            self.config.switch, self.costs[model],
            self.costs[outgoing] if outgoing is not None else None,
            staged=staged, sleep_wake=self.sleep_wake,
            scale_up_fixed_s=self.config.scale_up_fixed_s,
        )

    def activate(self, model: str, lend_staging: bool = False) -> MoveRecord:
        """Book ``model``'s weights into the weight region: D2D when it is STAGED, H2D
        otherwise; by sleep and wake (the outgoing model's sleep included) for a sleep/wake
        engine. As the live substrate does (``substrate.instance_memory.InstanceMemory``),
        a staging copy still in flight is waited for when it is of ``model`` itself (then
        D2D) or when ``lend_staging`` (the staging region is lent to ``model``'s KV cache,
        ``lent_blocks``, until the next activation): the wait is part of the activation's
        seconds."""
        nbytes = self.costs[model].weight_bytes_per_gpu()
        outgoing = self.ledger.active_model
        wait = 0.0
        if self.config.switch == "sleep_wake":
            kind = ACTIVATE_WAKE
            seconds = self.switch_seconds(model, staged=False, outgoing=outgoing)
        else:
            if lend_staging or self.ledger.staged_model == model:
                wait = self._finish_staging_in_flight()
            kind = self.ledger.plan_activation(model).kind
            seconds = self.switch_seconds(model, kind == MoveKind.ACTIVATE_D2D, outgoing)
        self.ledger.commit_activation(model, lend_staging)
        record = MoveRecord(kind, nbytes, seconds)
        self.ledger.record(record)  # the copy alone, as the live mover measures it
        return MoveRecord(kind, nbytes, wait + seconds)

    def lend_to_active(self) -> MoveRecord:
        """Lend the staging region to the active model's KV cache (its KV region is
        re-viewed, nothing copied): a staging copy in flight is waited for, as at a lending
        activation; the record's seconds are that wait."""
        model = self.ledger.active_model
        assert model is not None
        wait = self._finish_staging_in_flight()
        self.ledger.commit_activation(model, lend_staging=True)
        return MoveRecord(MoveKind.NONE, 0, wait)

    def _finish_staging_in_flight(self) -> float:
        """Seconds until a staging copy in flight completes (0 without one); it is booked
        complete, as waited for."""
        if self.ledger.staging_state is not StagingState.IN_PROGRESS:
            return 0.0
        assert self.clock is not None  # ``stage`` refuses to start a copy without one
        wait = max(0.0, self._staging_ready_at - self.clock())
        self.ledger.finish_staging(self.ledger.staged_model)
        return wait

    def kv_blocks(self, model: str) -> int:
        """Device KV blocks ``model`` has now (it is the active model)."""
        return (self.lent_blocks if self.ledger.staging_lent else self.num_blocks)[model]

    def stage(self, model: str) -> MoveReport:
        """Start the background copy of ``model`` into the staging region; it is STAGING
        until ``clock()`` reaches the returned seconds from now, then STAGED. Staging the
        model already staged (or being staged) moves nothing and returns the time left."""
        if not self.config.staging:
            raise ValueError(f"cannot stage {model!r}: this engine has no staging region")
        if not self.ledger.can_stage(model):
            raise ValueError(f"cannot stage {model!r}: its shard does not fit the staging "
                             f"region of {self.staging_bytes} bytes")
        if self.clock is None:
            raise RuntimeError(f"cannot stage {model!r}: the engine was built without a clock")
        now = self.clock()
        self.poll_staging()
        plan = self.ledger.plan_staging(model)
        if plan.kind == MoveKind.NONE:
            return MoveReport(MoveKind.NONE, 0, max(0.0, self._staging_ready_at - now))
        seconds = self.costs[model].switch_seconds_host()
        self.ledger.begin_staging(model)
        self.ledger.record(MoveRecord(MoveKind.STAGE, plan.bytes, seconds))
        self._staging_ready_at = now + seconds
        return MoveReport(MoveKind.STAGE, plan.bytes, seconds)

    def share_host_link(self, copy_s: float) -> float:
        """Extra seconds a host-to-device copy of ``copy_s`` (alone) starting now takes
        because a background staging copy uses the same link: while both run, each gets
        half of it, so the copy takes the overlap longer and the staging copy ends that much
        later."""
        if self.clock is None or copy_s <= 0:
            return 0.0
        if self.ledger.staging_state is not StagingState.IN_PROGRESS:
            return 0.0
        overlap = min(copy_s, self._staging_ready_at - self.clock())
        if overlap <= 0:
            return 0.0
        self._staging_ready_at += overlap
        return overlap

    def poll_staging(self) -> None:
        ledger = self.ledger
        if (
            ledger.staged_model is not None
            and ledger.staging_state is StagingState.IN_PROGRESS
            and self.clock is not None
            and self.clock() >= self._staging_ready_at
        ):
            ledger.finish_staging(ledger.staged_model)

    def residency(self, active: str | None) -> dict[str, Residency]:
        if not self.config.stable_substrate:
            return {m: Residency.ACTIVE if m == active else Residency.HOST for m in self.costs}
        self.poll_staging()
        return {m: Residency(self.ledger.placement(m).value) for m in self.costs}
