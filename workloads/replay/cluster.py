"""The in-process cluster of the simulation: simulated engines, instances, one router.

Everything lives on the running event loop (the virtual-time loop in a replay): each instance
is a :class:`~talaria.instance.instance.Instance` over a :class:`~engine.sim.engine.SimEngine` whose
staging clock is the loop's; the router is a :class:`~router.core.RouterCore` over
:class:`~router.instances.inprocess.InProcessClient` adapters (no HTTP), polled for state like the live
router is. Build it inside the loop (:func:`start_cluster`) and stop it when done.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine.sim.config import SimEngineConfig
from engine.sim.engine import SimEngine
from engine.sim.model_spec import DEFAULT_CATALOG, ModelSpec
from router.core import RouterCore
from router.instances.deadlines import Deadlines
from router.instances.health import HealthPoller
from router.instances.inprocess import InProcessClient
from router.sessions.inference import SessionInference
from talaria.instance.instance import Instance
from workloads.replay.systems import SystemConfig

__all__ = ["ClusterSpec", "Cluster", "ClusterTotals", "InstanceTotals", "start_cluster"]


@dataclass(frozen=True)
class ClusterSpec:
    """What hardware the cluster has and what it serves."""

    servers: int = 1
    server: str = "h200x8"
    tp: int = 8
    models: tuple[str, ...] = DEFAULT_CATALOG
    block_size: int = 128  # engine KV block size; the router hashes prefixes at the same size
    max_fused_decode_steps: int = 8
    cut_fused_steps: bool = False  # an arrival ends a fused step (engine.sim.fused)
    poll_interval_s: float = 1.0  # how often the router refreshes every instance's state
    kv_tokens: int | None = None  # every engine's KV capacity per model (None: its layout's)
    # Specs of catalog models that are not bundled (e.g. read from a checkpoint's
    # config.json), found by name; the others are loaded by name.
    model_specs: tuple[ModelSpec, ...] = ()
    # Host KV store of an instance whose system has one (None: what host memory leaves).
    host_kv_bytes: int | None = None
    # The engine's step budget (None: SimEngineConfig's defaults).
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ValueError(f"servers must be >= 1, got {self.servers}")
        if not self.models:
            raise ValueError("the cluster needs at least one model")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {self.poll_interval_s}")
        extra = {m.name for m in self.model_specs} - set(self.models)
        if extra:
            raise ValueError(f"model_specs name models the catalog does not serve: {sorted(extra)}")

    def catalog(self, models: Sequence[str] | None = None) -> dict[str, ModelSpec]:
        """Name -> spec of ``models`` (default: the cluster's catalog)."""
        given = {m.name: m for m in self.model_specs}
        return {name: given.get(name) or ModelSpec.load(name)
                for name in (models if models is not None else self.models)}

    def engine_config(self, system: SystemConfig) -> SimEngineConfig:
        """The simulated engine of one instance of ``system`` on this cluster."""
        overrides: dict[str, int] = {}
        if self.kv_tokens is not None:
            overrides["kv_tokens"] = self.kv_tokens
        if self.host_kv_bytes is not None and system.host_kv:
            overrides["host_kv_bytes"] = self.host_kv_bytes
        for key in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, key) is not None:
                overrides[key] = getattr(self, key)
        return system.engine_config(self.server, self.tp, block_size=self.block_size,
                                    max_fused_decode_steps=self.max_fused_decode_steps,
                                    cut_fused_steps=self.cut_fused_steps, **overrides)


@dataclass(frozen=True)
class InstanceTotals:
    """One instance's engine-side totals after a run."""

    busy_s: float  # modelled engine time
    switches: int  # model activations after its first


@dataclass
class ClusterTotals:
    """Engine-side totals over every instance after a run (``by_instance``: each one's)."""

    switches: int = 0  # model activations, not counting each instance's first load
    activations: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens not prefilled (device prefix cache + host restore)
    restored_tokens: int = 0  # of those, restored from host KV
    busy_s: float = 0.0  # summed modelled engine time
    counters: dict[str, int] = field(default_factory=dict)  # admission-loop counters, summed
    by_instance: dict[str, InstanceTotals] = field(default_factory=dict)


@dataclass
class Cluster:
    system: SystemConfig
    spec: ClusterSpec
    engines: dict[str, SimEngine]
    instances: dict[str, Instance]
    router: RouterCore
    poller: HealthPoller
    _poll_task: asyncio.Task[None] | None = None

    async def stop(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll_task
            self._poll_task = None
        await self.router.close()
        for inst in self.instances.values():
            await inst.stop(drain=False)

    def totals(self) -> ClusterTotals:
        out = ClusterTotals()
        for iid, engine in self.engines.items():
            st = engine.stats()
            activations = int(st.extra.get("num_switches", 0))
            busy = float(st.extra.get("busy_seconds", 0.0))
            out.by_instance[iid] = InstanceTotals(busy, max(0, activations - 1))
            out.activations += activations
            out.switches += max(0, activations - 1)
            out.prefill_tokens += st.prefill_tokens_total
            out.cached_tokens += st.cached_tokens_total
            out.restored_tokens += st.restored_tokens_total
            out.busy_s += busy
            for key, value in self.instances[iid].counters.items():
                out.counters[key] = out.counters.get(key, 0) + value
        return out

    def call_splits(self) -> dict[str, dict[str, float]]:
        """Each finished call's time in its instance, by category (``TimeSplit``)."""
        out: dict[str, dict[str, float]] = {}
        for inst in self.instances.values():
            out.update(inst.loop.split.done)
        return out


def instance_ids(servers: int) -> list[str]:
    return [f"i{k}" for k in range(servers)]


async def start_cluster(
    system: SystemConfig, spec: ClusterSpec | None = None, models: Sequence[str] | None = None,
    answers: Mapping[str, int] | None = None,
) -> Cluster:
    """Build and start ``spec.servers`` instances of ``system`` behind one router, on the
    running loop. ``models`` overrides ``spec.models`` (the catalog every instance serves);
    ``answers``: where each call's answer ends (``SimEngine.answer_lengths``)."""
    spec = spec or ClusterSpec()
    loop = asyncio.get_running_loop()
    catalog = spec.catalog(models)
    engines: dict[str, SimEngine] = {}
    instances: dict[str, Instance] = {}
    config = spec.engine_config(system)
    for iid in instance_ids(spec.servers):
        engine = SimEngine(catalog, config, clock=loop.time, answer_lengths=answers)
        inst = Instance(iid, engine, system.policy, record_splits=True)
        await inst.start()
        engines[iid] = engine
        instances[iid] = inst
    clients = {iid: InProcessClient(iid, inst) for iid, inst in instances.items()}
    router = RouterCore(clients, system.placement, clock=loop.time, block_size=spec.block_size,
                        inference=SessionInference(spec.block_size),
                        deadlines=Deadlines.none_on_calls())
    poller = HealthPoller(router, spec.poll_interval_s)
    await poller.poll_once()
    cluster = Cluster(system, spec, engines, instances, router, poller)
    cluster._poll_task = loop.create_task(poller.run(), name="replay-router-poller")
    return cluster
