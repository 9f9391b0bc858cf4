"""`talaria serve` configuration: router, engine, model catalog, instances and policy, from
one TOML file (or the JSON that ``serve`` hands to its instance processes).

```toml
[router]                # all optional
host = "127.0.0.1"
port = 8000             # 0: a free port
policy = "talaria"      # "talaria" | "load" | "cache_aware"
api_key = "secret"
max_body_bytes = 33554432
instance_key = "..."    # the router<->instance secret; `serve` generates one when unset
first_token_timeout_s = 300.0   # a call's first token, else retry on another instance
stall_timeout_s = 60.0  # between two tokens of a call, else an error event
max_inflight_calls = 1024       # beyond: 429 with Retry-After
infer_sessions = true   # calls naming no session join the one their prompt extends
max_tokens_overflow = "clamp"   # a max_tokens beyond the context's room: clamp to it, or "refuse"
stream_commit_s = 10.0  # a stream without its first token by then sends its 200; -1: not before it
stream_keepalive_s = 15.0       # then a keep-alive event until its first token
session_headers = ["x-session-id", "x-claude-code-session-id"]  # replaces the default list
cors_origins = ["http://localhost:5173"]  # browser origins allowed (CORS; "*": any); none: off

[engine]                # all optional; shared by every instance
block_size = 16
dtype = "auto"
cuda_graphs = true      # on a GPU at TP=1, small decode steps replayed from CUDA graphs

[models.my-model]       # none: the tiny catalog (written on first use) and SmolLM2-135M-Instruct
path = "/models/my-model"   # an HF directory or a .gguf file; relative to this file
max_model_len = 8192
tool_format = "hermes"      # how it writes tool calls (default: found in its chat template)
reasoning_parser = "qwen3"  # its <think> text as reasoning: "qwen3" | "deepseek_r1" | "none"
                            # (default: found in its chat template, else none; router.api.reasoning)
max_tokens_overflow = "refuse"  # this model's rule (default: the router's)

[[instances]]           # none: one instance on the CPU
id = "i0"
port = 0
device = "cpu"          # or "cuda:0"
tensor_parallel_size = 1
kv_blocks = 1024        # blocks per model (default 512); or kv_bytes = "8GiB" (the KV region)
host_kv_bytes = "16GiB" # host memory for KV across switches (default 256 MiB)
staging = true
staging_region = "largest"  # or "second": the largest model loads from host, a smaller region
restart = true          # start it again (with backoff) when its process dies

[policy]
# preset: a rung of the ladder (baseline | +staging | +host_kv | +sp | +priority |
# +priority_switch | talaria) or talaria minus one mechanism (-staging | -host_kv | -sp |
# -reservations | -priority_switch | -lending)
preset = "talaria"
slot_quantum_s = 10.0   # any PolicyConfig field overrides the preset
```

Every validation error names the offending key (``[instances][1].port``...).
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson
import structlog

from substrate.ledger import check_memory_settings
from talaria.policies.config import PolicyConfig
from talaria.protocol.http import key_problem
from talaria.protocol.origins import origins_problem
from talaria.serving.addresses import hosts_overlap
from talaria.serving.router_section import RouterSection

log = structlog.get_logger("talaria.serving.config")

__all__ = [
    "RouterSection",
    "EngineSection",
    "ModelEntry",
    "InstanceEntry",
    "ServeConfig",
    "load_serve_config",
    "parse_bytes",
]

_PLACEMENT_POLICIES = ("talaria", "load", "cache_aware")
_OVERFLOW_RULES = ("clamp", "refuse")  # router.api.output_budget's (serve config stays router-free)
_REASONING_PARSERS = ("deepseek_r1", "none", "qwen3")  # router.api.reasoning's, and "none"
_DEFAULT_KV_BLOCKS = 512
_DEFAULT_HOST_KV_BYTES = 256 << 20


class ConfigError(ValueError):
    """A serve config that cannot be used; the message names the key."""


@dataclass
class EngineSection:
    block_size: int = 16
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    attention_backend: str = "auto"
    seed: int = 0
    cuda_graphs: bool = True  # on a GPU at TP=1: small decode steps replayed from CUDA graphs


@dataclass
class ModelEntry:
    path: str
    max_model_len: int | None = None
    tool_format: str | None = None
    max_tokens_overflow: str | None = None  # None: the router's rule
    reasoning_parser: str | None = None  # None: found in the chat template


@dataclass
class InstanceEntry:
    id: str
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    tensor_parallel_size: int = 1
    kv_blocks: int | None = None
    kv_bytes: int | None = None
    host_kv_bytes: int = _DEFAULT_HOST_KV_BYTES
    staging: bool = True
    staging_region: str = "largest"
    drain_timeout_s: float = 30.0
    restart: bool = True


@dataclass
class ServeConfig:
    router: RouterSection = field(default_factory=RouterSection)
    engine: EngineSection = field(default_factory=EngineSection)
    models: dict[str, ModelEntry] = field(default_factory=dict)
    instances: list[InstanceEntry] = field(default_factory=list)
    policy: dict[str, Any] = field(default_factory=dict)  # PolicyConfig.from_dict input

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig.from_dict(self.policy)

    def instance(self, instance_id: str) -> InstanceEntry:
        for entry in self.instances:
            if entry.id == instance_id:
                return entry
        known = ", ".join(e.id for e in self.instances)
        raise ConfigError(f"no instance with id {instance_id!r} in the config (ids: {known})")

    def convert_gguf_models(self) -> None:
        """Replace every ``.gguf`` model path by its converted directory (converted into the
        cache on first use), so the router and every instance read the same directory."""
        from engine.models.checkpoint_cache import model_dir
        from talaria.paths import cache_dir

        for name, model in self.models.items():
            try:
                model.path = str(model_dir(model.path, cache_dir()))
            except (ValueError, OSError) as exc:
                raise ConfigError(f"[models.{name}].path: {exc}") from exc

    def model_paths(self) -> dict[str, str]:
        return {name: m.path for name, m in self.models.items()}

    def longest_drain_s(self) -> float:
        """How long calls in flight get at shut-down: the longest ``drain_timeout_s``."""
        return max((e.drain_timeout_s for e in self.instances), default=0.0)

    def max_model_lens(self) -> dict[str, int]:
        return {n: m.max_model_len for n, m in self.models.items() if m.max_model_len is not None}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: Path | None = None) -> ServeConfig:
        """Build and validate; ``base_dir`` resolves relative model paths."""
        _check_keys(data, {"router", "engine", "models", "instances", "policy"}, "")
        router = _section(RouterSection, data.get("router", {}), "[router]")
        engine = _section(EngineSection, data.get("engine", {}), "[engine]")
        models = _models(data.get("models", {}), base_dir)
        instances = _instances(data.get("instances", []))
        policy = data.get("policy", {})
        if not isinstance(policy, dict):
            raise ConfigError(f"[policy] must be a table, got {type(policy).__name__}")
        for key, value in policy.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"[policy].{key} must be a finite number, got {value!r}")
        try:
            PolicyConfig.from_dict(policy)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"[policy]: {exc}") from exc
        config = cls(router=router, engine=engine, models=models, instances=instances,
                     policy=dict(policy))
        config._validate()
        return config

    def with_defaults(self, real_model: bool = True) -> ServeConfig:
        """Fill what was left out: one CPU instance and the default catalog, the tiny
        random-weight models beside the real one (SmolLM2-135M-Instruct, converted from its
        package's GGUF file on first use; left out with ``real_model=False``, or with a
        warning when its package is not installed)."""
        self.default_instances()
        if not self.models:
            from talaria.paths import ensure_tiny_models

            self.models = {n: ModelEntry(str(p)) for n, p in ensure_tiny_models().items()}
            if real_model:
                self.models.update(_real_model_entry())
        self._validate()
        return self

    def default_instances(self) -> ServeConfig:
        """The instances' part of ``with_defaults`` (cheap: no model is made or converted)."""
        if not self.instances:
            self.instances = [InstanceEntry(id="i0", kv_blocks=_DEFAULT_KV_BLOCKS)]
        for entry in self.instances:
            if entry.kv_blocks is None and entry.kv_bytes is None:
                entry.kv_blocks = _DEFAULT_KV_BLOCKS
        return self

    def _validate(self) -> None:
        r = self.router
        if r.policy not in _PLACEMENT_POLICIES:
            raise ConfigError(
                f"[router].policy must be one of {list(_PLACEMENT_POLICIES)}, got {r.policy!r}"
            )
        _port(r.port, "[router].port")
        if r.max_body_bytes < 1024:
            raise ConfigError(f"[router].max_body_bytes must be >= 1024, got {r.max_body_bytes}")
        for key in ("poll_interval_s", "first_token_timeout_s", "stall_timeout_s",
                    "body_timeout_s", "stream_keepalive_s"):
            if getattr(r, key) <= 0:
                raise ConfigError(f"[router].{key} must be > 0, got {getattr(r, key)}")
        for key in ("max_inflight_calls", "max_session_id_chars", "max_sessions"):
            if getattr(r, key) < 1:
                raise ConfigError(f"[router].{key} must be >= 1, got {getattr(r, key)}")
        problem = None if r.api_key is None else key_problem(r.api_key)
        if problem is not None:
            raise ConfigError(f"[router].api_key {problem}")
        problem = None if r.instance_key is None else key_problem(r.instance_key)
        if problem is not None:  # each instance compares the token as read, stripped
            raise ConfigError(f"[router].instance_key {problem}")
        if r.instance_key is not None and len(r.instance_key) < 16:
            raise ConfigError("[router].instance_key must be at least 16 characters")
        rules = {"[router].max_tokens_overflow": r.max_tokens_overflow, **{
            f"[models.{n}].max_tokens_overflow": m.max_tokens_overflow
            for n, m in self.models.items() if m.max_tokens_overflow is not None}}
        for key, rule in rules.items():
            if rule not in _OVERFLOW_RULES:
                raise ConfigError(f"{key} must be one of {list(_OVERFLOW_RULES)}, got {rule!r}")
        for name, m in self.models.items():
            if m.reasoning_parser is not None and m.reasoning_parser not in _REASONING_PARSERS:
                raise ConfigError(f"[models.{name}].reasoning_parser must be one of {list(_REASONING_PARSERS)}, "
                                  f"got {m.reasoning_parser!r}")
        headers = r.session_headers
        if headers is not None and (not isinstance(headers, list) or not headers
                                    or not all(isinstance(h, str) and h.strip() for h in headers)):
            raise ConfigError(f"[router].session_headers must be a non-empty list of header names, got {headers!r}")
        if (problem := origins_problem(r.cors_origins)) is not None:
            raise ConfigError(f"[router].cors_origins {problem}")
        e = self.engine
        for key in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(e, key) < 1:
                raise ConfigError(f"[engine].{key} must be >= 1, got {getattr(e, key)}")
        seen: set[str] = set()
        taken: list[tuple[str, int]] = []  # the fixed instance addresses so far
        for i, inst in enumerate(self.instances):
            where = f"[instances][{i}]"
            if not inst.id or not re.fullmatch(r"[A-Za-z0-9_.-]+", inst.id):
                raise ConfigError(f"{where}.id must be letters, digits, '_', '.', '-', got {inst.id!r}")
            if inst.id in seen:
                raise ConfigError(f"{where}.id {inst.id!r} is used by two instances")
            seen.add(inst.id)
            _port(inst.port, f"{where}.port")
            if inst.port and any(p == inst.port and hosts_overlap(h, inst.host) for h, p in taken):
                raise ConfigError(f"{where}.port {inst.port} is used by two instances")
            if inst.port == r.port and inst.port and hosts_overlap(inst.host, r.host):
                # `serve` starts the instances first: the router would fail to listen only
                # once every model had loaded.
                raise ConfigError(f"{where}.port {inst.port} is the router's ([router].port)")
            taken.append((inst.host, inst.port))
            if inst.tensor_parallel_size < 1:
                raise ConfigError(f"{where}.tensor_parallel_size must be >= 1, got {inst.tensor_parallel_size}")
            try:
                check_memory_settings(inst.kv_bytes, inst.kv_blocks, inst.host_kv_bytes,
                                      inst.staging_region, blocks_key="kv_blocks")
            except ValueError as e:
                raise ConfigError(f"{where}.{e}") from None
            if inst.drain_timeout_s < 0:
                raise ConfigError(f"{where}.drain_timeout_s must be >= 0, got {inst.drain_timeout_s}")
            if not (inst.device == "cpu" or re.fullmatch(r"cuda(:\d+)?|auto", inst.device)):
                raise ConfigError(f"{where}.device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {inst.device!r}")


def load_serve_config(
    path: str | Path | None, real_model: bool = True, instance_id: str | None = None
) -> ServeConfig:
    """Read a TOML (or JSON) serve config; None: the defaults. Missing parts get defaults
    (``real_model``: see ``ServeConfig.with_defaults``). ``instance_id``: the config must
    have this instance (ConfigError), checked before any default model is made or converted."""
    if path is None:
        return _with_defaults(ServeConfig(), real_model, instance_id)
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"serve config {str(file)!r} is a folder, not a file")
    if not file.is_file():
        raise FileNotFoundError(f"serve config {str(file)!r} does not exist")
    raw = file.read_bytes()
    try:
        data = orjson.loads(raw) if file.suffix == ".json" else tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, orjson.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"serve config {str(file)!r} cannot be parsed: {exc}") from exc
    return _with_defaults(ServeConfig.from_dict(data, base_dir=file.parent.resolve()), real_model,
                          instance_id)


def _with_defaults(config: ServeConfig, real_model: bool, instance_id: str | None) -> ServeConfig:
    if instance_id is not None:
        config.default_instances().instance(instance_id)
    return config.with_defaults(real_model)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value: Any, key: str) -> int:
    """An integer byte count, or a string such as ``"512MiB"`` / ``"2GB"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(f"{key} must be a byte count (an integer or e.g. \"512MiB\"), got {value!r}")


def _real_model_entry() -> dict[str, ModelEntry]:
    from talaria.real_model import CATALOG_NAME, ensure_real_model, missing_reason

    path = ensure_real_model()
    if path is None:
        log.warning("serve.real_model_missing", reason=missing_reason())
        return {}
    return {CATALOG_NAME: ModelEntry(str(path))}


# parsing helpers --------------------------------------------------------------------------

_BYTE_KEYS = {"kv_bytes", "host_kv_bytes", "max_body_bytes"}


def _check_keys(data: Any, allowed: set[str], where: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'the config'} must be a table, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]}; allowed: {', '.join(sorted(allowed))}"
        )


def _section(cls: type, data: Any, where: str) -> Any:
    specs = {f.name: f for f in fields(cls)}
    _check_keys(data, set(specs), where)
    values: dict[str, Any] = {}
    for key, value in data.items():
        values[key] = _typed(value, str(specs[key].type), f"{where}.{key}", key in _BYTE_KEYS)
    required = [n for n, f in specs.items() if f.default is MISSING and f.default_factory is MISSING]
    for name in required:
        if name not in values:
            raise ConfigError(f"{where}.{name} is required")
    return cls(**values)


def _typed(value: Any, annotation: str, key: str, is_bytes: bool) -> Any:
    optional = annotation.endswith("| None")
    base = annotation.replace("| None", "").strip()
    if value is None and optional:
        return None
    if is_bytes:
        return parse_bytes(value, key)
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
    }.get(base, True)
    if not ok:
        raise ConfigError(f"{key} must be {'an' if base == 'int' else 'a'} {base}, got {value!r}")
    if base == "float" and not math.isfinite(value):
        # JSON (the config `serve` hands its instances) cannot carry inf or nan: orjson
        # writes null, which the instance would refuse.
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    return float(value) if base == "float" else value


def _models(data: Any, base_dir: Path | None) -> dict[str, ModelEntry]:
    if not isinstance(data, dict):
        raise ConfigError(f"[models] must be a table of models, got {type(data).__name__}")
    out: dict[str, ModelEntry] = {}
    for name, entry in data.items():
        if isinstance(entry, str):
            entry = {"path": entry}
        model = _section(ModelEntry, entry, f"[models.{name}]")
        path = Path(model.path).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        model.path = str(path)
        if model.max_model_len is not None and model.max_model_len < 2:
            raise ConfigError(f"[models.{name}].max_model_len must be >= 2, got {model.max_model_len}")
        out[str(name)] = model
    return out


def _instances(data: Any) -> list[InstanceEntry]:
    if not isinstance(data, list):
        raise ConfigError(f"instances must be an array of tables ([[instances]]), got {type(data).__name__}")
    return [_section(InstanceEntry, item, f"[instances][{i}]") for i, item in enumerate(data)]


def _port(value: int, key: str) -> None:
    if not 0 <= value <= 65535:
        raise ConfigError(f"{key} must be in [0, 65535] (0: a free port), got {value}")
