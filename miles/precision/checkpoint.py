"""HF checkpoints in a precision scheme's stored form: written from a float checkpoint (a disk push to engines that
hold the stored form, ``run.export_precision``), read as held (the engine's side), and read as float weights (a
published FP8 checkpoint as ``model.path``: dequantized into the master weights).

A checkpoint in a stored form is an HF model directory whose safetensors hold, for each quantized layer, the
scheme's tensors in place of ``weight`` (``weight`` + ``weight_scale_inv`` for ``fp8_block``, as DeepSeek-V3 and
Qwen3-FP8 publish; ``weight_packed`` + ``weight_scale`` + ``weight_shape`` for ``int4_w4a16``, as compressed-tensors
writes), and whose ``config.json`` has the scheme's ``quantization_config``, with ``miles_precision`` (the scheme's
spec and the layers) beside it so that Miles reads it back exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from miles.errors import ConfigError
from miles.precision.experts import missing_experts
from miles.precision.linear import dequantize_weights, quantize_weights, shape_problems, target_modules
from miles.precision.schemes import Fp8Block, Scheme, from_spec

__all__ = ["write_stored_form", "read_stored_form", "read_float_weights", "check_stored_form", "checkpoint_scheme",
           "planned_layers", "stored_form_copy"]

WEIGHTS_FILE = "model.safetensors"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def _config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def planned_layers(model_path: str | Path, scheme: Scheme, where: str = "rollout.precision") -> list[str]:
    """The layers of the model in ``model_path`` that ``scheme`` quantizes (as the engine finds them, from a model
    on the meta device: nothing is loaded); a layer whose shape it cannot take is a ConfigError naming it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_path)
    if getattr(config, "quantization_config", None):
        del config.quantization_config
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    names = target_modules(model, scheme.include, scheme.exclude)
    if problems := shape_problems(model, scheme, names):
        raise ConfigError(f"{where}: {scheme.name} cannot take {len(problems)} layer(s) of {model_path}: "
                          f"{'; '.join(problems)}. Leave them in high precision ({where}.exclude: [...]) or choose "
                          f"another group size")
    if not names:
        raise ConfigError(f"{where}: {scheme.name} finds no linear layer to quantize in {model_path} "
                          f"(include: {list(scheme.include)}, exclude: {list(scheme.exclude)})")
    return names


def write_stored_form(path: str | Path, scheme: Scheme, names: list[str]) -> None:
    """Rewrite the float HF checkpoint in ``path`` (written by ``save_pretrained``) in the stored form of the named
    layers, with the scheme's ``quantization_config``."""
    path = Path(path)
    weights = _tensors(path)
    stored = quantize_weights(weights, scheme, names)
    for file in path.glob("*.safetensors"):
        file.unlink()
    for index in path.glob("*.safetensors.index.json"):
        index.unlink()
    save_file({k: v.contiguous() for k, v in stored.items()}, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    config = _config(path)
    block = scheme.quantization_config()
    for group in block.get("config_groups", {}).values():  # compressed-tensors: exactly these layers (not lm_head)
        group["targets"] = list(names)
    config["quantization_config"] = {**block, "miles_precision": {"scheme": scheme.spec(), "layers": names}}
    (path / "config.json").write_text(json.dumps(config, indent=2))


def checkpoint_scheme(path: str | Path) -> tuple[Scheme, list[str]] | None:
    """The scheme and quantized layers of a checkpoint in a stored form (None: a float checkpoint). Miles' own
    (``miles_precision``), or a published block-FP8 checkpoint (``quant_method: fp8`` with ``weight_block_size``,
    the layers being those that hold ``weight_scale_inv``)."""
    path = Path(path)
    block = _config(path).get("quantization_config")
    if not block:
        return None
    if "miles_precision" in block:
        own = block["miles_precision"]
        return from_spec(own["scheme"]), list(own["layers"])
    if block.get("quant_method") == "fp8" and block.get("weight_block_size"):
        sizes = block["weight_block_size"]
        if len(sizes) != 2 or sizes[0] != sizes[1]:
            raise ConfigError(f"{path}/config.json: quantization_config.weight_block_size {sizes}: only square blocks "
                              f"are read")
        layers = [k.removesuffix(".weight_scale_inv") for k in _weight_names(path) if k.endswith(".weight_scale_inv")]
        return Fp8Block(int(sizes[0])), layers
    raise ConfigError(f"{path}/config.json: quantization_config {block.get('quant_method')!r} is not a format Miles "
                      f"reads (its own stored forms, and block FP8: quant_method fp8 with weight_block_size)")


def _weight_names(path: Path) -> list[str]:
    from safetensors import safe_open

    names = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            names += list(f.keys())
    return names


def _tie(weights: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """A tied output layer (``tie_word_embeddings``) is written once, as the embedding: the model's state dict
    holds it under both names."""
    config = _config(path)
    text = config.get("text_config") or {}
    if config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)) and "lm_head.weight" not in weights:
        # not an MTP layer's copy of it (DeepSeek-V3 ships one as model.layers.<N>.embed_tokens: miles.models.mtp)
        embed = [k for k in weights if k.endswith("embed_tokens.weight") and ".layers." not in k]
        if len(embed) == 1:
            weights["lm_head.weight"] = weights[embed[0]]
    return weights


def read_stored_form(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint in a stored form, as an engine holding that form takes them."""
    path = Path(path)
    return _tie(_tensors(path), path)


def check_stored_form(path: str | Path) -> None:
    """What :func:`read_float_weights` refuses, from the tensors' names and dtypes alone (nothing is loaded): a
    quantized layer with a stored tensor missing, float8 values with no scale. A ConfigError names the tensor."""
    from safetensors import safe_open

    path = Path(path)
    found = checkpoint_scheme(path)
    if found is None:
        return
    scheme, layers = found
    dtypes: dict[str, str] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            dtypes.update({name: f.get_slice(name).get_dtype() for name in f.keys()})
    if problem := missing_experts(dtypes):
        raise ConfigError(f"{path}: {problem}")
    missing = [f"{layer}.{s}" for layer in layers for s in scheme.stored if f"{layer}.{s}" not in dtypes]
    if missing:
        raise ConfigError(f"{path}: {', '.join(missing[:8])} missing (each {scheme.name} layer holds "
                          f"{', '.join(scheme.stored)})")
    quantized = set(layers)
    unscaled = [n for n, d in dtypes.items() if d.startswith("F8") and n.endswith(".weight")
                and n.removesuffix(".weight") not in quantized]
    if unscaled:
        raise ConfigError(f"{path}: {', '.join(unscaled[:8])} hold float8 values with no "
                          f"{unscaled[0].removesuffix('.weight')}.weight_scale_inv beside them")


def read_float_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint in a stored form as float32 weights (each quantized layer's ``weight`` dequantized). A quantized
    layer with a scale missing is a ConfigError naming the tensor."""
    path = Path(path)
    found = checkpoint_scheme(path)
    weights = _tensors(path)
    if found is None:
        return _tie(weights, path)
    scheme, layers = found
    values = {name for name in layers if f"{name}.weight" in weights or f"{name}.weight_packed" in weights}
    try:
        floats = dequantize_weights(weights, scheme, sorted(values))
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if isinstance(scheme, Fp8Block):  # a layer with fp8 values and no scale: its scale is missing
        unscaled = [k for k, v in weights.items() if v.dtype == torch.float8_e4m3fn
                    and k.removesuffix(".weight") not in values]
        if unscaled:
            raise ConfigError(f"{path}: {', '.join(unscaled)} hold float8 values with no "
                              f"{unscaled[0].removesuffix('.weight')}.weight_scale_inv beside them")
    return _tie({k: v.float() if v.is_floating_point() else v for k, v in floats.items()}, path)


def stored_form_copy(model_path: str | Path, scheme: Scheme, out: str | Path) -> Path:
    """A copy of the float checkpoint in ``model_path`` in the stored form of ``scheme`` (its planned layers), in
    ``out``: what an engine that loads quantized checkpoints itself (SGLang) starts from."""
    import shutil

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(model_path, out)
    write_stored_form(out, scheme, planned_layers(model_path, scheme))
    return out
