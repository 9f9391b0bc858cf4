"""Configuration of the simulated engine (``engine.sim.engine.SimEngine``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.sim.kv_tier import kv_tier
from engine.sim.switching import AEGAEON_FIXED_S, SWITCH_KINDS, SleepWakeRates
from substrate.devices import server_preset
from substrate.ledger import STAGING_REGIONS

# Share of the server's host memory the host stores may use (the rest: OS, the engine
# processes, pinned staging buffers). An assumption.
HOST_MEMORY_USABLE_FRACTION = 0.9


@dataclass
class SimEngineConfig:
    """How the simulated instance is built.

    ``block_size`` defaults to 64, coarser than the live engine's 16, to keep the simulator
    fast (a 125k-token prompt is ~2k blocks to hash and reference, not ~8k); prefix reuse is
    then granular to 64 tokens, which is noise next to prompts of 14k-125k tokens.

    ``max_fused_decode_steps``: when a step is decode-only (every running request decodes one
    token, none preempted), up to this many consecutive decode steps run as one engine step,
    stopping early at the step where the first request finishes. Each sub-step is priced
    separately (its context grows by one token per sequence), so the modelled time is exact;
    the trade-off is admission latency: a call arriving meanwhile waits for the fused step to
    end, up to ``max_fused_decode_steps - 1`` decode steps (tens of ms) later than it would
    live. ``StepResult.num_steps`` says how many steps a result covers. 1 disables fusion.
    ``cut_fused_steps``: a call (or abort) reaching the instance meanwhile ends the fused step
    at the first step boundary after it instead (``engine.sim.fused``), so no arrival waits
    for fusion and only the admission loop's own time-driven rules (a slot's age, its
    quantum, starvation) see steps in runs; a request's finishing step then runs alone.
    Off by default: the tuned settings were chosen without it.

    ``host_kv_bytes``: host KV store capacity per TP rank (every rank keeps its own heads);
    0 disables host KV (offload stores nothing, nothing restores). None: what the server's
    host memory leaves per rank after the catalog's weight shards. ``kv_tier`` says how that
    store behaves (``engine.sim.kv_tier``: offloaded on demand, or written through).

    ``switch``: how a switch is priced (``engine.sim.switching``): ``copy`` (the substrate's
    H2D or D2D copy), ``sleep_wake`` (vLLM sleep mode / SGLang memory release: sleep the
    outgoing model, wake the incoming one; ``sleep_wake_efficiency`` None is the measured
    multi-GPU rate; a number, that fraction of a plain host copy's rate), ``scale_up``
    (Aegaeon: the copy plus ``scale_up_fixed_s``, an assumption inside the paper's
    "sub-second"). ``stable_substrate`` False is the memory
    of one plain engine per model: a model's KV region is what its own weights leave.

    ``session_tokens_s``: how long a session's record keeps its last call's tokens after the
    call finished (``engine.sim.kv.SimSessions``; None: as long as the session is
    remembered). They spare its next prompt re-hashing what the two share; results do not
    depend on it, memory does (10 minutes covers the tool gaps of the traces here).

    ``kv_tokens``: the KV capacity every model gets, in tokens, instead of what the memory
    layout leaves (an engine sharing the GPUs with other resident models, or a bound).

    ``staging_region`` (with ``staging``): ``largest`` sizes the staging region for the
    catalog's largest shard, so every model can be staged; ``second`` for the second largest,
    so the largest model always loads from host and the region costs the KV region only what
    the smaller models need (with one model of the catalog as large as the rest together, as
    Qwen3-235B beside GLM-4.5-Air and Mistral Large, that keeps half of its KV room).
    """

    server: str = "h200x8"
    tp: int = 8
    block_size: int = 64
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    stable_substrate: bool = True
    staging: bool = True
    host_kv_bytes: int | None = None
    max_fused_decode_steps: int = 8
    cut_fused_steps: bool = False
    enable_prefix_caching: bool = True
    switch: str = "copy"
    sleep_wake_efficiency: float | None = None
    scale_up_fixed_s: float = AEGAEON_FIXED_S
    kv_tier: str = "offload"
    kv_tokens: int | None = None
    staging_region: str = "largest"
    session_tokens_s: float | None = 600.0

    def __post_init__(self) -> None:
        for name in ("tp", "block_size", "max_num_batched_tokens", "max_num_seqs",
                     "max_fused_decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimEngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.staging_region not in STAGING_REGIONS:
            raise ValueError(f"unknown staging_region {self.staging_region!r}; known: "
                             f"{', '.join(STAGING_REGIONS)}")
        if self.staging and not self.stable_substrate:
            raise ValueError("staging needs the stable substrate (stable_substrate=True)")
        if self.session_tokens_s is not None and not self.session_tokens_s >= 0:
            raise ValueError(f"session_tokens_s must be >= 0, got {self.session_tokens_s}")
        if self.host_kv_bytes is not None and self.host_kv_bytes < 0:
            raise ValueError(f"host_kv_bytes must be >= 0, got {self.host_kv_bytes}")
        if self.switch not in SWITCH_KINDS:
            raise ValueError(f"unknown switch {self.switch!r}; known: {', '.join(SWITCH_KINDS)}")
        if self.switch != "sleep_wake" and not self.stable_substrate:
            raise ValueError(f"a {self.switch!r} switch copies into fixed addresses: it needs "
                             "the stable substrate (or switch='sleep_wake')")
        SleepWakeRates(efficiency=self.sleep_wake_efficiency)
        if not 0 <= self.scale_up_fixed_s < math.inf:  # an endless switch never ends a run
            raise ValueError(f"scale_up_fixed_s must be a finite number >= 0, got "
                             f"{self.scale_up_fixed_s}")
        kv_tier(self.kv_tier)
        if self.kv_tokens is not None and self.kv_tokens < self.block_size:
            raise ValueError(f"kv_tokens must hold at least one block, got {self.kv_tokens}")
        server_preset(self.server)
