"""Precision schemes: how a linear layer's weight is stored in low precision, and how its input is quantized.

A scheme quantizes a float weight ``[out, in]`` to its *stored form*, the tensors an engine keeps in place of
``weight`` (values and scales, named as the checkpoint formats engines load name them), dequantizes that form back
to float32, and says how the layer's input is quantized when the engine computes (``activation``: the input,
quantized and dequantized again, so that a float32 matmul on the result equals the quantized matmul's value).
Every quantization is per row of the input (per token), so a token's log-probs do not depend on its batch.

The numerics are the field's libraries': ``torchao``'s float8 quantization primitives and its ``prototype.mx_formats``
(MX and NVFP4), ``compressed-tensors``' int4 quantizer and packing. The builtins (``precision``
components, selected with ``rollout.precision`` and ``backend.qat``):

==============  =============================================================================================
``fp8_block``   E4M3 weights, one float32 scale per 128x128 block (``weight_scale_inv``, the DeepSeek-V3 and
                Qwen3-FP8 layout; partial blocks at the edges), inputs per token per 128 channels
``fp8_channel`` E4M3 weights, one scale per output channel (``weight_scale``), inputs per token
``int4_w4a16``  4-bit symmetric integers, one scale per ``group_size`` (32 or 128) input channels, packed eight to an
                int32 (``weight_packed``, ``weight_scale``, ``weight_shape``: compressed-tensors' pack-quantized);
                inputs in high precision
``mxfp8``       E4M3 values, one E8M0 (power of two) scale per 32 input channels, inputs the same (OCP MX)
``nvfp4``       E2M1 values packed two to a byte, one E4M3 scale per 16 input channels and one float32 scale per
                tensor (``weight``, ``weight_scale``, ``weight_scale_2``: NVIDIA ModelOpt's layout), inputs the same
                with a per-token second-level scale
==============  =============================================================================================
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from miles.lazy import lazy_module

torch = lazy_module("torch")

__all__ = ["Scheme", "from_spec", "Fp8Block", "Fp8Channel", "Int4W4A16", "MXFP8", "NVFP4", "torchao_module",
           "BUILTIN_SCHEMES"]

SCALE_FLOOR = 1e-12  # NVFP4's second-level scale of an all-zero tensor (its values stay zero), never 0/0


def torchao_module(name: str) -> Any:
    """Import ``torchao.<name>`` without its notices about CUDA extensions that cannot load on this machine."""
    import warnings

    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(f"torchao.{name}")
    except ImportError as exc:
        raise ImportError(f"low-precision schemes need torchao (pip install 'miles[precision]'): {exc}") from exc
    finally:
        logger.setLevel(level)


def _primitives() -> Any:
    return torchao_module("quantization.quant_primitives")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a float32 2-D tensor of its rows (all leading dimensions flattened)."""
    return x.reshape(-1, x.shape[-1]).float()


def _float8_scale(padded: torch.Tensor, block: list[int]) -> torch.Tensor:
    """torchao's float8 scale (amax / 448 per block); a block of zeros gets float32's eps, as compressed-tensors
    gives it (its values stay zero), never 0/0."""
    scale = _primitives()._choose_scale_float8(padded, block, torch.float8_e4m3fn)
    return torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)


def _pad_to(t: torch.Tensor, multiples: tuple[int, ...]) -> torch.Tensor:
    """``t`` padded with zeros at the end of each dimension to a multiple of ``multiples``."""
    pads: list[int] = []
    for size, multiple in reversed(list(zip(t.shape, multiples))):
        pads += [0, -size % multiple]
    return torch.nn.functional.pad(t, pads) if any(pads) else t


class Scheme:
    """A precision scheme (the base of the builtins; see the module's docstring).

    ``stored`` names the tensors of the stored form, ``weight`` first where it holds the values; ``check(shape)``
    says why a ``[out, in]`` weight cannot be taken (None: it can); ``quantize``/``dequantize`` convert a weight;
    ``activation`` quantizes a layer's input the way the engine computes with it (identity for weight-only schemes);
    ``quantization_config`` is the ``config.json`` block of a checkpoint in this format. ``include``/``exclude``
    choose its layers (:func:`miles.precision.linear.target_modules`)."""

    name = ""
    stored: tuple[str, ...] = ()
    weight_only = False

    def __init__(self, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> None:
        for what, value in (("include", include), ("exclude", exclude)):
            if isinstance(value, str) or not all(isinstance(s, str) and s for s in value):
                raise ValueError(f"{what}: expected a list of module-name substrings, got {value!r}")
        self.include, self.exclude = tuple(include), tuple(exclude)

    def check(self, shape: tuple[int, ...]) -> str | None:
        return None if len(shape) == 2 else f"expected a 2-D weight, got shape {tuple(shape)}"

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def dequantize(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def fake_quantize(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as the engine computes with it: quantized and dequantized (float32)."""
        return self.dequantize(self.quantize(weight))

    def quantization_config(self) -> dict[str, Any]:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    def spec(self) -> dict[str, Any]:
        """The scheme as JSON (its class's import path and its arguments), for engines in other processes:
        :func:`from_spec` makes it again."""
        params = inspect.signature(type(self)).parameters
        args = {n: list(v) if isinstance(v, tuple) else v for n in params if (v := getattr(self, n, None)) is not None}
        return {"path": f"{type(self).__module__}:{type(self).__qualname__}", "args": args}

    def _checked(self, weight: torch.Tensor) -> torch.Tensor:
        why = self.check(tuple(weight.shape))
        if why is not None:
            raise ValueError(f"{self.name}: {why}")
        w = weight.detach().float()
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"{self.name}: the weight holds NaN or inf values; a low-precision format cannot "
                             f"store them (the scale of their block would be infinite)")
        return w

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), repr(self)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class _Float8(Scheme):
    """E4M3 values with float32 scales over blocks ``weight_block`` of the weight and ``input_block`` channels of
    each input row (0: the whole row)."""

    weight_block: tuple[int, int] = (1, 0)
    input_block = 0
    scale_name = "weight_scale"

    def _block(self, shape: tuple[int, ...]) -> list[int]:
        return [b or size for b, size in zip(self.weight_block, shape)]

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        prims, w = _primitives(), self._checked(weight)
        block = self._block(tuple(w.shape))
        padded = _pad_to(w, tuple(block))  # partial blocks at the edges: zeros never raise a block's maximum
        scale = _float8_scale(padded, block)
        values = prims._quantize_affine_float8(padded, scale, torch.float8_e4m3fn)
        return {"weight": values[: w.shape[0], : w.shape[1]].contiguous(), self.scale_name: scale}

    def dequantize(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        values, scale = stored["weight"], stored[self.scale_name]
        block = self._block(tuple(values.shape))
        padded = _pad_to(values.float(), tuple(block))
        out = _primitives()._dequantize_affine_float8(padded, scale.float(), torch.float32)
        return out[: values.shape[0], : values.shape[1]].contiguous()

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        prims, rows = _primitives(), _rows(x)
        block = [1, self.input_block or rows.shape[1]]
        padded = _pad_to(rows, tuple(block))
        scale = _float8_scale(padded, block)
        fake = prims._dequantize_affine_float8(prims._quantize_affine_float8(padded, scale), scale)
        return fake[:, : rows.shape[1]].reshape(x.shape).to(x.dtype)


class Fp8Block(_Float8):
    name = "fp8_block"
    stored = ("weight", "weight_scale_inv")
    scale_name = "weight_scale_inv"  # DeepSeek's name; it multiplies the values (amax / 448)

    def __init__(self, block_size: int = 128, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> None:
        super().__init__(include, exclude)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size: expected a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.weight_block = (block_size, block_size)
        self.input_block = block_size

    def quantization_config(self) -> dict[str, Any]:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [self.block_size, self.block_size]}


class Fp8Channel(_Float8):
    name = "fp8_channel"
    stored = ("weight", "weight_scale")
    weight_block = (1, 0)
    input_block = 0

    def quantization_config(self) -> dict[str, Any]:
        args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": args,
                                              "input_activations": {**args, "dynamic": True, "strategy": "token"}}}}


class _Grouped(Scheme):
    """Schemes with one scale per ``group_size`` input channels: the input dimension must be a multiple of it."""

    group_size = 32

    def check(self, shape: tuple[int, ...]) -> str | None:
        if (why := super().check(shape)) is not None:
            return why
        if shape[1] % self.group_size:
            return (f"its {shape[1]} input channels are not a multiple of the group of {self.group_size} that "
                    f"{self.name} scales together")
        return None


class Int4W4A16(_Grouped):
    name = "int4_w4a16"
    stored = ("weight_packed", "weight_scale", "weight_shape")
    weight_only = True

    def __init__(self, group_size: int = 32, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> None:
        super().__init__(include, exclude)
        if group_size not in (32, 64, 128):
            raise ValueError(f"group_size: expected 32, 64 or 128, got {group_size!r}")
        self.group_size = group_size

    def _args(self) -> Any:
        from compressed_tensors.quantization import QuantizationArgs

        return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=self.group_size)

    def _codes(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """compressed-tensors' codes (int8 in [-8, 7]) and scales (amax / 7.5 per group): llm-compressor's numerics,
        which the engines' pack-quantized checkpoints hold. (torchao's affine quantizer multiplies by the scale's
        reciprocal and rounds a group's most negative value, -7.5, to -7 where this rounds it to -8.)"""
        from compressed_tensors.quantization.lifecycle.forward import quantize
        from compressed_tensors.quantization.utils.helpers import calculate_qparams

        groups = w.reshape(w.shape[0], -1, self.group_size)
        args = self._args()
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        return quantize(w, scale, zero, args, dtype=torch.int8), scale

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        w = self._checked(weight)
        codes, scale = self._codes(w)
        return {"weight_packed": pack_to_int32(codes, 4), "weight_scale": scale,
                "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}

    def dequantize(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        shape = torch.Size(int(n) for n in stored["weight_shape"].tolist())
        codes = unpack_from_int32(stored["weight_packed"], 4, shape)
        scale = stored["weight_scale"].float()
        return (codes.float().reshape(shape[0], -1, self.group_size) * scale.unsqueeze(-1)).reshape(shape)

    def quantization_config(self) -> dict[str, Any]:
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False, "strategy": "group",
                   "group_size": self.group_size}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


class MXFP8(_Grouped):
    name = "mxfp8"
    stored = ("weight", "weight_scale")
    group_size = 32

    @staticmethod
    def _mx() -> Any:
        return torchao_module("prototype.mx_formats.mx_tensor")

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        scale, values = self._mx().to_mx(self._checked(weight), torch.float8_e4m3fn, self.group_size)
        return {"weight": values, "weight_scale": scale}

    def dequantize(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._mx().to_dtype(stored["weight"], stored["weight_scale"], torch.float8_e4m3fn, self.group_size,
                                   torch.float32)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        if rows.shape[1] % self.group_size:
            raise ValueError(f"mxfp8: an input of {rows.shape[1]} channels is not a multiple of {self.group_size}")
        mx = self._mx()
        scale, values = mx.to_mx(rows, torch.float8_e4m3fn, self.group_size)
        fake = mx.to_dtype(values, scale, torch.float8_e4m3fn, self.group_size, torch.float32)
        return fake.reshape(x.shape).to(x.dtype)

    def quantization_config(self) -> dict[str, Any]:
        return {"quant_method": "mxfp8", "group_size": self.group_size, "weight_scale": "e8m0"}


class NVFP4(_Grouped):
    name = "nvfp4"
    stored = ("weight", "weight_scale", "weight_scale_2")
    group_size = 16

    @staticmethod
    def _nv() -> Any:
        return torchao_module("prototype.mx_formats.nvfp4_tensor")

    def _quantize_rows(self, rows: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block scales, packed values, second-level scale): one second-level scale for the tensor, or one per row."""
        nv = self._nv()
        amax = rows.abs().amax(dim=1, keepdim=True) if per_row else rows.abs().amax()
        second = nv.per_tensor_amax_to_scale(torch.clamp(amax, min=SCALE_FLOOR))
        # a [rows, 1] second-level scale broadcasts over each row's blocks in nvfp4_quantize
        scales, packed = nv.nvfp4_quantize(rows.contiguous(), self.group_size, second)
        return scales, packed, second

    def _dequantize(self, scales: torch.Tensor, packed: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        kernels = torchao_module("prototype.mx_formats.kernels")
        values = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(packed))
        rows = values.shape[0]
        blocks = values.reshape(rows, -1, self.group_size) * (scales.float() * second.reshape(-1, 1)).unsqueeze(-1)
        return blocks.reshape(rows, -1)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        scales, packed, second = self._quantize_rows(self._checked(weight), per_row=False)
        return {"weight": packed, "weight_scale": scales, "weight_scale_2": second.reshape(())}

    def dequantize(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._dequantize(stored["weight_scale"], stored["weight"], stored["weight_scale_2"].float())

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        if rows.shape[1] % self.group_size:
            raise ValueError(f"nvfp4: an input of {rows.shape[1]} channels is not a multiple of {self.group_size}")
        scales, packed, second = self._quantize_rows(rows, per_row=True)
        return self._dequantize(scales, packed, second).reshape(x.shape).to(x.dtype)

    def quantization_config(self) -> dict[str, Any]:
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": self.group_size}


def from_spec(spec: Mapping[str, Any]) -> Scheme:
    """The scheme of a :meth:`Scheme.spec` (a ValueError naming what is wrong with it)."""
    path = spec.get("path") if isinstance(spec, Mapping) else None
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"precision: expected {{'path': 'module:Class', 'args': {{...}}}}, got {spec!r}")
    module, _, attr = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"precision: cannot import {path}: {exc}") from exc
    scheme = cls(**dict(spec.get("args") or {}))
    if not isinstance(scheme, Scheme):
        raise ValueError(f"precision: {path} is not a precision scheme (a miles.precision.schemes.Scheme)")
    return scheme


BUILTIN_SCHEMES: dict[str, type[Scheme]] = {
    cls.name: cls for cls in (Fp8Block, Fp8Channel, Int4W4A16, MXFP8, NVFP4)
}
