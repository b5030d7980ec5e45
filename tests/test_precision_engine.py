"""The engine in a precision scheme (``rollout.precision``): it holds each decoder linear layer's stored form, computes
as the scheme says, takes pushes of the stored form whole or not at all, and refuses a model whose shapes the scheme
cannot take, naming the layer."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.engine.local import LocalEngine
from miles.precision import linear
from miles.precision.schemes import BUILTIN_SCHEMES, Fp8Block, Int4W4A16
from miles.testing.fixtures import build_tiny_model
from test_engine import reference_logprobs

pytest.importorskip("torchao")
pytest.importorskip("compressed_tensors")

PROMPTS = [[4, 13, 5, 14], [9, 13, 9, 14, 1, 3], [2, 13]]
LAYER = "model.layers.0.mlp.down_proj"


def generate_many(engine, prompts, params):
    async def go():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    return asyncio.run(go())


def emulated_logprobs(model_dir, scheme, prompt, output_ids):
    """A plain transformers forward in float32 with each decoder linear layer's weight replaced by its dequantized
    stored form and its input quantized and dequantized as the scheme says (hooks, not the engine's layer)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name in linear.target_modules(model):
        module = model.get_submodule(name)
        module.weight.data = scheme.dequantize(scheme.quantize(module.weight.data))
        module.register_forward_pre_hook(lambda _, args: (scheme.activation(args[0]),))
    ids = torch.tensor([prompt + output_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logprobs[len(prompt) - 1:].gather(1, ids[0, len(prompt):, None]).squeeze(1)


@pytest.mark.parametrize("name", sorted(BUILTIN_SCHEMES))
def test_the_engine_s_logprobs_are_a_float_forward_on_the_dequantized_weights_with_quantized_inputs(name,
                                                                                                   tiny_model_dir):
    scheme = BUILTIN_SCHEMES[name]()
    engine = LocalEngine(seed=1, precision=scheme.spec())
    engine.load_model(str(tiny_model_dir))
    try:
        held = engine.model.state_dict()
        assert f"{LAYER}.weight" not in held or name != "int4_w4a16"
        assert {f"{LAYER}.{s}" for s in scheme.stored} <= set(held)
        assert "lm_head.weight" in held and held["lm_head.weight"].dtype == torch.float32
        assert engine.quantized_layers == linear.target_modules(engine.model) and len(engine.quantized_layers) == 14
        answers = generate_many(engine, PROMPTS, {"max_new_tokens": 5, "ignore_eos": True, "temperature": 1.0})
        plain = []
        for prompt, answer in zip(PROMPTS, answers):
            got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
            expected = emulated_logprobs(tiny_model_dir, scheme, prompt, answer["output_ids"])
            assert torch.allclose(got, expected, atol=1e-5), (name, got, expected)
            plain.append(torch.allclose(got, reference_logprobs(tiny_model_dir, prompt, answer["output_ids"]),
                                        atol=1e-4))
        assert not all(plain)  # the scheme changes what the engine computes
    finally:
        engine.close()


@pytest.mark.parametrize("name", sorted(BUILTIN_SCHEMES))
def test_a_push_of_the_stored_form_is_what_the_engine_holds_and_computes_with(name, tiny_model_dir):
    scheme = BUILTIN_SCHEMES[name]()
    engine = LocalEngine(seed=1, precision=scheme.spec())
    engine.load_model(str(tiny_model_dir))
    try:
        trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        weights = {k: v + 0.01 for k, v in trainer.state_dict().items()}
        pushed = linear.quantize_weights(weights, scheme, linear.target_modules(trainer))
        assert engine.update_weights(pushed, weight_version=4) == 4
        held = engine.model.state_dict()
        assert set(held) == set(pushed)
        for key, tensor in pushed.items():
            assert held[key].dtype == tensor.dtype and torch.equal(held[key], tensor), key
        layer = engine.model.get_submodule(LAYER)
        assert torch.equal(layer.dequantized(), scheme.dequantize({s: pushed[f"{LAYER}.{s}"] for s in scheme.stored}))
    finally:
        engine.close()


def test_a_push_of_float_weights_into_a_stored_form_is_refused_whole_naming_the_tensors(tiny_model_dir):
    engine = LocalEngine(seed=1, precision=Fp8Block().spec())
    engine.load_model(str(tiny_model_dir))
    try:
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        weights = linear.quantize_weights(trainer.state_dict(), Fp8Block(), linear.target_modules(trainer))
        weights[f"{LAYER}.weight"] = weights[f"{LAYER}.weight"].float()  # values, not their fp8 codes
        with pytest.raises(ValueError, match=rf"wrong dtype .*{LAYER}.weight \(got float32, expected float8_e4m3fn\)"):
            engine.update_weights(weights, weight_version=1)
        weights = linear.quantize_weights(trainer.state_dict(), Fp8Block(), linear.target_modules(trainer))
        del weights[f"{LAYER}.weight_scale_inv"]
        with pytest.raises(ValueError, match=rf"1 missing: {LAYER}.weight_scale_inv"):
            engine.update_weights(weights, weight_version=1)
        weights = linear.quantize_weights(trainer.state_dict(), Fp8Block(), linear.target_modules(trainer))
        weights[f"{LAYER}.weight_scale_inv"][0, 0] = float("inf")
        with pytest.raises(ValueError, match="NaN or inf"):
            engine.update_weights(weights, weight_version=1)
        after = engine.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before) and engine.weight_version == 0
    finally:
        engine.close()


def test_a_model_whose_shapes_the_scheme_cannot_take_is_refused_at_load_naming_the_layer(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", intermediate_size=48)  # 48 input channels of down_proj
    engine = LocalEngine(precision=Int4W4A16(32).spec())
    with pytest.raises(ValueError, match=r"int4_w4a16: 2 layer\(s\) it cannot take: model.layers.0.mlp.down_proj "
                                         r"\[64, 48\]: its 48 input channels are not a multiple of the group of 32"):
        engine.load_model(str(model_dir))
    engine = LocalEngine(precision=Int4W4A16(32, exclude=["down_proj"]).spec())
    engine.load_model(str(model_dir))
    assert "model.layers.0.mlp.down_proj" not in engine.quantized_layers and len(engine.quantized_layers) == 12
    engine.close()


def test_the_engine_reports_the_bytes_of_its_weights(tiny_model_dir):
    sizes = {}
    for name in ["bf16", *sorted(BUILTIN_SCHEMES)]:
        engine = LocalEngine(precision=None if name == "bf16" else BUILTIN_SCHEMES[name]().spec())
        engine.load_model(str(tiny_model_dir))
        sizes[name] = engine.stats()["weight_bytes"]
        engine.close()
    # float32 here: every scheme holds the decoder's linear layers in a quarter of their bytes or less
    assert sizes["nvfp4"] < sizes["int4_w4a16"] < sizes["fp8_block"] <= sizes["fp8_channel"] < sizes["bf16"]
    assert sizes["mxfp8"] < sizes["fp8_channel"]
