"""LoRA adapters on the wire: what a trainer with ``backend.lora.sync: adapters`` sends instead of full weights.

An adapter payload is a state dict of three tensors per adapted layer, named after the layer's HF name
``<layer>`` (whose base weight is ``<layer>.weight``):

- ``<layer>.lora_A.weight`` ``[rank, in]`` and ``<layer>.lora_B.weight`` ``[out, rank]``, oriented so that
  ``B @ A`` has the shape of ``<layer>.weight`` (layers that store their weight transposed, such as GPT-2's
  ``Conv1D``, send ``A`` and ``B`` swapped and transposed);
- ``<layer>.lora_scaling``, one float (``[1]``): ``alpha / rank``.

The merged weight is ``W + scaling * (B @ A)``, computed in float32 (one ``addmm``) and cast to ``W``'s dtype.
A payload holds every adapter (never a difference to the last one), so merging it into the base weights gives the
same result however many payloads came before; this module has no dependency on peft and is shared by both planes.
"""

from __future__ import annotations

from collections.abc import Mapping

from miles.lazy import lazy_module

torch = lazy_module("torch")

__all__ = ["ADAPTER_SUFFIXES", "is_adapter_payload", "adapter_layers", "adapter_problems", "merge_adapters"]

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_scaling")


def is_adapter_payload(weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``weights`` is an adapter payload (any adapter tensor in it) rather than full weights."""
    return any(name.endswith(ADAPTER_SUFFIXES) for name in weights)


def adapter_layers(weights: Mapping[str, torch.Tensor]) -> list[str]:
    """The layers (``<layer>``, base weight ``<layer>.weight``) an adapter payload adapts, in payload order."""
    layers: dict[str, None] = {}
    for name in weights:
        for suffix in ADAPTER_SUFFIXES:
            if name.endswith(suffix):
                layers[name[: -len(suffix)]] = None
    return list(layers)


def adapter_problems(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor],
                     allow_non_finite: bool = False) -> list[str]:
    """Every way ``adapters`` does not fit the weights ``base`` (empty when it fits)."""
    problems = []
    stray = [name for name in adapters if not name.endswith(ADAPTER_SUFFIXES)]
    if stray:
        problems.append(f"{len(stray)} tensor(s) that are not adapters in an adapter payload: {', '.join(stray[:8])}")
    for layer in adapter_layers(adapters):
        parts = [adapters.get(layer + suffix) for suffix in ADAPTER_SUFFIXES]
        if any(part is None for part in parts):
            missing = [layer + s for s, part in zip(ADAPTER_SUFFIXES, parts) if part is None]
            problems.append(f"{layer}: incomplete adapter (missing {', '.join(missing)})")
            continue
        a, b, scaling = parts
        weight = base.get(layer + ".weight")
        if weight is None:
            problems.append(f"{layer}: the model has no weight {layer}.weight to merge an adapter into")
        elif (a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]
              or (b.shape[0], a.shape[1]) != tuple(weight.shape)):
            problems.append(f"{layer}: lora_B {tuple(b.shape)} @ lora_A {tuple(a.shape)} does not give the weight's "
                            f"shape {tuple(weight.shape)}")
        if scaling.numel() != 1:
            problems.append(f"{layer}.lora_scaling: expected one value, got shape {tuple(scaling.shape)}")
        if not all(t.dtype.is_floating_point for t in parts):
            problems.append(f"{layer}: adapter tensors must be floating point")
        elif not allow_non_finite and not all(bool(torch.isfinite(t).all()) for t in parts):
            problems.append(f"{layer}: adapter holds NaN or inf values")
    return problems


def merge_adapters(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``base`` with ``W + scaling * (B @ A)`` for every adapted layer (new tensors; ``base`` is not changed).

    Raises ValueError naming every problem when the adapters do not fit."""
    problems = adapter_problems(base, adapters, allow_non_finite=True)
    if problems:
        raise ValueError("; ".join(problems))
    merged = dict(base)
    for layer in adapter_layers(adapters):
        merged[layer + ".weight"] = merged_weight(base[layer + ".weight"], adapters[layer + ".lora_A.weight"],
                                                  adapters[layer + ".lora_B.weight"], adapters[layer + ".lora_scaling"])
    return merged


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight + scaling * (b @ a)`` computed in float32 (one ``addmm``), as ``weight``'s dtype on its device;
    written into ``out`` when given (e.g. the engine's parameter: no new memory for a float32 model)."""
    device, alpha = weight.device, float(scaling.reshape(-1)[0])
    a, b = a.to(device, torch.float32), b.to(device, torch.float32)
    if weight.dtype == torch.float32 and (out is None or out.dtype == torch.float32):
        return torch.addmm(weight, b, a, alpha=alpha, out=out)
    merged = torch.addmm(weight.float(), b, a, alpha=alpha).to(weight.dtype)
    return merged if out is None else out.copy_(merged)
