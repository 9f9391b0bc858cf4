"""What a model switch costs each kind of engine (per GPU; every rank moves its own shard).

- ``copy`` (Talaria's substrate): the incoming weights are copied into fixed addresses, from
  the pinned host weight store (H2D at the measured pinned rate) or from the device staging
  region (D2D); nothing is re-allocated or re-captured.
- ``sleep_wake`` (vLLM sleep mode level 1; SGLang's release/resume memory occupation, the
  same cuMem unmap/remap mechanism): the outgoing engine *sleeps* (its weights are copied
  device-to-host into a freshly allocated pinned buffer, its KV is discarded), then the
  incoming one *wakes* (its weights are copied host-to-device into re-mapped memory at the
  same virtual addresses, so CUDA graphs are kept). Both copies run at the efficiency vLLM's
  own measurement shows (``SleepWakeRates``), scaled to this server's host link.
- ``scale_up`` (Aegaeon, SOSP'25): component reuse and a self-managed device buffer make a
  scale-up a chunked, pipelined copy at the link floor (D2D when the next model was
  prefetched into spare device memory) plus a small fixed cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sim.cost_model import CostModel
from substrate.devices import (
    A100_HOST_LINK_BYTES_PER_S,
    VLLM_SLEEP_BYTES_PER_GPU,
    VLLM_SLEEP_S,
    VLLM_WAKE_S,
)

__all__ = ["SWITCH_KINDS", "SleepWakeRates", "AEGAEON_FIXED_S", "switch_seconds"]

SWITCH_KINDS = ("copy", "sleep_wake", "scale_up")

# Aegaeon's fixed cost per scale-up beyond the weight copy: the paper reports "sub-second
# preemptive scaling even when prefetch misses" after removing >80% of the latency by reusing
# the engine, executor and NCCL groups (Alibaba Cloud blog on the SOSP'25 paper); the
# per-stage table was not retrievable, so 0.15 s is an assumption inside "sub-second".
AEGAEON_FIXED_S = 0.15


@dataclass(frozen=True)
class SleepWakeRates:
    """vLLM sleep mode level 1, as measured (vLLM blog "Zero-Reload Model Switching with vLLM
    Sleep Mode", 2025-10-26, raw chart data in plotly-switching-comparison.js and
    plotly-sleep-mode.js): Qwen3-235B-A22B-Instruct-2507-FP8 at TP=4 on A100, vLLM 0.11.0,
    about 59 GB of weights per GPU; wake 5.66 / 5.29 / 5.27 s, sleep 6.01 / 5.78 / 5.89 s.

    The A100's host link is PCIe Gen4 x16, about 25 GB/s achievable (32 GB/s theoretical;
    github.com/ZaidQureshi/bam issue 54). Four GPUs copied at once, so the measured rate per
    GPU (about 11 GB/s) is about 44% of that link for a wake and 40% for a sleep: the
    multi-GPU efficiency, which this server (eight GPUs copying at once) is given on each
    GPU's own host link. It holds both what sleep and wake cost beyond a plain copy and the
    share of the host link each GPU gets while all copy, which every other host copy pays
    through ``ServerSpec.host_link_share`` (``HOST_LINK_SHARE_ALL_GPUS`` is derived from this
    measurement, so the two agree: a wake costs 1 / 0.85 of a plain host copy here).

    ``efficiency`` prices a sensitivity case instead: sleep and wake at that fraction of the
    rate a plain host copy gets on this server (1.0: no dearer than the substrate's copy; a
    single A100 waking a 30B model alone reached about 85% of its link, same blog).
    """

    measured_bytes_per_gpu: float = VLLM_SLEEP_BYTES_PER_GPU
    measured_wake_s: float = VLLM_WAKE_S
    measured_sleep_s: float = VLLM_SLEEP_S
    measured_link_bytes_per_s: float = A100_HOST_LINK_BYTES_PER_S
    efficiency: float | None = None  # None: the measured multi-GPU efficiencies

    def __post_init__(self) -> None:
        if self.efficiency is not None and not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"sleep/wake efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def wake_efficiency(self) -> float:
        if self.efficiency is not None:
            return self.efficiency
        return self.measured_bytes_per_gpu / self.measured_wake_s / self.measured_link_bytes_per_s

    @property
    def sleep_efficiency(self) -> float:
        if self.efficiency is not None:
            return self.efficiency
        return self.measured_bytes_per_gpu / self.measured_sleep_s / self.measured_link_bytes_per_s

    def _link(self, cost: CostModel) -> float:
        """The rate the efficiencies are fractions of: each GPU's own link for the measured
        ones (the measurement holds the share), a plain host copy's rate here for a given one."""
        if self.efficiency is None:
            return cost.device.host_link_bytes_per_s
        return cost.host_link_bytes_per_s

    def wake_seconds(self, cost: CostModel) -> float:
        return cost.weight_bytes_per_gpu() / (self.wake_efficiency * self._link(cost))

    def sleep_seconds(self, cost: CostModel) -> float:
        return cost.weight_bytes_per_gpu() / (self.sleep_efficiency * self._link(cost))


def switch_seconds(
    kind: str,
    incoming: CostModel,
    outgoing: CostModel | None,
    *,
    staged: bool,
    sleep_wake: SleepWakeRates,
    scale_up_fixed_s: float = AEGAEON_FIXED_S,
) -> float:
    """Seconds to make ``incoming`` active after ``outgoing`` (None: nothing was active);
    ``scale_up_fixed_s``: Aegaeon's cost beyond the weight copy (``AEGAEON_FIXED_S``)."""
    if kind == "copy":
        return incoming.switch_seconds_staged() if staged else incoming.switch_seconds_host()
    if kind == "scale_up":
        copy = incoming.switch_seconds_staged() if staged else incoming.switch_seconds_host()
        return copy + scale_up_fixed_s
    if kind == "sleep_wake":
        sleep = sleep_wake.sleep_seconds(outgoing) if outgoing is not None else 0.0
        return sleep + sleep_wake.wake_seconds(incoming)
    raise ValueError(f"unknown switch kind {kind!r}; known: {', '.join(SWITCH_KINDS)}")
