"""`talaria serve` configuration: TOML in, validated dataclasses out, every error naming its
key; the JSON round trip that instance processes receive; defaults without a file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from talaria.real_model import CATALOG_NAME, packaged_gguf
from talaria.serving.config import ServeConfig, load_serve_config, parse_bytes
from talaria.serving.serve import instance_urls

TOML = """
[router]
port = 9100
policy = "cache_aware"
api_key = "k"

[engine]
block_size = 8
cuda_graphs = false

[models.small]
path = "models/small"
max_model_len = 256

[models.big]
path = "/abs/big"

[[instances]]
id = "g0"
port = 9101
device = "cuda:0"
tensor_parallel_size = 2
kv_bytes = "2GiB"
host_kv_bytes = "512MiB"
staging = false

[[instances]]
id = "g1"
port = 9102
kv_blocks = 64

[policy]
preset = "-reservations"
slot_quantum_s = 5
"""


def test_toml_is_read_validated_and_round_trips(tmp_path: Path) -> None:
    file = tmp_path / "serve.toml"
    file.write_text(TOML)
    config = load_serve_config(file)
    assert config.router.port == 9100 and config.router.policy == "cache_aware"
    assert config.engine.block_size == 8 and config.engine.cuda_graphs is False
    assert config.models["small"].path == str(tmp_path / "models/small")  # relative to the file
    assert config.models["big"].path == "/abs/big"
    assert config.max_model_lens() == {"small": 256}
    g0, g1 = config.instances
    assert (g0.device, g0.tensor_parallel_size, g0.kv_bytes, g0.kv_blocks) == ("cuda:0", 2, 2 << 30, None)
    assert g0.host_kv_bytes == 512 << 20 and g0.staging is False
    assert g1.kv_blocks == 64 and g1.device == "cpu"
    policy = config.policy_config()
    assert (policy.name == "-reservations" and policy.slot_quantum_s == 5
            and not policy.soft_reservations)
    assert instance_urls(config) == {"g0": "http://127.0.0.1:9101", "g1": "http://127.0.0.1:9102"}
    again = tmp_path / "serve.json"
    again.write_bytes(config.to_json())
    assert load_serve_config(again) == config


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"routr": {}}, "unknown key routr"),
        ({"router": {"prot": 1}}, "unknown key [router].prot"),
        ({"router": {"policy": "random"}}, "[router].policy"),
        ({"router": {"port": 70000}}, "[router].port"),
        ({"router": {"port": "80"}}, "[router].port must be an int"),
        ({"router": {"api_key": ""}}, "[router].api_key is empty"),
        ({"router": {"api_key": " k "}}, "[router].api_key has spaces around it"),
        ({"models": {"m": {}}}, "[models.m].path is required"),
        ({"models": {"m": {"path": "x", "max_model_len": 1}}}, "[models.m].max_model_len"),
        ({"instances": [{"port": 1}]}, "[instances][0].id is required"),
        ({"instances": [{"id": "a"}, {"id": "a"}]}, "[instances][1].id 'a' is used by two"),
        ({"instances": [{"id": "a", "port": 5}, {"id": "b", "port": 5}]}, "[instances][1].port 5"),
        ({"router": {"port": 9100}, "instances": [{"id": "a", "port": 9100}]},
         "[instances][0].port 9100 is the router's"),
        ({"instances": [{"id": "a", "device": "tpu"}]}, "[instances][0].device"),
        ({"instances": [{"id": "a", "tensor_parallel_size": 0}]}, "tensor_parallel_size"),
        ({"instances": [{"id": "a", "kv_bytes": "lots"}]}, "[instances][0].kv_bytes"),
        ({"instances": [{"id": "a", "staging": "yes"}]}, "[instances][0].staging must be a bool"),
        ({"engine": {"cuda_graphs": "no"}}, "[engine].cuda_graphs must be a bool"),
        ({"instances": [{"id": "a", "staging_region": "half"}]}, "[instances][0].staging_region"),
        ({"instances": [{"id": "a", "kv_blocks": 0}]}, "[instances][0].kv_blocks must be >= 1"),
        ({"instances": [{"id": "a", "host_kv_bytes": -1}]}, "[instances][0].host_kv_bytes must"),
        ({"instances": {"id": "a"}}, "array of tables"),
        ({"policy": {"preset": "fastest"}}, "unknown policy preset"),
        ({"policy": {"slot_quantum": 3}}, "slot_quantum"),
    ],
)
def test_errors_name_the_key(data: dict, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        ServeConfig.from_dict(data)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"router": {"host": "0.0.0.0", "port": 9100}, "instances": [{"id": "a", "port": 9100}]},
         "[instances][0].port 9100 is the router's"),
        ({"router": {"port": 9100}, "instances": [{"id": "a", "host": "0.0.0.0", "port": 9100}]},
         "[instances][0].port 9100 is the router's"),
        ({"router": {"host": "localhost", "port": 9100}, "instances": [{"id": "a", "port": 9100}]},
         "[instances][0].port 9100 is the router's"),
        ({"instances": [{"id": "a", "host": "0.0.0.0", "port": 5}, {"id": "b", "port": 5}]},
         "[instances][1].port 5 is used by two instances"),
        ({"instances": [{"id": "a", "host": "::", "port": 5}, {"id": "b", "host": "::1", "port": 5}]},
         "[instances][1].port 5 is used by two instances"),
        ({"instances": [{"id": "a", "host": "", "port": 5}, {"id": "b", "host": "::1", "port": 5}]},
         "[instances][1].port 5 is used by two instances"),
    ],
)
def test_a_port_a_wildcard_host_already_takes_is_refused(data: dict, needle: str) -> None:
    """A wildcard host (``0.0.0.0``, ``::``, ``""``) takes its port on every address of its
    family, and ``localhost`` on both loopbacks: a router on ``0.0.0.0:9100`` beside an
    instance on ``127.0.0.1:9100`` was accepted, and `talaria serve` failed to listen only
    once every model had loaded (two instances so: the second one's start failed, after its
    models had loaded)."""
    with pytest.raises(ValueError) as info:
        ServeConfig.from_dict(data)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("a", "b"), [("127.0.0.1", "127.0.0.2"), ("127.0.0.1", "::1"), ("0.0.0.0", "::1"), ("::", "127.0.0.1")]
)
def test_one_port_on_addresses_that_do_not_overlap_is_accepted(a: str, b: str) -> None:
    ServeConfig.from_dict({"instances": [{"id": "a", "host": a, "port": 5},
                                         {"id": "b", "host": b, "port": 5}]})


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize(
    ("section", "key"),
    [("router", "stall_timeout_s"), ("router", "first_token_timeout_s"),
     ("instances", "drain_timeout_s"), ("policy", "slot_quantum_s")],
)
def test_a_number_json_cannot_carry_is_refused_not_lost_on_the_way_to_the_instances(
    section: str, key: str, value: float
) -> None:
    """TOML reads ``inf`` and ``nan``, but the JSON that `talaria serve` hands its instances
    writes them as null, which an instance then refused as its config (it never started):
    the serve config refuses them itself, naming the key."""
    data: dict = ({"instances": [{"id": "a", key: value}]} if section == "instances"
                  else {section: {key: value}})
    with pytest.raises(ValueError, match=rf"{key} must be a finite number"):
        ServeConfig.from_dict(data)


@pytest.mark.parametrize("key", [" " * 20, " instance-key-0123456789", "instance-key-0123456789\t"])
def test_an_instance_key_no_request_can_carry_is_refused(key: str) -> None:
    """Every instance route compares the bearer token as read (stripped) with the key: a
    key with spaces around it (or only spaces) never matches, so every instance answered
    401, `talaria serve` waited its whole start-up timeout for instances it had started
    fine, and a router started alone marked them all down. The config and the instance
    server refuse it, as they do such an ``api_key``."""
    from talaria.serving.instance_server import InstanceServerSettings

    with pytest.raises(ValueError, match=r"\[router\].instance_key (is empty|has spaces)"):
        ServeConfig.from_dict({"router": {"instance_key": key}})
    with pytest.raises(ValueError, match="instance key (is empty|has spaces)"):
        InstanceServerSettings(key=key)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_serve_config(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="is a folder, not a file"):
        load_serve_config(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text("[router\nport = 1")
    with pytest.raises(ValueError, match="cannot be parsed"):
        load_serve_config(bad)


def test_defaults_are_the_tiny_catalog_and_smollm2_on_one_cpu_instance(
    serve_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TALARIA_CACHE", str(serve_cache))
    tiny = {"tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"}
    assert set(load_serve_config(None, real_model=False).models) == tiny
    config = load_serve_config(None)
    real = {CATALOG_NAME} if packaged_gguf() is not None else set()
    assert set(config.models) == tiny | real
    assert all(Path(m.path, "config.json").is_file() for m in config.models.values())
    (inst,) = config.instances
    assert inst.device == "cpu" and inst.port == 0 and inst.kv_blocks
    assert config.router.policy == "talaria" and config.policy_config().name == "talaria"
    with pytest.raises(ValueError, match="port is 0"):
        instance_urls(config)


def test_parse_bytes() -> None:
    assert parse_bytes("1.5GiB", "k") == 3 << 29
    assert parse_bytes("10 MB", "k") == 10_000_000
    assert parse_bytes(4096, "k") == 4096
    for bad in ("10 parsecs", True, 1.5, "-3MiB"):
        with pytest.raises(ValueError, match="k must be a byte count"):
            parse_bytes(bad, "k")


def test_serve_and_the_engine_check_memory_settings_by_one_rule() -> None:
    """The serve config and MultiModelConfig refuse the same memory settings with the same
    words (substrate.ledger.check_memory_settings), each naming its own key."""
    from engine.multi_model.config import MultiModelConfig

    with pytest.raises(ValueError, match=r"^num_kv_blocks must be >= 1, got 0$"):
        MultiModelConfig(num_kv_blocks=0)
    with pytest.raises(ValueError, match=r"^\[instances\]\[0\]\.kv_blocks must be >= 1, got 0$"):
        ServeConfig.from_dict({"instances": [{"id": "a", "kv_blocks": 0}]})
    with pytest.raises(ValueError, match="staging_region must be one of"):
        MultiModelConfig(num_kv_blocks=4, staging_region="half")



def test_the_instance_engine_gets_the_engine_section(tmp_path: Path) -> None:
    """What ``[engine]`` says reaches every model's engine in the instance process."""
    from engine.models.tiny import write_random_checkpoint
    from talaria.serving.instance_main import build_engine

    path = write_random_checkpoint(tmp_path / "tiny-llama", "llama")
    config = ServeConfig.from_dict({"engine": {"cuda_graphs": False, "block_size": 8},
                                    "models": {"m": {"path": str(path)}},
                                    "instances": [{"id": "a", "kv_blocks": 16}]})
    engine = build_engine(config, config.instances[0])
    try:
        assert engine.config.cuda_graphs is False and engine.config.block_size == 8
        assert engine.cores["m"].config.cuda_graphs is False
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("memory", "key"), [({"kv_blocks": 10**12}, "kv_blocks"),
                                             ({"kv_bytes": "100TiB"}, "kv_bytes")])
def test_memory_the_device_cannot_hold_is_one_line_naming_the_instance_and_its_key(
    tmp_path: Path, memory: dict, key: str
) -> None:
    """A KV region no device holds (``kv_blocks = 1000000000000``, ``kv_bytes = "100TiB"``)
    ended the instance process with torch's allocator traceback, naming neither the
    instance nor the setting; ``talaria instance`` prints a ValueError as one line."""
    from engine.models.tiny import write_random_checkpoint
    from talaria.serving.instance_main import build_engine

    path = write_random_checkpoint(tmp_path / "tiny-llama", "llama")
    config = ServeConfig.from_dict({"models": {"m": {"path": str(path)}},
                                    "instances": [{"id": "a", **memory}]})
    with pytest.raises(ValueError, match=rf"instance 'a': the device arena \(.*\) cannot be "
                                         rf"allocated on cpu: .*\[\[instances\]\] {key}"):
        build_engine(config, config.instances[0])


@pytest.mark.parametrize(("key", "value"), [("dtype", "int3"), ("attention_backend", "flash9")])
def test_an_engine_setting_no_engine_takes_is_refused_before_any_instance_starts(
    serve_refusal: Callable[[str, str], str], key: str, value: str,
) -> None:
    """``[engine] dtype = "int3"`` (or an unknown attention backend) was accepted: every
    instance process started, imported the engine and only then failed, with a line naming
    neither ``[engine]`` nor the key."""
    assert f"[engine].{key} must be one of" in serve_refusal(f'[engine]\n{key} = "{value}"\n', "")


def test_the_instances_log_at_the_level_serve_was_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``talaria serve --log-level warning`` quieted the router alone: every instance process
    was started without the flag, so it went on logging at info."""
    from engine.models.tiny import write_random_checkpoint
    from talaria.cli import build_parser, main
    from talaria.serving import serve as serve_module

    commands: list[list[str]] = []

    def spawned(command: list[str], **_kw: object) -> None:
        commands.append(command)
        raise OSError("not started in this test")

    monkeypatch.setattr(serve_module.subprocess, "Popen", spawned)
    path = write_random_checkpoint(tmp_path / "m", "llama")
    file = tmp_path / "serve.toml"
    file.write_text(f'[router]\nport = 0\n[models.m]\npath = "{path}"\n')
    assert main(["serve", "--config", str(file), "--log-level", "warning"]) == 1
    (command,) = commands
    assert build_parser().parse_args(command[command.index("instance"):]).log_level == "warning"


@pytest.mark.parametrize("instances", ["[[instances]]\nid = \"a\"\n", ""])
def test_an_unknown_instance_id_is_refused_before_any_model_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    instances: str,
) -> None:
    """``talaria instance --id`` with an id the config lacks converted SmolLM2's GGUF (about
    5 s, for a config without ``[models]``) before refusing it. The default instance
    (``i0``, without ``[[instances]]``) is known before the models are."""
    from talaria import paths, real_model
    from talaria.cli import main

    def made(*_args: object, **_kw: object) -> None:
        raise AssertionError("a model was made or converted")

    monkeypatch.setattr(real_model, "ensure_real_model", made)
    monkeypatch.setattr(paths, "ensure_tiny_models", made)
    file = tmp_path / "serve.toml"
    file.write_text(instances)
    assert main(["instance", "--config", str(file), "--id", "nope", "--log-level", "error"]) == 2
    known = "a" if instances else "i0"
    assert f"no instance with id 'nope' in the config (ids: {known})" in capsys.readouterr().err


def test_a_tensor_parallel_size_a_model_cannot_split_over_is_refused_before_any_instance_starts(
    serve_refusal: Callable[[str, str], str],
) -> None:
    """An instance's ``tensor_parallel_size`` that a served model's heads do not split over was
    refused only by the started instance, about 10 s in, and by an instance restarted with
    backoff for as long as serve ran."""
    err = serve_refusal("", '[[instances]]\nid = "i0"\ntensor_parallel_size = 3\n')
    assert "[instances][0].tensor_parallel_size 3" in err and "model 'm'" in err
    assert "num_attention_heads" in err


def test_a_host_kv_budget_the_machine_cannot_hold_is_refused_before_any_instance_starts(
    serve_refusal: Callable[[str, str], str],
) -> None:
    """``host_kv_bytes = "100TiB"`` was accepted; host KV fills as it is used, so it showed
    only when the kernel's OOM killer ended an instance."""
    err = serve_refusal("", '[[instances]]\nid = "i0"\nhost_kv_bytes = "100TiB"\n')
    assert "host_kv_bytes come to 102400.0 GiB" in err
