"""The instance's internal API trusts nothing: every route needs the key (401 otherwise), and
a type-fuzz of the call body (every field replaced by arbitrary JSON, unknown fields, fields
missing) only ever gets 200 or a 4xx JSON error, never a failure inside the instance, whose
admission loop keeps serving. On the real engine, ``"seed": "x"`` (which killed the loop) is
a 400."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.models.tiny import make_tiny_models
from engine.multi_model.engine import MultiModelConfig, MultiModelEngine
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.protocol import CallRequest, SamplingParams
from talaria.serving.instance_server import (
    InstanceServerSettings,
    create_instance_app,
    engine_limits,
)

KEY = "fuzz-instance-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD: dict[str, Any] = {
    "call_id": "c", "session_id": "s", "model": "tiny-llama",
    "prompt_token_ids": [5, 6, 7], "params": {"max_tokens": 2, "temperature": 0.0},
    "expected_gap_s": None, "last_call": False,
}
CALL_FIELDS = [f.name for f in fields(CallRequest)] + ["unknown_field"]
PARAM_FIELDS = [f.name for f in fields(SamplingParams)] + ["beam_width"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def mutated_calls(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["field", "param", "drop", "whole"]))
    body = orjson.loads(orjson.dumps(GOOD))
    body["call_id"] = f"c{draw(st.integers(0, 10**9))}"
    if kind == "field":
        body[draw(st.sampled_from(CALL_FIELDS))] = draw(json_values)
    elif kind == "param":
        body["params"][draw(st.sampled_from(PARAM_FIELDS))] = draw(json_values)
    elif kind == "drop":
        body.pop(draw(st.sampled_from(CALL_FIELDS[:-1])), None)
    else:
        body = draw(json_values)
    return body


class Served:
    """One instance (real engine, two tiny models) served on its own event loop."""

    def __init__(self, models: dict[str, Path]) -> None:
        self.loop = asyncio.new_event_loop()
        engine = MultiModelEngine(
            {k: models[k] for k in ("tiny-llama", "tiny-qwen3")},
            MultiModelConfig(device="cpu", block_size=4, num_kv_blocks=64, host_kv_bytes=1 << 20,
                             initial_model="tiny-llama"),
        )
        self.instance = Instance("fuzz", engine, PolicyConfig(slot_quantum_s=0.5))
        limits = {name: lim for name, lim in engine_limits(engine, {"tiny-llama": 64, "tiny-qwen3": 64}).items()}
        app = create_instance_app(self.instance, InstanceServerSettings(limits=limits, key=KEY))
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self.runner.cleanup())
        self.loop.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = Served(make_tiny_models(tmp_path_factory.mktemp("guard-models")))
    try:
        yield server
    finally:
        server.close()


async def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, list[Any]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/internal/v1/calls", data=body, headers=headers) as r:
            raw = await r.read()
            if r.status != 200:
                return r.status, [orjson.loads(raw)]
            return r.status, [orjson.loads(line) for line in raw.splitlines() if line]


def test_every_route_needs_the_key(served: Served) -> None:
    async def main() -> list[int]:
        statuses = []
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": KEY}):
                for method, path in (("GET", "/internal/v1/state"), ("GET", "/health"),
                                     ("POST", "/internal/v1/calls/x/abort"),
                                     ("POST", "/internal/v1/calls")):
                    async with http.request(method, served.url + path, headers=headers,
                                            data=orjson.dumps(GOOD)) as r:
                        statuses.append(r.status)
                        assert (await r.json())["error"]["code"] == "invalid_api_key"
            async with http.get(served.url + "/internal/v1/state", headers=AUTH) as r:
                statuses.append(r.status)
        return statuses

    assert served.run(main()) == [401] * 12 + [200]


def test_a_string_seed_is_a_400_and_the_loop_keeps_serving(served: Served) -> None:
    bad = {**GOOD, "call_id": "bad-seed", "params": {"max_tokens": 2, "seed": "x"}}
    status, body = served.run(post(served.url, orjson.dumps(bad), AUTH))
    assert status == 400 and "seed" in body[0]["error"]["message"]
    status, events = served.run(post(served.url, orjson.dumps({**GOOD, "call_id": "after"}), AUTH))
    assert status == 200 and events[-1]["finish_reason"] == "length"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=mutated_calls())
def test_type_fuzz_of_the_call_body_never_breaks_the_instance(served: Served, body: Any) -> None:
    status, out = served.run(post(served.url, json.dumps(body).encode(), AUTH))
    assert status in (200, 400, 404), (status, body, out)
    if status == 200:
        assert out[-1]["finished"] and [e["finished"] for e in out].count(True) == 1
        assert out[-1]["finish_reason"] in ("length", "stop"), out[-1]
    else:
        assert out[0]["error"]["message"]
    assert served.instance.healthy and served.instance.counters["engine_faults"] == 0
