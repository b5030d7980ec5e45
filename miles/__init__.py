"""Miles: reinforcement-learning post-training of language models, as a thin loop plus plugins."""

import pluggy

from miles._version import __version__

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
