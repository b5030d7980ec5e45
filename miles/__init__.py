"""Miles: reinforcement-learning post-training of language models, as a thin loop plus plugins."""

import logging

import pluggy

from miles._version import __version__


def _quiet_cpu_extension_notices(record: logging.LogRecord) -> bool:
    """torchao (imported by transformers whenever it is installed) logs a warning for each of its CUDA extensions
    that cannot load, at every start on a machine without a GPU; torch logs a deprecation notice for each of its
    enums. Neither says anything about the run; miles/precision checks what a scheme needs where it runs."""
    text = record.getMessage()
    return "Could not load this library" not in text and "register_constant() on Enum subclasses" not in text


logging.getLogger("torchao").addFilter(_quiet_cpu_extension_notices)
logging.getLogger("torch.utils._pytree").addFilter(_quiet_cpu_extension_notices)

hookimpl = pluggy.HookimplMarker("miles")


def batched(fn):
    """Mark a reward function as batched: it takes a list of samples and returns a list."""
    fn.miles_batched = True
    return fn


from miles.lazy import lazy_exports, lazy_module  # noqa: E402
from miles.registry import import_object  # noqa: E402
from miles.types import Group, LossInputs, Sample, SampleStatus, TrainBatch  # noqa: E402
from miles.agentic.types import Action, EnvContext, ExecResult, StepResult, Tool, ToolCall, ToolResult, tool  # noqa: E402

__all__ = [
    "__version__",
    "hookimpl",
    "batched",
    "import_object",
    "lazy_exports",
    "lazy_module",
    "Group",
    "LossInputs",
    "Sample",
    "SampleStatus",
    "TrainBatch",
    "Action",
    "EnvContext",
    "ExecResult",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolResult",
    "tool",
]
