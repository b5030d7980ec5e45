"""A verifiers taskset's rewards as a Miles reward, for single-turn runs.

    reward: {name: verifiers, env: my_taskset, env_args: {...}}

Each sample is scored by the rewards of the task its data row names (``task_column``), on a trace made of the
sample's prompt and its response as the one sampled reply; rewards that need a runtime (a sandbox) are skipped.
Multi-turn verifiers envs run as agents instead (:mod:`miles_verifiers.agent`).
"""

from __future__ import annotations

from typing import Any

from miles import Sample
from miles_verifiers.agent import check_rollout_args, task_of
from miles_verifiers.client import worker_for
from miles_verifiers.spec import EnvSpec

__all__ = ["VerifiersReward"]


class VerifiersReward:
    """Registered as reward ``verifiers``. The sum of the task's weighted rewards (verifiers' trace reward)."""

    def __init__(self, env: str, env_args: dict[str, Any] | None = None, task_column: str = "task",
                 python: str | None = None, pythonpath: list[str] | None = None) -> None:
        self.spec = EnvSpec.from_args(env, env_args, python, pythonpath)
        self.task_column = task_column

    check_args = staticmethod(check_rollout_args)

    async def __call__(self, sample: Sample) -> float:
        task = task_of(sample, self.task_column)
        result = await worker_for(self.spec).call("score", task=task, prompt=sample.prompt,
                                                   reply=sample.response_text)
        sample.metadata["verifiers"] = result
        return result["reward"]
