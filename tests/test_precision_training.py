"""Training against low-precision engines: QAT's forward is the INT4 engine's, the mismatch metrics see what the
engine's precision does and QAT removes it, the exported stored form is what the engine served and compressed-tensors
loads it, and a published block-FP8 checkpoint trains as model.path (a missing scale refused naming the tensor)."""

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
from miles.models.hf import load_model
from miles.precision.checkpoint import read_float_weights, write_stored_form
from miles.precision.linear import quantize_weights, target_modules
from miles.precision.schemes import BUILTIN_SCHEMES, Fp8Block, Int4W4A16
from miles.train.torch_backend import TorchBackend
from miles.types import Sample, SampleStatus, TrainBatch

pytest.importorskip("torchao")
pytest.importorskip("compressed_tensors")

QUICKSTART = str(Path(__file__).parent.parent / "configs" / "quickstart.yaml")
FROM_PATH = ["sft.steps=0", "run.steps=2", "rollout.prompts_per_step=4"]
SHORT = ["sft.steps=20", "run.steps=6", "rollout.prompts_per_step=8", "run.eval_size=8"]


def rollouts(model_dir, scheme, prompts):
    engine = LocalEngine(seed=0, precision=scheme.spec())
    engine.load_model(str(model_dir))

    async def generate():
        return await asyncio.gather(*(engine.generate(p, {"max_new_tokens": 10, "temperature": 1.0}) for p in prompts))

    answers = asyncio.run(generate())
    engine.close()
    samples = []
    for prompt, answer in zip(prompts, answers):
        sample = Sample(prompt_ids=list(prompt), status=SampleStatus.COMPLETED, reward=0.0)
        sample.append(answer["output_ids"], [t[0] for t in answer["meta_info"]["output_token_logprobs"]],
                      from_policy=True)
        samples.append(sample)
    return samples


@pytest.mark.parametrize("name", ["int4_w4a16", "fp8_block", "nvfp4"])
def test_the_qat_forward_equals_the_engine_s_within_1e_5(name, tiny_model_dir):
    scheme = BUILTIN_SCHEMES[name]()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 15) for _ in range(rng.randrange(3, 12))] for _ in range(8)]
    samples = rollouts(tiny_model_dir, scheme, prompts)
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    gaps = {}
    for qat in (None, name):
        backend = TorchBackend(qat=qat, micro_batch_size=3)
        backend.setup(str(tiny_model_dir), seed=0)
        with torch.no_grad():
            logprobs = backend.compute_logprobs(batch)
        gaps[qat] = float(((logprobs - batch.rollout_logprobs).abs() * batch.loss_mask).max())
        if qat is not None:  # the master weights stay float: what the state dict and checkpoints hold
            assert all(t.dtype == torch.float32 for t in backend.export_weights().values() if t.is_floating_point())
    assert gaps[name] < 1e-5 < gaps[None]


def test_qat_gets_straight_through_gradients_into_the_float_master_weights(tiny_model_dir):
    backend = TorchBackend(qat="int4_w4a16")
    backend.setup(str(tiny_model_dir), seed=0)
    layer = backend.model.get_submodule("model.layers.0.mlp.down_proj")
    x = torch.randn(3, layer.in_features, requires_grad=True)
    layer(x).sum().backward()
    # d(sum(x W^T))/dW = sum over rows of x, whatever the quantization of W (the straight-through estimator)
    assert torch.allclose(layer.weight.grad, x.detach().sum(0).expand_as(layer.weight), atol=1e-6)
    assert torch.allclose(x.grad, Int4W4A16().fake_quantize(layer.weight).sum(0).expand_as(x), atol=1e-5)


def run(tmp_path, name, *overrides):
    out = tmp_path / name
    assert main(["train", QUICKSTART, f"run.dir={out}", *SHORT, *overrides]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, [r for r in rows if "train/rollout_logprob_abs_diff" in r]


def test_int4_rollout_is_measured_and_qat_cuts_the_mismatch(tmp_path):
    _, plain = run(tmp_path, "int4", "rollout.precision=int4_w4a16")
    out, qat = run(tmp_path, "int4_qat", "rollout.precision=int4_w4a16", "backend.qat=int4_w4a16",
                   "run.export_precision=int4_w4a16", "run.save_every=3")
    gap_plain = sum(r["train/rollout_logprob_abs_diff"] for r in plain) / len(plain)
    gap_qat = sum(r["train/rollout_logprob_abs_diff"] for r in qat) / len(qat)
    assert gap_plain > 5 * gap_qat and gap_plain > 1e-3
    assert sum(r["train/rollout_kl"] for r in plain) > 0
    for row in plain:
        assert 0 < row["weight_sync/stored_bytes"] < 0.7 * row["weight_sync/bf16_bytes"]
    # the export: what the INT4 engine served, tensor for tensor, in a format compressed-tensors reads
    exported = out / "final_model_int4_w4a16"
    final = load_model(out / "final_model")
    layers = target_modules(final)
    expected = quantize_weights(final.state_dict(), Int4W4A16(), layers)
    from safetensors.torch import load_file

    held = load_file(exported / "model.safetensors")
    for key, tensor in expected.items():
        if key in held:
            assert torch.equal(held[key], tensor), key
    assert {f"{layer}.weight_packed" for layer in layers} <= set(held)
    # each checkpoint holds the policy in the stored form too, listed with its files
    checkpoint = out / "checkpoints" / "step_000006"
    assert "model_int4_w4a16/model.safetensors" in json.loads((checkpoint / "state.json").read_text())["files"]
    assert torch.equal(load_file(checkpoint / "model_int4_w4a16" / "model.safetensors")[f"{layers[0]}.weight_packed"],
                       held[f"{layers[0]}.weight_packed"])
    # compressed-tensors (through transformers' loader, decompressing) reads the export as Miles dequantizes it
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    loaded, info = AutoModelForCausalLM.from_pretrained(
        exported, dtype=torch.float32, output_loading_info=True,
        quantization_config=CompressedTensorsConfig(run_compressed=False))
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ours = read_float_weights(exported)
    for layer in layers:
        assert torch.equal(loaded.get_submodule(layer).weight, ours[f"{layer}.weight"]), layer
        served = Int4W4A16().dequantize({s: expected[f"{layer}.{s}"] for s in Int4W4A16.stored})
        assert torch.equal(ours[f"{layer}.weight"], served)


def published_fp8(source: Path, out: Path) -> Path:
    """A block-FP8 checkpoint as DeepSeek-V3 and Qwen3-FP8 publish it: E4M3 ``weight`` and float32
    ``weight_scale_inv`` per 128x128 block, ``quantization_config {quant_method: fp8, weight_block_size}``."""
    shutil.copytree(source, out)
    write_stored_form(out, Fp8Block(), target_modules(load_model(source)))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_published_block_fp8_checkpoint_trains_as_the_model_path(tmp_path, tiny_model_dir):
    model = published_fp8(Path(tiny_model_dir), tmp_path / "fp8")
    weights = read_float_weights(model)
    layer = "model.layers.0.mlp.down_proj.weight"
    plain = load_model(tiny_model_dir).state_dict()[layer]
    assert torch.equal(weights[layer], Fp8Block().fake_quantize(plain)) and not torch.equal(weights[layer], plain)
    from safetensors.torch import load_file

    published = load_file(model / "model.safetensors")  # an FP8 engine quantizes them back to the published codes
    again = Fp8Block().quantize(weights[layer])
    assert torch.equal(again["weight"], published[layer])
    assert torch.equal(again["weight_scale_inv"], published[layer.replace(".weight", ".weight_scale_inv")])
    assert main(["train", QUICKSTART, f"run.dir={tmp_path / 'run'}", f"model.path={model}", *FROM_PATH,
                 "rollout.precision=fp8_block"]) == 0


def test_a_published_checkpoint_with_a_scale_missing_is_refused_naming_the_tensor(tmp_path, tiny_model_dir, capsys):
    from safetensors.torch import load_file, save_file

    model = published_fp8(Path(tiny_model_dir), tmp_path / "fp8")
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight_scale_inv"]
    save_file(tensors, str(model / "model.safetensors"))
    assert main(["train", QUICKSTART, f"run.dir={tmp_path / 'run'}", f"model.path={model}", *FROM_PATH]) == 2
    err = capsys.readouterr().err
    assert "model.layers.1.self_attn.k_proj.weight hold float8 values with no" in err
    assert "model.layers.1.self_attn.k_proj.weight_scale_inv" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "fp8_block"])
def test_low_precision_training_quantizes_every_operand_along_what_it_sums_over(name):
    """Forward: the engine's numerics. Backward: dx = q(dy) q(W) along N, dW = q(dy^T) q(x^T) along the tokens."""
    from miles.precision.training import apply_training_precision, quantize_along_rows

    scheme = BUILTIN_SCHEMES[name]()
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=False)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].proj = layer
    assert apply_training_precision(model, scheme) == ["layers.0.proj"]
    x = torch.randn(2, 7, 64, requires_grad=True)
    y = layer(x)
    rows = x.detach().reshape(14, 64)
    assert torch.equal(y.detach().reshape(14, 96), scheme.activation(rows) @ scheme.fake_quantize(layer.weight).t())
    dy = torch.randn(2, 7, 96)
    y.backward(dy)
    dy_rows = dy.reshape(14, 96)
    expected_dx = quantize_along_rows(scheme, dy_rows) @ quantize_along_rows(scheme, layer.weight.detach().t()).t()
    expected_dw = quantize_along_rows(scheme, dy_rows.t()) @ quantize_along_rows(scheme, rows.t()).t()
    assert torch.equal(x.grad.reshape(14, 64), expected_dx) and torch.equal(layer.weight.grad, expected_dw)
    assert not torch.allclose(layer.weight.grad, dy_rows.t() @ rows, atol=1e-4)  # not the float gradient
    assert layer.weight.dtype == torch.float32  # the master weight


def test_a_weight_only_scheme_cannot_train_in_low_precision_and_qat_goes_alone(tiny_model_dir):
    with pytest.raises(ValueError, match="int4_w4a16 quantizes weights only"):
        TorchBackend(precision="int4_w4a16")
    with pytest.raises(ValueError, match="qat and precision both quantize"):
        TorchBackend(precision="mxfp8", qat="mxfp8")
    with pytest.raises(ValueError, match="precision: expected a precision scheme"):
        TorchBackend(precision="fp6")


def test_unified_fp8_trains_on_what_the_fp8_engine_computes(tmp_path):
    """backend.precision fp8_block with rollout.precision fp8_block: the training forward is the engine's."""
    _, bf16 = run(tmp_path, "bf16_train", "rollout.precision=fp8_block")
    _, unified = run(tmp_path, "fp8_train", "rollout.precision=fp8_block", "backend.precision=fp8_block")
    gap = {k: sum(r["train/rollout_logprob_abs_diff"] for r in rows) / len(rows)
           for k, rows in (("bf16", bf16), ("unified", unified))}
    assert gap["bf16"] > 5 * gap["unified"]


def test_lora_adapters_cannot_be_merged_into_a_quantized_engine(tmp_path, capsys):
    pytest.importorskip("peft")
    assert main(["train", QUICKSTART, f"run.dir={tmp_path / 'run'}", "rollout.precision=fp8_block",
                 "backend.lora.rank=4", "backend.lora.sync=adapters"]) == 2
    assert "set backend.lora.sync: merged" in capsys.readouterr().err and not (tmp_path / "run").exists()
