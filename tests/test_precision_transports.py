"""Low-precision pushes through every weight transport to a real ``miles engine serve --precision`` process on
127.0.0.1: after each push the engine holds, bit for bit, the stored form of the trainer's weights (the engine's own
checksum of its memory, ``GET /weights_checksum``, against the checksum of what the trainer quantized), and it
serves what an in-process engine with those weights serves."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.engine import LocalEngine
from miles.engine.router import Router
from miles.precision.linear import quantize_weights, target_modules
from miles.precision.schemes import BUILTIN_SCHEMES
from miles.rollout.plane import RolloutPlane
from miles.testing import build_tiny_model
from miles.weights.delta import weights_checksum
from miles.weights.delta_transports import shm_transport, tensor_transport
from miles.weights.precision import StoredFormPush
from miles.weights.transports import DiskTransport, DistributedTransport, SharedMemoryTransport, TensorTransport
from test_weight_shm import start_engine

pytest.importorskip("torchao")
pytest.importorskip("compressed_tensors")

PROMPT = [5, 13, 2, 14]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
TRANSPORTS = {
    "tensor": TensorTransport, "shm": SharedMemoryTransport, "disk": DiskTransport, "distributed": DistributedTransport,
    "shm_delta": lambda: shm_transport(delta=True, block_kib=4), "tensor_delta": lambda: tensor_transport(delta=True),
}


class Weights:
    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)

    def export_weights(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save_pretrained(self, path):
        self.model.save_pretrained(path)


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    return [Weights(build_tiny_model(root / f"p{seed}", seed=seed)) for seed in (21, 22)]


@pytest.fixture(scope="module", params=["fp8_block", "int4_w4a16", "nvfp4"])
def scheme_and_server(request, tiny_model_dir, tmp_path_factory):
    scheme = BUILTIN_SCHEMES[request.param]()
    proc, base = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine") / "engine.log",
                              "--precision", request.param)
    yield scheme, base
    proc.terminate()
    proc.wait(timeout=10)


def engine_checksum(base):
    with urllib.request.urlopen(f"{base}/weights_checksum?block_bytes=4096", timeout=60) as response:
        return json.loads(response.read())


def greedy(base):
    body = json.dumps({"input_ids": PROMPT, "return_logprob": True, "sampling_params": GREEDY}).encode()
    request = urllib.request.Request(f"{base}/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    return answer["output_ids"], [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]


def in_process(model_dir, scheme, stored):
    engine = LocalEngine(precision=scheme.spec())
    engine.load_model(str(model_dir))
    engine.update_weights(stored, 1)
    answer = asyncio.run(engine.generate(PROMPT, GREEDY, return_logprob=True))
    engine.close()
    return answer["output_ids"], [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("transport_name", sorted(TRANSPORTS))
def test_every_transport_leaves_the_engine_holding_the_stored_form_bit_for_bit(transport_name, scheme_and_server,
                                                                               policies, tiny_model_dir):
    scheme, base = scheme_and_server
    layers = target_modules(policies[0].model)
    push = StoredFormPush(TRANSPORTS[transport_name](), scheme, layers)
    plane = RolloutPlane(router=Router([base], health_interval_s=3600))
    try:
        for version, policy in enumerate(policies, start=10):
            push.push(policy, plane, version)
            stored = quantize_weights(policy.export_weights(), scheme, layers)
            held = engine_checksum(base)
            assert held["weight_version"] == version
            assert held["checksum"] == weights_checksum(stored, 4096), (transport_name, scheme.name, version)
        ids, logprobs = greedy(base)
        expected_ids, expected = in_process(tiny_model_dir, scheme, stored)
        assert ids == expected_ids and torch.allclose(torch.tensor(logprobs), torch.tensor(expected), atol=1e-6)
        if transport_name != "disk":
            figures = push.metrics()
            assert 0 < figures["weight_sync/stored_bytes"] < figures["weight_sync/bf16_bytes"]
    finally:
        if hasattr(push, "close"):
            push.close()
        plane.close()
