"""verifiers envs as Miles agents: each sample is one verifiers episode whose model calls go to the sample's
Miles session, scored by the env's own rewards.

    rollout:
      fn: {name: agent, agent: miles_verifiers:rollout, env: my_taskset, env_args: {...}}
    reward: {name: env}

A verifiers env owns its rollout loop (the harness program talks to the model until it is done; the taskset's
rewards then score the trace), so it is driven as an agent rather than stepped as a Miles env. The episode runs
in the worker (the verifiers venv) with the session's URL as the model endpoint; Miles' session server records
the exact tokens, and the reward of the episode's trace is the sample's ``env`` reward.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from miles import Sample
from miles_verifiers.client import WorkerError, worker_for
from miles_verifiers.spec import EnvSpec, check_spec_args

__all__ = ["rollout", "task_of", "check_rollout_args"]


async def rollout(base_url: str, sample: Sample, env: str, env_args: dict[str, Any] | None = None,
                  task_column: str = "task", python: str | None = None,
                  pythonpath: list[str] | None = None) -> float | None:
    """Run the sample's task of the verifiers env with the model behind ``base_url``; returns its reward.

    The task is the one the sample's data row names in ``task_column``: its position in the taskset (an int) or
    its id or key (a string). The trace's named rewards and metrics, turns, stop condition and id are kept in
    ``sample.metadata["verifiers"]``. A failed episode raises with verifiers' error, which fails the sample;
    except when the session reached the model's context length and refused the harness' next call: then the
    trajectory is a truncated one without a reward (None; the ``env`` reward gives it ``truncated``).
    """
    spec, task = EnvSpec.from_args(env, env_args, python, pythonpath), task_of(sample, task_column)
    try:
        result = await worker_for(spec).call("rollout", task=task, base_url=base_url)
    except WorkerError as exc:
        if await _session_status(base_url) != "truncated":
            raise
        sample.metadata["verifiers"] = {"error": str(exc)}
        return None
    sample.metadata["verifiers"] = result
    return result["reward"]


async def _session_status(base_url: str) -> str | None:
    """The status of the Miles session behind ``base_url`` (``.../sessions/ID/v1``), None if it cannot be read."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http, \
                http.get(base_url.rstrip("/").removesuffix("/v1")) as answer:
            return (await answer.json()).get("status") if answer.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def task_of(sample: Sample, column: str) -> int | str:
    """The task a sample names in its data row."""
    row = sample.metadata.get("data") or {}
    if column not in row:
        raise ValueError(f"the sample's data row has no {column!r} column (task_column): it names the verifiers "
                         f"task, by position (int) or id (str); its columns: {', '.join(map(str, row)) or 'none'}")
    task = row[column]
    if isinstance(task, bool) or not isinstance(task, (int, str)):
        raise ValueError(f"column {column!r}: expected a task position (int) or id (str), got {task!r}")
    return task


def check_rollout_args(args: dict[str, Any]) -> None:
    """Config validation: the arguments are well-formed and the env loads in the verifiers venv."""
    column = args.get("task_column", "task")
    if not isinstance(column, str) or not column:
        raise ValueError(f"task_column: expected the name of a data column, got {column!r}")
    check_spec_args(args)


rollout.check_args = check_rollout_args  # type: ignore[attr-defined]
