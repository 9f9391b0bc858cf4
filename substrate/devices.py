"""Device and server specifications: the physical numbers the simulator prices work with.

Users: ``engine.sim`` (the cost model sizes KV and prices steps and copies from them). The
live arena is sized from the real device, not from here.

Every constant names its source. Capacities are the datasheet figures in decimal units (the
driver exposes slightly more on both parts; taking the datasheet figure is the conservative
choice). Rates are per GPU and per direction unless a comment says otherwise.

A server can also be a measured one: ``talaria calibrate`` writes this machine (its CPU cores
as the devices) as a JSON file that :func:`resolve_server` loads wherever a preset name is
accepted (``--server path.json``). Its rates are achieved rates, so its ``efficiency``
overrides set the cost model's efficiency factors to 1 and give its measured overheads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

GB = 1_000_000_000
TB = 1_000 * GB

# A device-to-device copy reads and writes every byte, so it can reach at most half the HBM
# bandwidth; 0.8 of that is what a large cudaMemcpyDeviceToDevice achieves (assumption, in line
# with the 75-90% of peak that streaming copy kernels reach on HBM parts).
D2D_COPY_EFFICIENCY = 0.8


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator. All rates are bytes (or FLOPs) per second, per GPU."""

    name: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float  # dense (no 2:4 sparsity)
    nvlink_bytes_per_s: float  # per direction, to the NVSwitch fabric
    host_link_bytes_per_s: float  # pinned host<->device copy, measured (not the PCIe peak)
    d2d_bytes_per_s: float  # device-to-device copy within one GPU's HBM
    # Achieved rates of the attention kernel and the KV moves, where they were measured
    # (a calibrated server); None: the peaks above at the cost model's efficiencies.
    attention_flops: float | None = None  # QK^T and PV FLOPs in the attention kernel
    attention_scores_per_s: float | None = None  # prefill (query, key, head) scores' softmax
    decode_scores_per_s: float | None = None  # the same for decodes (one query per sequence)
    kv_read_bytes_per_s: float | None = None  # attention reading the KV context
    kv_offload_bytes_per_s: float | None = None  # device KV blocks -> host KV store
    kv_restore_bytes_per_s: float | None = None  # host KV store -> device KV blocks
    # A copy on a side stream runs while kernels compute (a GPU's DMA copy engines); a CPU
    # engine's copies take the cores the step computes on, so they add up instead.
    copies_overlap_compute: bool = True

    def __post_init__(self) -> None:
        for field_name in (
            "hbm_bytes",
            "hbm_bytes_per_s",
            "bf16_flops",
            "nvlink_bytes_per_s",
            "host_link_bytes_per_s",
            "d2d_bytes_per_s",
        ):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"DeviceSpec {self.name!r}: {field_name} must be positive")
        for field_name in _MEASURED_RATES:
            value = getattr(self, field_name)
            if value is not None and not value > 0:
                raise ValueError(f"DeviceSpec {self.name!r}: {field_name} must be positive")

    @property
    def kv_offload_rate(self) -> float:
        return self.kv_offload_bytes_per_s or self.host_link_bytes_per_s

    @property
    def kv_restore_rate(self) -> float:
        return self.kv_restore_bytes_per_s or self.host_link_bytes_per_s


_MEASURED_RATES = ("attention_flops", "attention_scores_per_s", "decode_scores_per_s",
                   "kv_read_bytes_per_s", "kv_offload_bytes_per_s", "kv_restore_bytes_per_s")


@dataclass(frozen=True)
class ServerSpec:
    """One server: ``num_devices`` identical GPUs on one NVSwitch plus host memory."""

    name: str
    device: DeviceSpec
    num_devices: int = 8
    host_memory_bytes: int = 2 * TB
    # (field, value) overrides of engine.sim.cost_model.Efficiency (a measured server's).
    efficiency: tuple[tuple[str, float], ...] = field(default=())
    # Each GPU's share of its host-link rate while every GPU copies at once: every host copy
    # the simulator prices (weights, staging, KV offloads and restores) is one of a TP group's
    # ranks moving its shard while the others move theirs. 1.0: the rates above were
    # measured that way already (a calibrated server).
    host_link_share: float = 1.0

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"ServerSpec {self.name!r}: num_devices must be >= 1")
        if self.host_memory_bytes <= 0:
            raise ValueError(f"ServerSpec {self.name!r}: host_memory_bytes must be positive")
        if not 0.0 < self.host_link_share <= 1.0:
            raise ValueError(f"ServerSpec {self.name!r}: host_link_share must be in (0, 1], "
                             f"got {self.host_link_share}")

    @property
    def total_hbm_bytes(self) -> int:
        return self.device.hbm_bytes * self.num_devices


# Pinned-memory host-to-device copy over PCIe Gen5 x16: 64 GB/s per direction is the link peak;
# about 50 GB/s is what cudaMemcpyAsync from pinned memory measures on H100/H200 SXM servers
# (public bandwidthTest / nvbandwidth results; the figure the Talaria issue cites).
PINNED_H2D_BYTES_PER_S = 50 * GB

H200 = DeviceSpec(
    name="H200-SXM",
    hbm_bytes=141 * GB,  # NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e
    hbm_bytes_per_s=4.8 * TB,  # H200 datasheet: 4.8 TB/s
    bf16_flops=989e12,  # H200 SXM datasheet: 1,979 TFLOPS BF16 with sparsity -> 989 dense
    nvlink_bytes_per_s=450 * GB,  # H200 datasheet: NVLink 900 GB/s (both directions) -> 450
    host_link_bytes_per_s=PINNED_H2D_BYTES_PER_S,
    d2d_bytes_per_s=4.8 * TB / 2 * D2D_COPY_EFFICIENCY,
)

H100 = DeviceSpec(
    name="H100-SXM",
    hbm_bytes=80 * GB,  # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3
    hbm_bytes_per_s=3.35 * TB,  # H100 SXM datasheet: 3.35 TB/s
    bf16_flops=989e12,  # H100 SXM datasheet: 1,979 TFLOPS BF16 with sparsity -> 989 dense
    nvlink_bytes_per_s=450 * GB,  # H100 SXM datasheet: NVLink 900 GB/s (both directions)
    host_link_bytes_per_s=PINNED_H2D_BYTES_PER_S,
    d2d_bytes_per_s=3.35 * TB / 2 * D2D_COPY_EFFICIENCY,
)

DEVICES: dict[str, DeviceSpec] = {"h200": H200, "h100": H100}

# Each GPU's share of its host link while all eight copy at once. The one measurement of
# concurrent weight copies the simulator has, vLLM's sleep mode (engine.sim.switching:
# SleepWakeRates), woke four A100s at once at 59 GB per GPU in 5.41 s, 44% of each GPU's
# 25 GB/s link, where one A100 waking alone reached about 85% (same blog): the copies shared
# the host side, 0.44 / 0.85 = 0.51. It agrees with the board: an HGX board's GPUs reach the
# CPUs through PCIe switches whose uplinks two GPUs share, and a public H200 node acceptance
# spec expects nvbandwidth's host_to_all_memcpy_ce (every GPU at once) at 32 GB/s per GPU
# against 64 for host_to_device_memcpy_ce (one GPU), 0.5. The vLLM-derived figure is taken
# so that sleep mode's measured copies price as they were measured (they were concurrent),
# and every other row's host copies pay the same share (none did before: the sleep-mode
# rows alone paid for copying concurrently; docs/benchmark.md, "Host copies priced alike").
# The measurement's numbers (engine.sim.switching.SleepWakeRates prices sleep and wake from
# the same ones): bytes per GPU, wake and sleep seconds (three runs each), the A100's link.
VLLM_SLEEP_BYTES_PER_GPU = 59e9
VLLM_WAKE_S = (5.66 + 5.29 + 5.27) / 3
VLLM_SLEEP_S = (6.01 + 5.78 + 5.89) / 3
A100_HOST_LINK_BYTES_PER_S = 25e9
VLLM_WAKE_ALONE_EFFICIENCY = 0.85  # one A100 waking a 30B model alone, same blog
HOST_LINK_SHARE_ALL_GPUS = (VLLM_SLEEP_BYTES_PER_GPU / VLLM_WAKE_S / A100_HOST_LINK_BYTES_PER_S
                            / VLLM_WAKE_ALONE_EFFICIENCY)

# NVIDIA DGX H200 and DGX H100 datasheets: 8 GPUs on NVSwitch, 2 TB system memory.
SERVERS: dict[str, ServerSpec] = {
    "h200x8": ServerSpec(name="h200x8", device=H200, num_devices=8, host_memory_bytes=2 * TB,
                         host_link_share=HOST_LINK_SHARE_ALL_GPUS),
    "h100x8": ServerSpec(name="h100x8", device=H100, num_devices=8, host_memory_bytes=2 * TB,
                         host_link_share=HOST_LINK_SHARE_ALL_GPUS),
}

DEFAULT_SERVER = "h200x8"


def server_preset(name: str = DEFAULT_SERVER) -> ServerSpec:
    """The named server preset, or the server of a JSON file (a name ending in ``.json``,
    as ``talaria calibrate`` writes); a clear error lists the known names."""
    if name.endswith(".json"):
        return load_server(name)
    try:
        return SERVERS[name]
    except KeyError:
        known = ", ".join(sorted(SERVERS))
        raise ValueError(f"unknown server preset {name!r}; known presets: {known}, or a "
                         "server JSON file (talaria calibrate)") from None


_SERVER_KEYS = {"name", "device", "num_devices", "host_memory_bytes", "efficiency",
                "host_link_share"}


def server_to_dict(server: ServerSpec) -> dict[str, Any]:
    """The JSON form :func:`server_from_dict` reads (``calibration`` may be added beside it:
    how the numbers were measured, kept for people and ignored when loading)."""
    return {
        "name": server.name,
        "device": dataclasses.asdict(server.device),
        "num_devices": server.num_devices,
        "host_memory_bytes": server.host_memory_bytes,
        "efficiency": dict(server.efficiency),
        "host_link_share": server.host_link_share,
    }


def server_from_dict(data: Mapping[str, Any]) -> ServerSpec:
    unknown = sorted(set(data) - _SERVER_KEYS - {"calibration"})
    missing = sorted({"name", "device"} - set(data))
    if unknown or missing:
        raise ValueError(f"server spec: unknown keys {unknown}, missing keys {missing}")
    device_fields = {f.name for f in dataclasses.fields(DeviceSpec)}
    device = dict(data["device"])
    if set(device) - device_fields:
        raise ValueError(f"server spec device: unknown keys {sorted(set(device) - device_fields)}")
    efficiency = data.get("efficiency", {})
    if not isinstance(efficiency, Mapping) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in efficiency.values()
    ):
        raise ValueError(f"server spec efficiency must map names to numbers, got {efficiency!r}")
    try:
        return ServerSpec(
            name=str(data["name"]),
            device=DeviceSpec(**device),
            num_devices=int(data.get("num_devices", 1)),
            host_memory_bytes=int(data.get("host_memory_bytes", TB)),
            efficiency=tuple(sorted((str(k), float(v)) for k, v in efficiency.items())),
            host_link_share=float(data.get("host_link_share", 1.0)),
        )
    except TypeError as exc:
        raise ValueError(f"server spec: {exc}") from None


def load_server(path: str | Path) -> ServerSpec:
    """Read a server spec JSON file; errors name the file."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"server spec file {str(file)!r} does not exist")
    try:
        return server_from_dict(orjson.loads(file.read_bytes()))
    except (ValueError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"{file}: {exc}") from None
