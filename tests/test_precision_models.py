"""The schemes on the models Miles builds: Qwen3-MoE (each expert's matrix quantized, the router kept, R3 unchanged)
and Qwen2.5-VL (its language model quantized, the vision tower kept). The engine holds the stored form, a push of it
is what the engine holds, and QAT's forward equals the engine's."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from miles.cli import main
from miles.engine.local import LocalEngine
from miles.models.hf import load_model, load_tokenizer
from miles.precision.experts import QuantizedExperts
from miles.precision.linear import dequantize_weights, quantize_weights, target_modules
from miles.precision.schemes import BUILTIN_SCHEMES
from miles.rollout.context import RolloutContext
from miles.rollout.single_turn import single_turn
from miles.testing import build_tiny_model, build_vlm
from miles.train.torch_backend import TorchBackend
from miles.types import Sample, TrainBatch

pytest.importorskip("torchao")
pytest.importorskip("compressed_tensors")

EXPERTS = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "model", arch="qwen3_moe")


def generate(engine, prompts, **extra):
    async def go():
        return await asyncio.gather(*(engine.generate(p, {"max_new_tokens": 8, "temperature": 1.0}, **extra)
                                      for p in prompts))

    return asyncio.run(go())


@pytest.mark.parametrize("name", ["fp8_block", "int4_w4a16", "mxfp8"])
def test_moe_experts_are_held_in_the_stored_form_and_qat_computes_as_the_engine(name, moe_dir):
    scheme = BUILTIN_SCHEMES[name]()
    model = load_model(moe_dir)
    names = target_modules(model)
    assert f"{EXPERTS}.gate_up_proj" in names and f"{EXPERTS}.down_proj" in names
    assert not any(n.endswith("mlp.gate") for n in names)  # the router stays in high precision
    engine = LocalEngine(seed=0, precision=scheme.spec())
    engine.load_model(str(moe_dir))
    try:
        assert isinstance(engine.model.get_submodule(EXPERTS), QuantizedExperts)
        held = engine.model.state_dict()
        pushed = quantize_weights({k: v + 0.01 for k, v in model.state_dict().items()}, scheme, names)
        assert set(held) == set(pushed)
        engine.update_weights(pushed, weight_version=1)
        assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in pushed.items())
        back = dequantize_weights(pushed, scheme, names)[f"{EXPERTS}.gate_up_proj"]
        experts = model.get_submodule(EXPERTS).gate_up_proj.detach() + 0.01
        assert back.shape == experts.shape and torch.equal(back[3], scheme.fake_quantize(experts[3]))
        engine.update_weights(quantize_weights(model.state_dict(), scheme, names), weight_version=2)
        rng = random.Random(0)
        ctx = RolloutContext(engine, load_tokenizer(moe_dir), {"temperature": 1.0, "max_new_tokens": 8},
                             return_routed_experts=True)

        async def all_of():
            samples = [Sample(prompt_ids=[rng.randrange(3, 15) for _ in range(rng.randrange(3, 10))], index=i)
                       for i in range(6)]
            return await asyncio.gather(*(single_turn(sample, ctx) for sample in samples))

        samples = asyncio.run(all_of())
    finally:
        engine.close()
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    assert batch.routed_experts is not None
    gaps = {}
    for qat in (None, name):
        backend = TorchBackend(qat=qat, routing_replay=True)
        backend.setup(str(moe_dir), seed=0)
        with torch.no_grad():
            logprobs = backend.compute_logprobs(batch)
        gaps[qat] = float(((logprobs - batch.rollout_logprobs).abs() * batch.loss_mask).max())
    assert gaps[name] < 1e-5 < gaps[None]


def test_the_vlm_s_language_model_is_quantized_and_its_vision_tower_kept(tmp_path):
    model_dir = build_vlm(tmp_path / "vlm")
    scheme = BUILTIN_SCHEMES["int4_w4a16"]()
    engine = LocalEngine(seed=0, precision=scheme.spec())
    engine.load_model(str(model_dir))
    try:
        names = engine.quantized_layers
        assert names and all(".language_model.layers." in n for n in names)
        assert not any("visual" in n for n in names) and "lm_head" not in names
        assert target_modules(load_model(model_dir)) == names
        [answer] = generate(engine, [[40, 41, 42, 43]])
        assert len(answer["output_ids"]) == 8
    finally:
        engine.close()


def test_moe_trains_with_fp8_rollout_and_r3(tmp_path, capsys):
    assert main(["train", "configs/quickstart.yaml", f"run.dir={tmp_path / 'run'}", "model.build.arch=qwen3_moe",
                 "sft.steps=5", "run.steps=2", "rollout.prompts_per_step=4", "run.eval_size=4",
                 "rollout.precision=fp8_block", "rollout.return_routed_experts=true",
                 "backend.routing_replay=true"]) == 0
