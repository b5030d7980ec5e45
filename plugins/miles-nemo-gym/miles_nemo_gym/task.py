"""A Miles sample as the NeMo Gym task it came from: the ``responses_create_params`` and the row's other fields
(the verifier's metadata, e.g. ``expected_count``), which NeMo Gym sends to ``/seed_session``, ``/run`` and
``/verify`` together.

A NeMo Gym dataset row is ``{"responses_create_params": {"input": ..., "tools": [...]}, <other fields>}``. Miles
reads a row into ``sample.prompt`` (the ``data.prompt_key`` column), ``sample.label`` (``data.label_key``) and
``sample.metadata["data"]`` (every other column). So the parameters are the prompt itself when
``prompt_key: responses_create_params``, else the row's column of that name (or none); their ``input`` defaults
to the prompt (a string or chat messages). ``label_field`` names the row field the label was taken from, to put
it back.
"""

from __future__ import annotations

import copy
from typing import Any

from miles_nemo_gym.responses import ResponsesError, messages_to_input

__all__ = ["task_of"]

PARAMS = "responses_create_params"


def task_of(sample: Any, label_field: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(responses_create_params, the row's other fields)`` of ``sample`` (copies: the caller may change them)."""
    row = copy.deepcopy(dict((getattr(sample, "metadata", None) or {}).get("data") or {}))
    prompt = sample.prompt
    params = row.pop(PARAMS, None)
    if isinstance(prompt, dict):
        params = copy.deepcopy(prompt)
    elif params is None:
        params = {}
    if not isinstance(params, dict):
        raise ResponsesError(f"{PARAMS}: expected an object with 'input' (and 'tools', ...), got "
                             f"{type(params).__name__}")
    if params.get("input") is None:
        if prompt is None or isinstance(prompt, dict):
            raise ResponsesError(f"{PARAMS} has no 'input' and the sample has no prompt to take it from")
        params["input"] = messages_to_input(prompt)
    if label_field and getattr(sample, "label", None) is not None:
        row[label_field] = sample.label
    return params, row
