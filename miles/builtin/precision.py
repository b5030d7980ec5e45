"""Builtin precision schemes (miles/precision/schemes.py; docs/precision.md)."""

from miles import hookimpl


def bf16() -> None:
    """The model's own precision: nothing quantized (bfloat16 on a GPU, float32 on a CPU)."""
    return None


@hookimpl(trylast=True)
def miles_register_precisions(register):
    register("bf16", bf16)
    register("fp8_block", "miles.precision.schemes:Fp8Block")
    register("fp8_channel", "miles.precision.schemes:Fp8Channel")
    register("int4_w4a16", "miles.precision.schemes:Int4W4A16")
    register("mxfp8", "miles.precision.schemes:MXFP8")
    register("nvfp4", "miles.precision.schemes:NVFP4")
