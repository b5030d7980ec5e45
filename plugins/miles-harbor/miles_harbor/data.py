"""The ``harbor_tasks`` data generator: one dataset row per Harbor task, for the ``harbor`` env."""

from __future__ import annotations

from typing import Any

from miles_harbor.task import find_tasks

__all__ = ["harbor_tasks"]


def harbor_tasks(seed: int, tasks: str | list[str], eval_tasks: list[str] = ()) -> dict[str, list[dict[str, Any]]]:
    """Rows ``{"prompt": <instruction.md>, "label": <task>, "task": <task>}`` for every task under ``tasks``
    (as the env's ``tasks``), in name order (Miles shuffles); the tasks named in ``eval_tasks`` form the
    eval split. The env reads ``task``; the prompt is the instruction it will give (or the task's name when
    instruction.md is missing: the env then fails that sample with the reason)."""
    found = find_tasks(list(tasks) if not isinstance(tasks, str) else tasks)
    unknown = sorted(set(eval_tasks) - set(found))
    if unknown:
        raise ValueError(f"eval_tasks: {', '.join(unknown)} not among the tasks ({', '.join(sorted(found))})")
    rows = {name: {"prompt": _instruction(path) or name, "label": name, "task": name} for name, path in found.items()}
    train = [row for name, row in sorted(rows.items()) if name not in eval_tasks]
    if not train:
        raise ValueError("eval_tasks: every task is held out for eval; the train split would be empty")
    evals = [rows[name] for name in sorted(eval_tasks)]
    return {"train": train, **({"eval": evals} if evals else {})}


def _instruction(path: Any) -> str:
    try:
        return (path / "instruction.md").read_text().strip()
    except OSError:
        return ""
