"""Device and server specifications: the physical numbers the simulator prices work with.

Users: ``engine.sim`` (the cost model sizes KV and prices steps and copies from them). The
live arena is sized from the real device, not from here.

Every constant names its source. Capacities are the datasheet figures in decimal units (the
driver exposes slightly more on both parts; taking the datasheet figure is the conservative
choice). Rates are per GPU and per direction unless a comment says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class ServerSpec:
    """One server: ``num_devices`` identical GPUs on one NVSwitch plus host memory."""

    name: str
    device: DeviceSpec
    num_devices: int = 8
    host_memory_bytes: int = 2 * TB

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"ServerSpec {self.name!r}: num_devices must be >= 1")
        if self.host_memory_bytes <= 0:
            raise ValueError(f"ServerSpec {self.name!r}: host_memory_bytes must be positive")

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

# NVIDIA DGX H200 and DGX H100 datasheets: 8 GPUs on NVSwitch, 2 TB system memory.
SERVERS: dict[str, ServerSpec] = {
    "h200x8": ServerSpec(name="h200x8", device=H200, num_devices=8, host_memory_bytes=2 * TB),
    "h100x8": ServerSpec(name="h100x8", device=H100, num_devices=8, host_memory_bytes=2 * TB),
}

DEFAULT_SERVER = "h200x8"


def server_preset(name: str = DEFAULT_SERVER) -> ServerSpec:
    """The named server preset; a clear error lists the known names."""
    try:
        return SERVERS[name]
    except KeyError:
        known = ", ".join(sorted(SERVERS))
        raise ValueError(f"unknown server preset {name!r}; known presets: {known}") from None
