"""The multi-model engine's rank ops at TP=N: every rank switches, stages and moves KV together.

Each rank builds its own ``RankModels`` (``build_rank_models``): its catalog layouts for its
shard, its arena, host weight store (only its slice of every checkpoint, through the weight
loaders) and host KV store (its KV heads). Each model's runner is registered in the rank's
``RankContext.runners`` under the model's name, so a ``TensorParallelRunner`` keyed by that
name runs the model's forward on every rank.

``TensorParallelRankModels`` presents ``RankModels``' methods on rank 0 and runs every op
that changes state (activate, stage, offload, restore, a touching lookup, the staging poll)
on all ranks, in the order the controller calls them; ranks therefore keep identical
ledgers and host-KV eviction orders. A move's record carries rank 0's bytes (each rank moves
its own shard, of the same size when the model divides evenly) and the slowest rank's
seconds. Read-only queries (estimates, totals, usage) answer from rank 0. A model counts as
staged only once every rank's copy is done; a copy that failed on any rank is dropped on every
rank, so the ledgers agree again (the model activates from host everywhere). An op that fails
on any rank breaks the group (see ``engine.parallel.launcher``): later calls raise the group's
RuntimeError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.multi_model.catalog import CatalogEntry, read_catalog
from engine.multi_model.rank import RankModels
from engine.parallel.channel import StepDecoder
from engine.parallel.launcher import WorkerGroup
from engine.parallel.sharding import check_shardable
from engine.parallel.tp_runner import TensorParallelRunner
from engine.parallel.worker import RankContext, call_state_method
from engine.parallel_context import ParallelContext
from substrate.host_kv_index import HostKVIndex
from substrate.ledger import Placement, StagingState
from substrate.moves import MoveRecord, PlannedMove
from substrate.staging import StagingOutcome

STATE_KEY = "multi_model.rank_models"
"""Where each rank keeps its ``RankModels`` in ``RankContext.state``."""


@dataclass(frozen=True)
class RankBuild:
    """What every rank needs to build its ``RankModels`` (sizes are per rank)."""

    models: dict[str, str]
    dtype: str
    block_size: int
    kv_bytes: int | None
    num_kv_blocks: int | None
    host_kv_bytes: int
    staging: bool
    weight_bytes: int | None
    attention_backend: str
    seed: int
    pin: bool | None
    staging_region: str = "largest"


def build_rank_models(
    ctx: RankContext, build: RankBuild, catalog: Mapping[str, CatalogEntry] | None = None
) -> dict[str, tuple[int, int]]:
    """Rank op: build this rank's ``RankModels`` (reading its catalog unless given), keep it
    in ``ctx.state[STATE_KEY]`` and register each model's runner under the model's name.
    Returns each model's KV block counts on this rank (as it is, and with the staging
    region lent): every rank must hand out the same block ids."""
    if catalog is None:
        catalog = read_catalog(
            build.models, build.dtype, build.block_size, ctx.parallel, load_tokenizers=False
        )
    rank = RankModels(
        catalog,
        ctx.device,
        block_size=build.block_size,
        kv_bytes=build.kv_bytes,
        num_kv_blocks=build.num_kv_blocks,
        host_kv_bytes=build.host_kv_bytes,
        staging=build.staging,
        weight_bytes=build.weight_bytes,
        staging_region=build.staging_region,
        attention_backend=build.attention_backend,
        parallel=ctx.parallel,
        seed=build.seed,
        pin=build.pin,
    )
    ctx.state[STATE_KEY] = rank
    for name, runner in rank.runners.items():
        ctx.runners[name] = runner
        ctx.decoders[name] = StepDecoder()
    return {name: (rank.kv_capacity_blocks(name), rank.kv_capacity_blocks(name, True))
            for name in rank.runners}


def combine_records(records: list[MoveRecord | None]) -> MoveRecord | None:
    """One record for a move every rank made: rank 0's kind and bytes (the first rank that
    reported one), the slowest rank's seconds; None when no rank reported one."""
    done = [r for r in records if r is not None]
    if not done:
        return None
    first = done[0]
    return MoveRecord(first.kind, first.bytes, max(r.seconds for r in done))


def combine_placements(per_rank: list[dict[str, Placement]]) -> dict[str, Placement]:
    """Rank 0's placements, except that a model some rank still stages is STAGING."""
    out = dict(per_rank[0])
    for placements in per_rank[1:]:
        for name, placement in placements.items():
            if placement is Placement.STAGING:
                out[name] = Placement.STAGING
    return out


class TensorParallelRankModels:
    """``RankModels``' surface over a tensor-parallel group (this process is rank 0)."""

    def __init__(self, group: WorkerGroup, local: RankModels) -> None:
        self.group = group
        self.local = local
        self.catalog = local.catalog
        self.device = local.device
        self.runners: dict[str, TensorParallelRunner] = {
            name: TensorParallelRunner(group, name, runner, owns_group=False)
            for name, runner in local.runners.items()
        }
        # each rank's staging outcomes not yet combined (a rank may see a copy end later)
        self._outcomes: list[list[StagingOutcome]] = [[] for _ in range(group.world_size)]
        # combined outcomes taken early (by a waited copy's failure), still to be told
        self._told_later: list[StagingOutcome] = []

    @classmethod
    def start(
        cls,
        build: RankBuild,
        world_size: int,
        device: torch.device,
        *,
        address: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 60.0,
        load_tokenizers: bool = True,
    ) -> TensorParallelRankModels:
        """Read rank 0's catalog (a model that cannot be split over ``world_size`` ranks
        fails here with ValueError, before any worker starts), start the workers and build
        every rank's models; the group is stopped again if building fails."""
        catalog = read_catalog(
            build.models,
            build.dtype,
            build.block_size,
            ParallelContext(0, world_size, None),
            load_tokenizers=load_tokenizers,
        )
        for name, entry in catalog.items():
            try:
                check_shardable(entry.hf_config, world_size)
            except ValueError as exc:
                raise ValueError(f"model {name!r}: {exc}") from exc
        group = WorkerGroup.start(
            world_size, device=device, address=address, port=port, timeout_s=timeout_s
        )
        try:
            counts = group.run_on_all_ranks(
                build_rank_models, build, local_kwargs={"catalog": catalog}
            )
            for rank, rank_counts in enumerate(counts):
                if rank_counts != counts[0]:
                    raise ValueError(
                        f"ranks disagree on KV block counts (rank 0: {counts[0]}, rank "
                        f"{rank}: {rank_counts}); give num_kv_blocks to fix them"
                    )
            return cls(group, group.ctx.state[STATE_KEY])
        except BaseException:
            group.shutdown()
            raise

    # ---------------------------------------------------- ops every rank executes
    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.group.run_on_all_ranks(call_state_method, STATE_KEY, method, *args, **kwargs)

    def activate(self, name: str, lend_staging: bool = False) -> MoveRecord:
        return _required(combine_records(self._all("activate", name, lend_staging)), "activate")

    @property
    def staging_lent(self) -> bool:
        return self.local.staging_lent  # every rank lends at the same activation

    @property
    def has_staging_region(self) -> bool:
        return self.local.has_staging_region  # every rank's regions are alike

    def kv_capacity_blocks(self, name: str, lent: bool = False) -> int:
        return self.local.kv_capacity_blocks(name, lent)  # every rank's regions are alike

    def stage(self, name: str, wait: bool) -> tuple[PlannedMove, MoveRecord | None]:
        self.local.memory.ledger.plan_staging(name)  # bad requests fail here, group intact
        plan = self._all("stage", name, False)[0][0]
        if not wait:
            return plan, None
        return plan, self.poll_staging(block=True, raise_failure=True)

    def offload_kv(
        self, name: str, block_hashes: list[int], block_ids: list[int], session_id: str | None
    ) -> MoveRecord:
        record = combine_records(self._all("offload_kv", name, block_hashes, block_ids, session_id))
        return _required(record, "offload_kv")

    def restore_kv(self, name: str, block_hashes: list[int], block_ids: list[int]) -> int:
        return int(self._all("restore_kv", name, block_hashes, block_ids)[0])

    def take_kv_load_records(self, name: str) -> list[MoveRecord]:
        """Every rank settles its loads in the same steps: one record per step, each the
        ranks' records combined."""
        per_rank = self._all("take_kv_load_records", name)
        return [
            _required(combine_records(list(step)), "take_kv_load_records")
            for step in zip(*per_rank, strict=True)
        ]

    def host_kv_index(self) -> HostKVIndex:
        """Rank 0's host KV index (every rank's holds the same blocks)."""
        return self.local.host_kv_index()

    def host_kv_lookup(self, name: str, block_hashes: list[int], touch: bool = False) -> int:
        """Read-only lookups answer from rank 0; a touching one runs on every rank (it
        changes eviction order) and returns the shortest hit."""
        if not touch:
            return self.local.host_kv_lookup(name, block_hashes)
        return min(self._all("host_kv_lookup", name, block_hashes, True))

    def hold_host_kv(self, session_id: str, held: bool) -> None:
        self._all("hold_host_kv", session_id, held)  # eviction order: every rank alike

    def forget_host_kv(self, session_id: str) -> None:
        self._all("forget_host_kv", session_id)  # eviction order: every rank alike

    def can_stage(self, name: str) -> bool:
        return self.local.memory.ledger.can_stage(name)  # every rank's region is alike

    def poll_staging(self, block: bool = False, raise_failure: bool = False) -> MoveRecord | None:
        """The staging record, once, when every rank's copy is done (``block``: wait for
        all). Without ``block`` no rank books its copy before all have finished.

        ``raise_failure`` (the caller waits for the copy it asked for): a copy that failed on
        any rank raises RuntimeError here, after every rank has ended it, with the group
        intact. No rank raises on its own (a rank's op that raises breaks the group), and
        the copy is then as a background copy failed on some rank is
        (``take_staging_outcomes``): dropped on every rank that completed it, and told by
        the raise only, not again as an outcome."""
        if not block and any(self._all("staging_copy_running")):
            return None
        name = self.local.staged_model
        ledger = self.local.memory.ledger  # every rank starts and ends its copies together
        in_flight = ledger.staging_state is StagingState.IN_PROGRESS
        records = self._all("poll_staging", True, False)
        if not raise_failure or not in_flight or all(r is not None for r in records):
            return combine_records(records)
        failed = [rank for rank, r in enumerate(records) if r is None]
        taken = self.take_staging_outcomes()  # pairs this copy's outcomes, drops partial ones
        self._told_later.extend(taken[:-1])  # copies that ended before it: told as usual
        raise RuntimeError(f"staging {name!r} failed on rank(s) {failed}; it stays in host "
                           "memory on every rank")

    def take_staging_outcomes(self) -> list[StagingOutcome]:
        """Each staging copy every rank has seen end, once: every rank stages in the same
        order, so each rank's i-th outcome is the same copy. Its record is the ranks'
        combined; it failed where any rank's failed. The last such copy, when some rank's
        completed, is dropped on every rank (``InstanceMemory.drop_staged``): the ranks that
        staged it would otherwise switch D2D while the others copy from host, and plan no
        copy where the others start one when it is staged again, and each rank's i-th
        outcome would no longer be the same copy. (An earlier copy in the batch was replaced
        in the staging region by a later one already.) Asks the ranks only when rank 0 has
        seen one end or some copy waits for a slower rank."""
        told, self._told_later = self._told_later, []
        if not (self.local.memory.staging_outcomes_pending or self._outcomes[0]):
            return told
        for pending, taken in zip(self._outcomes, self._all("take_staging_outcomes"),
                                  strict=True):
            pending.extend(taken)
        done = min(len(pending) for pending in self._outcomes)
        out = []
        partly_staged = False  # the last copy failed on some rank and completed on another
        for copies in zip(*(pending[:done] for pending in self._outcomes), strict=True):
            records = [c.record for c in copies]
            failed = any(r is None for r in records)
            partly_staged = failed and any(r is not None for r in records)
            out.append(StagingOutcome(copies[0].model,
                                      None if failed else combine_records(records)))
        for pending in self._outcomes:
            del pending[:done]
        if partly_staged:
            self._all("drop_staged", out[-1].model)
        return told + out

    def placements(self) -> dict[str, Placement]:
        """Every rank's placements as the ledgers have them (no rank polls on its own)."""
        return combine_placements(self._all("placements", False))

    # ------------------------------------------------------------------ queries
    @property
    def staged_model(self) -> str | None:
        return self.local.staged_model

    def estimate(self, plan: PlannedMove) -> float | None:
        return self.local.estimate(plan)

    def host_kv_usage(self) -> tuple[int, int]:
        return self.local.host_kv_usage()

    def move_totals(self, kind: str) -> tuple[int, float]:
        return self.local.move_totals(kind)

    @property
    def weight_region(self) -> torch.Tensor:
        return self.local.weight_region

    @property
    def kv_region(self) -> torch.Tensor:
        return self.local.kv_region

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def shutdown(self) -> None:
        """Stop every worker (idempotent); the per-model runners then stop nothing."""
        self.group.shutdown()


def _required(record: MoveRecord | None, op: str) -> MoveRecord:
    if record is None:
        raise RuntimeError(f"tensor-parallel {op} returned no move record on any rank")
    return record
