"""Miles: reinforcement-learning post-training of language models, as a thin loop plus plugins."""

import importlib
from typing import Any

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("miles")


def batched(fn):
    """Mark a reward function as batched: it takes a list of samples and returns a list."""
    fn.miles_batched = True
    return fn


def import_object(path: str) -> Any:
    """The object at the import path ``package.module:name`` (``name`` may be dotted: ``module:Class.method``).
    A ValueError when ``path`` is not of that form, or does not import (the import's error is its cause)."""
    module_name, sep, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not module_name or not sep or not attr:
        raise ValueError(f"expected an import path 'package.module:name', got {path!r}")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise ValueError(f"cannot import {path!r}: {type(exc).__name__}: {exc}") from exc
    return obj


from miles.types import Group, LossInputs, Sample, SampleStatus, TrainBatch  # noqa: E402
from miles.agentic.types import Action, EnvContext, ExecResult, StepResult, Tool, ToolCall, ToolResult, tool  # noqa: E402

__all__ = [
    "__version__",
    "hookimpl",
    "batched",
    "import_object",
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
