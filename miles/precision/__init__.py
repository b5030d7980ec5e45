"""Low precision: schemes that store a linear layer's weight in FP8, INT4, MXFP8 or NVFP4 (``schemes.py``), the
engine's quantized linear layer and the conversions of a model's weights (``linear.py``). See docs/precision.md."""
