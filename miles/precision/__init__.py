"""Low precision: schemes that store a linear layer's weight in FP8, INT4, MXFP8 or NVFP4 (``schemes.py``), the
engine's quantized linear layer and the conversions of a model's weights (``linear.py``), quantization-aware training
(``qat.py``) and training in low precision (``training.py``). See docs/precision.md.

A plugin's precision scheme subclasses :class:`Scheme` (this package is one of the public author modules)."""

from miles.lazy import lazy_exports
from miles.precision.schemes import BUILTIN_SCHEMES, MXFP8, NVFP4, Fp8Block, Fp8Channel, Int4W4A16, Scheme, from_spec

__all__ = ["BUILTIN_SCHEMES", "MXFP8", "NVFP4", "Fp8Block", "Fp8Channel", "Int4W4A16", "Scheme", "from_spec",
           "stored_form_copy", "write_stored_form"]

# checkpoints in a stored form (safetensors and transformers are imported when first used)
__getattr__ = lazy_exports(__name__, {"stored_form_copy": "miles.precision.checkpoint",
                                      "write_stored_form": "miles.precision.checkpoint"})
