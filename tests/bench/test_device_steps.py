"""The device step check's machinery on the CPU (no timing is asserted): the steps run in
the dtype asked for, and each prediction prices its step's work with the server preset and
the checkpoint's shape in that dtype."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.models.tiny import write_random_checkpoint
from engine.sim.cost_model import CostModel
from engine.sim.model_spec import ModelSpec
from substrate.devices import server_preset
from talaria.bench.device_steps import device_cases, run_device_steps
from talaria.bench.timing import clock_for


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("dev") / "tiny-llama", "llama")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_step_is_priced_in_the_dtype_it_ran(llama: Path, dtype: str) -> None:
    cases = device_cases(prefill=((16, 0), (8, 32)), decode=((2, 24),))
    results = run_device_steps(llama, cases, device="cpu", dtype=dtype, repeats=2)
    assert [r.measured.point.label for r in results] == [
        "prefill 16", "prefill 8 after 32", "decode 2 x 24"]
    assert results[1].measured.shape.chunks == ((8, 32),)  # the context came from the cache
    spec = dataclasses.replace(ModelSpec.from_hf_config(llama, "llama-1b-shape"),
                               weight_dtype=dtype, kv_dtype=dtype, activation_dtype=dtype)
    cost = CostModel(server_preset("h200x8"), spec, 1)
    for r in results:
        shape = r.measured.shape
        want = cost.step_cost(list(shape.chunks), shape.decode_seqs, shape.decode_context)
        assert r.predicted_s == want.seconds > 0
        # a CPU step on the calibration's clock (a GPU's on the wall clock)
        assert r.measured.clock == clock_for(torch.get_num_threads()).name
        assert r.measured.samples >= 1
    if dtype == "bfloat16":  # half the bytes: the memory-bound decode is priced lower
        fp32 = dataclasses.replace(spec, weight_dtype="float32", kv_dtype="float32",
                                   activation_dtype="float32")
        shape = results[2].measured.shape
        wider = CostModel(server_preset("h200x8"), fp32, 1).step_cost(
            [], shape.decode_seqs, shape.decode_context)
        assert results[2].predicted_s < wider.seconds
