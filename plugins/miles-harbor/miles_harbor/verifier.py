"""Running a task's verifier in the trajectory's sandbox and reading its reward, as Harbor does.

The verifier is ``tests/test.sh``, put at ``/tests`` only now (the policy never saw it), run with its
output in ``/logs/verifier/test-stdout.txt``. Whatever the policy left in ``/tests`` and ``/logs/verifier``
(a planted reward file) is removed first. Like
Harbor, ``reward.json`` wins over ``reward.txt``:

- ``reward.txt``: one number, the reward;
- ``reward.json``: a number, the reward; or an object of named numbers, which becomes a dict reward
  (Miles' dict rewards train on ``score`` and log the rest): the entries as they are, and ``score`` is the
  ``reward`` entry (Harbor's headline), else an own ``score`` entry, else the mean of the entries.

A verifier that writes neither file, writes something else, or runs past ``[verifier] timeout_sec`` fails
the sample with that reason.
"""

from __future__ import annotations

import json
import math
from typing import Any

from miles_harbor.dockerfile import tree_of
from miles_harbor.provision import script, tail, write_tree
from miles_harbor.task import TESTS_DIR, VERIFIER_DIR, HarborTask

__all__ = ["VerifierError", "parse_reward", "run_verifier"]

_CLEAN = f"find {TESTS_DIR} -mindepth 1 -delete && rm -rf {VERIFIER_DIR} && mkdir -p {VERIFIER_DIR}"
_RUN = f"(chmod +x {TESTS_DIR}/test.sh && {TESTS_DIR}/test.sh) > {VERIFIER_DIR}/test-stdout.txt 2>&1"
# The first line of its output names what was found: reward.json, reward.txt or none (then the log's end).
_READ = (f"cd {VERIFIER_DIR} || exit 1\n"
         "if [ -f reward.json ]; then echo reward.json; cat reward.json\n"
         "elif [ -f reward.txt ]; then echo reward.txt; cat reward.txt\n"
         "else echo none; tail -c 800 test-stdout.txt 2>/dev/null; fi")


class VerifierError(RuntimeError):
    """The verifier gave no usable reward; the message says why."""


async def run_verifier(sandbox: Any, task: HarborTask, *, dockerfile_env: dict[str, str], env: dict[str, str],
                       cwd: str | None) -> tuple[float | dict[str, float], int | None]:
    """Run ``task``'s tests in ``sandbox``; the reward and test.sh's exit code."""
    cleaned = await sandbox.run(_CLEAN, timeout_s=60)
    if cleaned.exit_code != 0:
        raise VerifierError(f"task {task.name!r}: could not prepare {TESTS_DIR} and {VERIFIER_DIR}: {tail(cleaned)}")
    await write_tree(sandbox, tree_of(task.tests_dir, TESTS_DIR))
    ran = await sandbox.run(script(_RUN, dockerfile_env=dockerfile_env, env={**env, **task.verifier_env}, cwd=cwd),
                            timeout_s=task.verifier_timeout_s)
    if ran.timed_out:
        raise VerifierError(f"task {task.name!r}: tests/test.sh ran past {task.verifier_timeout_s:g} s "
                            f"([verifier] timeout_sec)")
    found = await sandbox.run(_READ, timeout_s=60)
    kind, _, text = found.stdout.partition("\n")
    if kind == "none":
        raise VerifierError(f"task {task.name!r}: the verifier wrote no reward (neither {VERIFIER_DIR}/reward.txt "
                            f"nor reward.json); tests/test.sh exited with code {ran.exit_code}; its output ends: "
                            f"{text.strip()[-800:] or '(nothing)'}")
    return parse_reward(kind, text, task.name), ran.exit_code


def parse_reward(kind: str, text: str, task: str) -> float | dict[str, float]:
    """The reward in a ``reward.txt`` or ``reward.json`` (``kind``) holding ``text``; see the module docs."""
    where = f"task {task!r}: {VERIFIER_DIR}/{kind}"
    if kind == "reward.txt":
        try:
            value = float(text.strip())
        except ValueError:
            raise VerifierError(f"{where} holds {text.strip()[:80]!r}, expected a number") from None
        return _finite(value, where)
    if kind != "reward.json":
        raise VerifierError(f"{where}: unexpected reward file")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise VerifierError(f"{where} is not valid JSON ({exc.msg}): {text.strip()[:80]!r}") from None
    if _number(value):
        return _finite(float(value), where)
    if not isinstance(value, dict) or not value or not all(_number(v) for v in value.values()):
        raise VerifierError(f"{where}: expected a number or an object of named numbers, got {text.strip()[:80]!r}")
    rewards = {str(k): _finite(float(v), f"{where}: {k}") for k, v in value.items()}
    score = rewards.get("reward", rewards.get("score", sum(rewards.values()) / len(rewards)))
    return {**rewards, "score": score}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: float, where: str) -> float:
    if not math.isfinite(value):
        raise VerifierError(f"{where}: the reward {value!r} is not a finite number")
    return value
