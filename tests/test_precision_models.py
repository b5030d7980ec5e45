"""The schemes on the models Miles builds: Qwen3-MoE (each expert's matrix quantized, the router kept, R3 unchanged)
and Qwen2.5-VL (its language model quantized, the vision tower kept). The engine holds the stored form, a push of it
is what the engine holds, and QAT's forward equals the engine's."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from miles.cli import main
from miles.engine.local import LocalEngine
from miles.models.hf import load_model, load_tokenizer
from miles.precision.experts import QuantizedExperts
from miles.precision.linear import dequantize_weights, quantize_weights, target_modules
from miles.precision.schemes import BUILTIN_SCHEMES, Fp8Block
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


def published_fp8_moe(source: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Qwen3-MoE checkpoint in the layout Qwen3-30B-A3B-FP8 is published in: each expert's ``gate_proj``,
    ``up_proj`` and ``down_proj`` a layer of its own (``mlp.experts.<e>.gate_proj.weight``), every decoder linear
    in E4M3 with a ``weight_scale_inv`` per 128x128 block, the router and the embeddings in high precision. Also
    the float weights it holds, in the same per-expert layout (each quantized layer dequantized)."""
    from safetensors.torch import save_file

    shutil.copytree(source, out)
    model = load_model(source)
    per_expert: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        if prefix.endswith(".experts") and leaf == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                per_expert[f"{prefix}.{e}.gate_proj.weight"] = gate[e].contiguous()
                per_expert[f"{prefix}.{e}.up_proj.weight"] = up[e].contiguous()
        elif prefix.endswith(".experts") and leaf == "down_proj":
            for e in range(tensor.shape[0]):
                per_expert[f"{prefix}.{e}.down_proj.weight"] = tensor[e].contiguous()
        elif key != "lm_head.weight" or not model.config.tie_word_embeddings:
            per_expert[key] = tensor.contiguous()
    dense = [name for name in target_modules(model) if not name.endswith(("gate_up_proj", "down_proj"))
             or not name.rpartition(".")[0].endswith(".experts")]
    layers = dense + [k.removesuffix(".weight") for k in per_expert if ".experts." in k]
    stored = quantize_weights(per_expert, Fp8Block(), layers)
    (out / "model.safetensors").unlink()
    save_file(stored, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128],
                                     "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}
    (out / "config.json").write_text(json.dumps(config))
    return out, dequantize_weights(stored, Fp8Block(), layers)


def test_a_published_per_expert_fp8_moe_checkpoint_loads_as_transformers_fuses_it_and_trains(tmp_path, moe_dir):
    """What a float checkpoint in the per-expert layout becomes in transformers (its own conversion fuses the
    experts into ``gate_up_proj`` and ``down_proj``) is what Miles makes of the FP8 one: the same tensors, bit for
    bit; then it trains as model.path with FP8 rollout."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    fp8, floats = published_fp8_moe(Path(moe_dir), tmp_path / "fp8")
    assert any(".experts.1.up_proj.weight" in k for k in floats)
    reference = tmp_path / "float"
    shutil.copytree(moe_dir, reference)
    save_file(floats, str(reference / "model.safetensors"))
    expected = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).state_dict()
    ours = load_model(fp8).state_dict()
    assert sorted(ours) == sorted(expected)
    assert all(torch.equal(ours[k], expected[k]) for k in expected), [k for k in expected
                                                                      if not torch.equal(ours[k], expected[k])]
    plain = load_model(moe_dir).state_dict()[f"{EXPERTS}.gate_up_proj"]
    assert not torch.equal(ours[f"{EXPERTS}.gate_up_proj"], plain)  # the experts were quantized, and read back
    assert main(["train", "configs/quickstart.yaml", f"run.dir={tmp_path / 'run'}", f"model.path={fp8}",
                 "sft.steps=0", "run.steps=2", "rollout.prompts_per_step=4", "run.eval_size=4",
                 "rollout.precision=fp8_block"]) == 0


@pytest.mark.parametrize("gone", ["one layer", "the last expert"])
def test_a_per_expert_checkpoint_with_an_expert_missing_is_refused_naming_it(gone, tmp_path, moe_dir, capsys):
    from safetensors.torch import load_file, save_file

    fp8, _ = published_fp8_moe(Path(moe_dir), tmp_path / "fp8")
    tensors = load_file(fp8 / "model.safetensors")
    last = max(int(k.split(".")[5]) for k in tensors if k.startswith(f"{EXPERTS}."))
    layers = [f"{EXPERTS}.1.up_proj"] if gone == "one layer" else [f"{EXPERTS}.{last}.{part}" for part in
                                                                     ("gate_proj", "up_proj", "down_proj")]
    for layer in layers:
        del tensors[f"{layer}.weight"], tensors[f"{layer}.weight_scale_inv"]
    save_file(tensors, str(fp8 / "model.safetensors"))
    assert main(["train", "configs/quickstart.yaml", f"run.dir={tmp_path / 'run'}", f"model.path={fp8}",
                 "sft.steps=0", "run.steps=1"]) == 2
    err = capsys.readouterr().err
    if gone == "one layer":  # seen from the names alone, before the run directory is made
        assert f"{layers[0]}.weight missing" in err and "has gate_proj, up_proj, down_proj for every expert" in err
        assert not (tmp_path / "run").exists()
    else:  # seen against the model's number of experts
        assert f"{EXPERTS}: the checkpoint holds {last} experts one layer each, the model has {last + 1}" in err, err
