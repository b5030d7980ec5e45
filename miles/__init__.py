"""Miles: reinforcement-learning post-training of language models, as a thin loop plus plugins."""

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("miles")

from miles.registry import batched  # noqa: E402  (after hookimpl: builtin plugins import it)
from miles.types import Group, LossInputs, Sample, SampleStatus, TrainBatch  # noqa: E402
from miles.agentic.types import Action, EnvContext, ExecResult, StepResult, Tool, ToolCall, ToolResult, tool  # noqa: E402

__all__ = [
    "__version__",
    "hookimpl",
    "batched",
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
