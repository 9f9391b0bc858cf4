"""What ``talaria serve`` checks before it starts any instance, each of which an instance
would otherwise refuse only once started (seconds to minutes in, and again at every restart)
or, for host memory, never: an ``[engine]`` name no engine takes; a tensor-parallel size a
served model does not split over; host KV budgets the machine cannot hold, by vLLM's rule
for its CPU swap space (``CacheConfig.verify_with_parallel_config``: over 70% of the CPU
memory is an error, over 40% a warning; host KV fills as sessions' KV is kept, so a budget
too large shows only when the kernel's OOM killer ends an instance, hours in)."""

from __future__ import annotations

import os

import structlog

from talaria.serving.config import ConfigError, ServeConfig

__all__ = ["HOST_KV_REFUSED_FRACTION", "HOST_KV_WARNED_FRACTION", "check_engine_names",
           "check_host_kv", "check_tensor_parallel", "physical_memory_bytes"]

HOST_KV_REFUSED_FRACTION = 0.7  # vLLM: "Too large swap space"
HOST_KV_WARNED_FRACTION = 0.4  # vLLM: "Possibly too large swap space"
_GIB = 1 << 30

log = structlog.get_logger("talaria.serving.preflight")


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


def check_engine_names(config: ServeConfig) -> None:
    """ConfigError for an ``[engine]`` name no engine takes (the names are the engine's:
    torch loads here)."""
    from engine.attention.selector import BACKEND_NAMES
    from engine.model_runner import DTYPE_NAMES

    for key, names in (("dtype", DTYPE_NAMES), ("attention_backend", BACKEND_NAMES)):
        value = getattr(config.engine, key)
        if value not in names:
            raise ConfigError(f"[engine].{key} must be one of {list(names)}, got {value!r}")


def check_tensor_parallel(config: ServeConfig) -> None:
    """ConfigError naming the instance and the model when an instance's
    ``tensor_parallel_size`` does not split a model it serves (every instance serves every
    model; ``engine.parallel.sharding.check_shardable``'s rules, on each model's
    config.json, so only after GGUF files are converted)."""
    from transformers import AutoConfig

    from engine.parallel.sharding import check_shardable

    first_with: dict[int, int] = {}  # each size above 1: the first instance that asks it
    for k, instance in enumerate(config.instances):
        if instance.tensor_parallel_size > 1:
            first_with.setdefault(instance.tensor_parallel_size, k)
    if not first_with:
        return
    for name, path in config.model_paths().items():
        hf_config = AutoConfig.from_pretrained(path)
        for size, k in first_with.items():
            try:
                check_shardable(hf_config, size)
            except ValueError as err:
                raise ConfigError(f"[instances][{k}].tensor_parallel_size {size} does not split "
                                  f"model {name!r}: {err}") from err
