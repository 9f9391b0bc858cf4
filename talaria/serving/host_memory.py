"""The host memory that ``talaria serve``'s instances may fill with host KV, checked against
the machine's before any instance starts, by vLLM's rule for its CPU swap space
(``CacheConfig.verify_with_parallel_config``: over 70% of the CPU memory is an error, over
40% a warning). Host KV is a budget filled as sessions' KV is kept, so a budget the machine
cannot hold shows only when the kernel's OOM killer ends an instance, hours in."""

from __future__ import annotations

import os

import structlog

from talaria.serving.config import ConfigError, ServeConfig

__all__ = ["HOST_KV_REFUSED_FRACTION", "HOST_KV_WARNED_FRACTION", "check_host_kv",
           "physical_memory_bytes"]

HOST_KV_REFUSED_FRACTION = 0.7  # vLLM: "Too large swap space"
HOST_KV_WARNED_FRACTION = 0.4  # vLLM: "Possibly too large swap space"
_GIB = 1 << 30

log = structlog.get_logger("talaria.serving.host_memory")


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_kv(config: ServeConfig, machine_bytes: int | None = None) -> None:
    """ConfigError when the instances' host KV (``host_kv_bytes`` is per rank) is over
    ``HOST_KV_REFUSED_FRACTION`` of ``machine_bytes`` (this machine's memory by default); a
    warning over ``HOST_KV_WARNED_FRACTION``."""
    total = machine_bytes if machine_bytes is not None else physical_memory_bytes()
    asked = sum(i.host_kv_bytes * i.tensor_parallel_size for i in config.instances)
    share = asked / total
    what = (f"the instances' host_kv_bytes come to {asked / _GIB:.1f} GiB "
            f"({share:.0%} of this machine's {total / _GIB:.1f} GiB)")
    if share > HOST_KV_REFUSED_FRACTION:
        raise ConfigError(f"{what}: over {HOST_KV_REFUSED_FRACTION:.0%}, the rest of the server "
                          "could not run once they filled; lower [[instances]] host_kv_bytes")
    if share > HOST_KV_WARNED_FRACTION:
        log.warning("serve.host_kv_large", detail=what)
