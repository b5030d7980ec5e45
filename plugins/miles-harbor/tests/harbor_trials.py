"""Run Harbor trials on the Miles sandbox environment; run by the tests with Harbor's own Python.

    python harbor_trials.py TRIALS_DIR ENVIRONMENT_KWARGS_JSON TASK_DIR:AGENT ...

Prints one JSON object: for each ``TASK_DIR:AGENT``, the rewards Harbor's verifier read (or null) and
the exception the trial recorded or raised (or null). The trials run at once.
"""

import asyncio
import json
import sys

from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
from harbor.trial.trial import Trial

IMPORT_PATH = "miles_harbor.harbor_environment:MilesSandboxEnvironment"


async def trial(trials_dir: str, kwargs: dict, task_dir: str, agent: str) -> dict:
    config = TrialConfig(
        task=TaskConfig(path=task_dir), trials_dir=trials_dir, agent=AgentConfig(name=agent),
        environment=EnvironmentConfig(import_path=IMPORT_PATH, kwargs=kwargs))
    try:
        result = await (await Trial.create(config)).run()
    except Exception as exc:  # a task the environment refuses is refused when the trial is made
        return {"rewards": None, "exception": f"{type(exc).__name__}: {exc}"}
    error = result.exception_info
    return {"rewards": result.verifier_result.rewards if result.verifier_result else None,
            "exception": f"{error.exception_type}: {error.exception_message}" if error else None}


async def main(trials_dir: str, kwargs: str, *runs: str) -> None:
    pairs = [run.rsplit(":", 1) for run in runs]
    results = await asyncio.gather(*(trial(trials_dir, json.loads(kwargs), task, agent) for task, agent in pairs))
    print(json.dumps({run: result for run, result in zip(runs, results)}))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
