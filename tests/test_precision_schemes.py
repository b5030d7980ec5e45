"""The precision schemes' numerics, bit for bit against the field's libraries: compressed-tensors' quantizer for FP8
(block and channel) and INT4, torchao's MXTensor and NVFP4Tensor for the microscaling formats, on awkward shapes
(not multiples of a block), zeros, tiny and huge magnitudes; non-finite weights and shapes a scheme cannot take are
refused."""

from __future__ import annotations

import pytest
import torch

from miles.precision.schemes import BUILTIN_SCHEMES, MXFP8, NVFP4, Fp8Block, Fp8Channel, Int4W4A16, torchao_module

ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

MAGNITUDES = [1e-30, 1e-6, 1.0, 1e4, 1e30]


def weight(shape: tuple[int, int], magnitude: float, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=generator) * magnitude
    w[0, : min(5, shape[1])] = 0.0  # zeros inside a block
    return w


def ct_fake_quantize(w: torch.Tensor, args: QuantizationArgs, reduce: tuple[int, int]) -> torch.Tensor:
    """compressed-tensors' quantize-dequantize of ``w`` with the scales its calculate_qparams gives over blocks of
    ``reduce`` (rows, columns) of the weight."""
    rows, cols = w.shape
    r, c = reduce
    blocks = w.reshape(rows // r, r, cols // c, c)
    lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    scale, zero = calculate_qparams(lo, hi, args)
    return ct_forward.fake_quantize(w, scale, zero, args)


@pytest.mark.parametrize("magnitude", MAGNITUDES)
@pytest.mark.parametrize("shape", [(256, 384), (128, 128)])
def test_fp8_block_equals_compressed_tensors_block_quantization(shape, magnitude):
    w = weight(shape, magnitude)
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128])
    assert torch.equal(Fp8Block().fake_quantize(w), ct_fake_quantize(w, args, (128, 128)))


@pytest.mark.parametrize("shape", [(130, 200), (1, 7), (300, 129)])
def test_fp8_block_takes_partial_blocks_at_the_edges_as_the_deepseek_layout_does(shape):
    """A partial block's scale is its own maximum over 448; dequantizing multiplies each value by its block's
    ``weight_scale_inv`` (DeepSeek-V3's weight_dequant)."""
    w = weight(shape, 0.02)
    stored = Fp8Block().quantize(w)
    scale = stored["weight_scale_inv"]
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and stored["weight"].shape == shape
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert scale[i, j] == block.abs().amax() / 448
            values = stored["weight"][i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert torch.equal(values, torch.clamp(block / scale[i, j], -448, 448).to(torch.float8_e4m3fn))
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    assert torch.equal(Fp8Block().dequantize(stored), stored["weight"].float() * expanded)


@pytest.mark.parametrize("magnitude", MAGNITUDES)
@pytest.mark.parametrize("shape", [(96, 200), (3, 7)])
def test_fp8_channel_equals_compressed_tensors_channel_quantization(shape, magnitude):
    w = weight(shape, magnitude)
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    assert torch.equal(Fp8Channel().fake_quantize(w), ct_fake_quantize(w, args, (1, shape[1])))


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e4, 1e30])
def test_int4_equals_compressed_tensors_group_quantization_and_its_packing(group_size, magnitude):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    w = weight((48, 4 * group_size), magnitude)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    blocks = w.reshape(48, -1, group_size)
    scale, zero = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
    stored = Int4W4A16(group_size).quantize(w)
    assert torch.equal(stored["weight_scale"], scale)
    codes = ct_forward.quantize(w, scale, zero, args, dtype=torch.int8)
    assert torch.equal(stored["weight_packed"], pack_to_int32(codes, 4))
    assert stored["weight_shape"].tolist() == [48, 4 * group_size]
    assert torch.equal(Int4W4A16(group_size).dequantize(stored), ct_forward.dequantize(codes, scale, zero, args))


def test_int4_fake_quantization_is_torchao_qat_s_but_at_rounding_ties():
    """torchao's QAT fake quantizer (IntxFakeQuantizer, symmetric per group) gives the same weight but where a value
    sits half way between two codes: a group's most negative value (-7.5 scales, give or take a rounding error)
    lands on -7 or -8 depending on whether the library divides by the scale (compressed-tensors, whose format the
    engines load) or multiplies by its reciprocal (torchao). QAT trains on the engine's numerics."""
    qat = torchao_module("quantization.qat")
    w = weight((64, 128), 0.05)
    config = qat.IntxFakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True)
    theirs, ours = qat.IntxFakeQuantizer(config)(w), Int4W4A16(32).fake_quantize(w)
    scale = Int4W4A16(32).quantize(w)["weight_scale"].repeat_interleave(32, 1)
    differ = theirs != ours
    assert 0 < int(differ.sum()) <= w.shape[0] * 4  # at most one per group
    assert torch.allclose(w[differ] / scale[differ], torch.tensor(-7.5), rtol=0, atol=1e-6)
    ours_codes, their_codes = (ours[differ] / scale[differ]).round(), (theirs[differ] / scale[differ]).round()
    assert {tuple(sorted(pair)) for pair in zip(ours_codes.tolist(), their_codes.tolist())} == {(-8.0, -7.0)}


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e4, 1e30])
@pytest.mark.parametrize("shape", [(64, 96), (5, 32)])
def test_mxfp8_equals_torchao_mxtensor(shape, magnitude):
    mx = torchao_module("prototype.mx_formats.mx_tensor")
    w = weight(shape, magnitude)
    tensor = mx.MXTensor.to_mx(w, torch.float8_e4m3fn, 32)
    stored = MXFP8().quantize(w)
    assert stored["weight_scale"].dtype == torch.float8_e8m0fnu
    assert torch.equal(stored["weight"], tensor.qdata) and torch.equal(stored["weight_scale"], tensor.scale)
    assert torch.equal(MXFP8().dequantize(stored), tensor.dequantize(torch.float32))


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e4])
@pytest.mark.parametrize("shape", [(64, 96), (5, 16)])
def test_nvfp4_equals_torchao_nvfp4tensor(shape, magnitude):
    nv = torchao_module("prototype.mx_formats.nvfp4_tensor")
    w = weight(shape, magnitude)
    tensor = nv.NVFP4Tensor.to_nvfp4(w, per_tensor_scale=nv.per_tensor_amax_to_scale(w.abs().amax()))
    stored = NVFP4().quantize(w)
    assert torch.equal(stored["weight"], tensor.qdata) and torch.equal(stored["weight_scale"], tensor.scale)
    assert torch.equal(NVFP4().dequantize(stored), tensor.dequantize(torch.float32))


def test_nvfp4_inputs_are_quantized_row_by_row_with_each_row_s_own_second_scale():
    """A token's quantized input is the same alone as in a batch (its log-probs do not depend on its neighbours)."""
    x = weight((6, 48), 1.0)
    x[3] *= 1e3
    whole = NVFP4().activation(x)
    for i in range(6):
        assert torch.equal(whole[i], NVFP4().activation(x[i:i + 1])[0])


@pytest.mark.parametrize("name", sorted(BUILTIN_SCHEMES))
def test_every_scheme_quantizes_inputs_per_token(name):
    scheme = BUILTIN_SCHEMES[name]()
    x = weight((4, 256), 1.0, seed=1)
    x[2] *= 1e4
    whole = scheme.activation(x.reshape(2, 2, 256))
    rows = torch.cat([scheme.activation(x[i:i + 1]) for i in range(4)])
    assert torch.equal(whole.reshape(4, 256), rows)
    if scheme.weight_only:
        assert torch.equal(whole.reshape(4, 256), x)
    else:
        assert not torch.equal(whole.reshape(4, 256), x)


@pytest.mark.parametrize("name", sorted(BUILTIN_SCHEMES))
def test_every_scheme_round_trips_zeros_and_keeps_values_near(name):
    scheme = BUILTIN_SCHEMES[name]()
    assert torch.equal(scheme.fake_quantize(torch.zeros(32, 64)), torch.zeros(32, 64))
    w = weight((32, 64), 0.1)
    error = (scheme.fake_quantize(w) - w).abs().max() / w.abs().max()
    assert 0 < error < {"nvfp4": 0.2, "int4_w4a16": 0.1}.get(name, 0.08)


@pytest.mark.parametrize("name", sorted(BUILTIN_SCHEMES))
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_weights_are_refused_naming_the_scheme(name, bad):
    w = weight((32, 64), 1.0)
    w[3, 5] = bad
    with pytest.raises(ValueError, match=f"{name}: the weight holds NaN or inf"):
        BUILTIN_SCHEMES[name]().quantize(w)


@pytest.mark.parametrize("name,cols", [("int4_w4a16", 48), ("mxfp8", 40), ("nvfp4", 24)])
def test_a_shape_the_group_does_not_divide_is_refused_naming_the_group(name, cols):
    scheme = BUILTIN_SCHEMES[name]()
    assert f"{cols} input channels are not a multiple" in scheme.check((16, cols))
    with pytest.raises(ValueError, match="not a multiple"):
        scheme.quantize(torch.randn(16, cols))
