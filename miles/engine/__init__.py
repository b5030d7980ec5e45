"""The embedded inference engine (SGLang's protocol, on torch)."""

from miles.engine.local import LocalEngine
from miles.engine.sampling import SamplingParams

__all__ = ["LocalEngine", "SamplingParams"]
