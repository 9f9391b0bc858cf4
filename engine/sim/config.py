"""Configuration of the simulated engine (``engine.sim.engine.SimEngine``)."""

from __future__ import annotations

from dataclasses import dataclass

from substrate.devices import server_preset

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

    ``host_kv_bytes``: host KV store capacity per TP rank (every rank keeps its own heads);
    0 disables host KV (offload stores nothing, nothing restores). None: what the server's
    host memory leaves per rank after the catalog's weight shards.
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
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("tp", "block_size", "max_num_batched_tokens", "max_num_seqs",
                     "max_fused_decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimEngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.staging and not self.stable_substrate:
            raise ValueError("staging needs the stable substrate (stable_substrate=True)")
        if self.host_kv_bytes is not None and self.host_kv_bytes < 0:
            raise ValueError(f"host_kv_bytes must be >= 0, got {self.host_kv_bytes}")
        server_preset(self.server)
