"""A verifiers taskset as Miles data: one row per task, naming the task by its position.

    data:
      generator: {name: verifiers_tasks, env: my_taskset, env_args: {...}, eval_tasks: 20}

Each row is ``{"prompt": <the task's prompt text>, "label": <the task's id or key>, "task": <its position>}``.
Miles shows and length-checks the prompt; the rollout itself uses the task (its prompt, tools and rewards), which
the agent and the reward find by the ``task`` column. The last ``eval_tasks`` rows are the held-out split.
"""

from __future__ import annotations

from typing import Any

from miles_verifiers.spec import EnvSpec, check_spec_args, describe_tasks

__all__ = ["verifiers_tasks"]


def verifiers_tasks(seed: int, env: str, env_args: dict[str, Any] | None = None, python: str | None = None,
                    pythonpath: list[str] | None = None, limit: int | None = None,
                    eval_tasks: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Rows for the first ``limit`` tasks (all of a finite taskset when None). ``seed`` is unused: the rows
    follow the taskset's order, and Miles shuffles them (``data.shuffle``)."""
    spec = EnvSpec.from_args(env, env_args, python, pythonpath)
    described = describe_tasks(spec, limit)
    if limit is None and not described["bounded"]:
        raise ValueError(f"limit: the taskset of env {spec.env!r} is infinite; set how many tasks to make rows of")
    rows = [{"prompt": t["prompt"] or f"(task {t['idx']} opens without a prompt)",
             "label": t["id"] or t["key"], "task": t["idx"]} for t in described["tasks"]]
    if eval_tasks >= len(rows):
        raise ValueError(f"eval_tasks: {eval_tasks} of {len(rows)} tasks leaves none to train on")
    cut = len(rows) - eval_tasks
    return {"train": rows[:cut], "eval": rows[cut:]} if eval_tasks else {"train": rows}


def check_generator_args(args: dict[str, Any]) -> None:
    """Config validation: the counts are sensible and the env loads."""
    limit, eval_tasks = args.get("limit"), args.get("eval_tasks", 0)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit: expected a number of tasks >= 1 (or null: all of them), got {limit!r}")
    if isinstance(eval_tasks, bool) or not isinstance(eval_tasks, int) or eval_tasks < 0:
        raise ValueError(f"eval_tasks: expected a number of held-out tasks >= 0, got {eval_tasks!r}")
    check_spec_args(args)


verifiers_tasks.check_args = check_generator_args  # type: ignore[attr-defined]
