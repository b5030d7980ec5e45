"""Harbor task directories, read without the harbor package (which needs Python >= 3.12).

A task directory holds ``instruction.md``, ``task.toml``, ``environment/Dockerfile`` (see
:mod:`miles_harbor.dockerfile` for the subset reproduced), ``tests/test.sh`` (the verifier) and
optionally ``solution/solve.sh``. Of ``task.toml`` (Harbor's ``TaskConfig``) these fields are used and
checked; the others are left to Harbor:

- ``[verifier] timeout_sec`` (600) and ``env`` (variables of the verifier run);
- ``[environment] build_timeout_sec`` (600, the limit of each ``RUN`` line), ``workdir`` (overrides
  ``WORKDIR``) and ``env`` (variables of every command); ``${VAR}`` and ``${VAR:-default}`` values are
  read from this process's environment, as Harbor does;
- refused with the reason: ``[[steps]]`` (multi-step tasks), a separate verifier environment,
  ``os`` other than linux, GPUs, and a ``docker-compose.yaml``.

Stdlib only: Harbor's side imports it too.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_harbor.dockerfile import Build, DockerfileError, parse_dockerfile

__all__ = ["HarborTask", "TaskError", "find_tasks", "load_task"]

LOGS_DIR, TESTS_DIR, VERIFIER_DIR = "/logs", "/tests", "/logs/verifier"
_TEMPLATE = re.compile(r"^\$\{([^}:]+)(?::-(.*))?\}$")


class TaskError(ValueError):
    """A task directory that cannot be run; the message names the task, the file and the reason."""


@dataclass
class HarborTask:
    name: str
    path: Path
    instruction: str
    build: Build
    env: dict[str, str] = field(default_factory=dict)  # [environment] env, resolved
    build_timeout_s: float = 600.0
    verifier_timeout_s: float = 600.0
    verifier_env: dict[str, str] = field(default_factory=dict)

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    def mounts(self) -> list[str]:
        """The sandbox's writable folders: where the build writes, the working directory, /logs, /tests."""
        return self.build.mounts(LOGS_DIR, TESTS_DIR)


def find_tasks(tasks: str | os.PathLike | list[str | os.PathLike]) -> dict[str, Path]:
    """Task name (its folder's name) -> folder, for ``tasks``: one or a list of paths, each a task
    directory (it has a ``task.toml`` or an ``instruction.md``) or a folder of them. Raises ValueError
    naming ``tasks`` for a path that is not a directory, one that holds no task, or a name used twice."""
    paths = [tasks] if isinstance(tasks, (str, os.PathLike)) else tasks
    if not isinstance(paths, (list, tuple)) or not paths or not all(isinstance(p, (str, os.PathLike)) for p in paths):
        raise ValueError(f"tasks: expected a directory of Harbor task directories (or a list of them), got {tasks!r}")
    found: dict[str, Path] = {}
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.is_dir():
            raise ValueError(f"tasks: {str(raw)!r} is not a directory (expected a Harbor task directory or a "
                             f"folder of them)")
        here = [path] if _is_task(path) else sorted(p for p in path.iterdir() if p.is_dir() and _is_task(p))
        if not here:
            raise ValueError(f"tasks: {str(raw)!r} holds no Harbor task (folders with a task.toml or instruction.md)")
        for task in here:
            if task.name in found and found[task.name] != task.resolve():
                raise ValueError(f"tasks: two tasks are named {task.name!r}: {found[task.name]} and {task}")
            found[task.name] = task.resolve()
    return found


def _is_task(path: Path) -> bool:
    return (path / "task.toml").is_file() or (path / "instruction.md").is_file()


def load_task(path: Path) -> HarborTask:
    """Read and check the task directory at ``path``; raises :class:`TaskError` with the reason."""
    name = path.name
    config = _read_toml(path, name)
    instruction_path = path / "instruction.md"
    if not instruction_path.is_file():
        raise TaskError(f"task {name!r}: no instruction.md")
    instruction = instruction_path.read_text().strip()
    if not instruction:
        raise TaskError(f"task {name!r}: instruction.md is empty")
    if not (path / "tests" / "test.sh").is_file():
        raise TaskError(f"task {name!r}: no tests/test.sh (the verifier, which writes /logs/verifier/reward.txt)")
    environment = _table(config, "environment", name)
    verifier = _table(config, "verifier", name)
    _refuse_unsupported(config, environment, verifier, path, name)
    try:
        build = parse_dockerfile(path / "environment" / "Dockerfile")
    except DockerfileError as exc:
        raise TaskError(f"task {name!r}: environment/{exc}") from None
    workdir = environment.get("workdir")
    if workdir is not None:
        if not isinstance(workdir, str) or not workdir.startswith("/") or workdir.rstrip("/") == "":
            raise TaskError(f"task {name!r}: task.toml [environment] workdir: expected an absolute path below /, "
                            f"got {workdir!r}")
        build.workdir = workdir.rstrip("/")
    return HarborTask(
        name=name, path=path, instruction=instruction, build=build,
        env=_resolve_env(_strings(environment, "env", "[environment] env", name), name),
        build_timeout_s=_seconds(environment, "build_timeout_sec", 600.0, "[environment]", name),
        verifier_timeout_s=_seconds(verifier, "timeout_sec", 600.0, "[verifier]", name),
        verifier_env=_resolve_env(_strings(verifier, "env", "[verifier] env", name), name))


def _read_toml(path: Path, name: str) -> dict[str, Any]:
    try:
        return tomllib.loads((path / "task.toml").read_text())
    except FileNotFoundError:
        raise TaskError(f"task {name!r}: no task.toml") from None
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"task {name!r}: task.toml is not valid TOML: {exc}") from None


def _refuse_unsupported(config: dict, environment: dict, verifier: dict, path: Path, name: str) -> None:
    if config.get("steps"):
        raise TaskError(f"task {name!r}: multi-step tasks ([[steps]] in task.toml) are not supported")
    if verifier.get("environment_mode", "shared") != "shared" or verifier.get("environment") is not None:
        raise TaskError(f"task {name!r}: a separate verifier environment is not supported (the verifier runs in "
                        f"the trajectory's sandbox)")
    if str(environment.get("os", "linux")).lower() != "linux":
        raise TaskError(f"task {name!r}: task.toml [environment] os = {environment['os']!r}; only linux is supported")
    if environment.get("gpus"):
        raise TaskError(f"task {name!r}: the task asks for {environment['gpus']} GPU(s); the sandbox has none")
    compose = [p.name for p in (path / "environment").glob("docker-compose.y*ml")]
    if compose:
        raise TaskError(f"task {name!r}: environment/{compose[0]} (several containers) is not supported")
    if not (path / "environment" / "Dockerfile").is_file():
        image = environment.get("docker_image")
        raise TaskError(f"task {name!r}: no environment/Dockerfile" +
                        (f" (a prebuilt docker_image, {image!r}, cannot be used without Docker)" if image else ""))


def _table(config: dict[str, Any], key: str, name: str) -> dict[str, Any]:
    value = config.get(key, {})
    if not isinstance(value, dict):
        raise TaskError(f"task {name!r}: task.toml {key}: expected a table ([{key}]), got {value!r}")
    return value


def _seconds(table: dict[str, Any], key: str, default: float, where: str, name: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise TaskError(f"task {name!r}: task.toml {where} {key}: expected a positive number of seconds, got {value!r}")
    return float(value)


def _strings(table: dict[str, Any], key: str, where: str, name: str) -> dict[str, str]:
    value = table.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TaskError(f"task {name!r}: task.toml {where}: expected a table of strings, got {value!r}")
    return value


def _resolve_env(env: dict[str, str], name: str) -> dict[str, str]:
    """Values ``${VAR}`` and ``${VAR:-default}`` read from this process's environment (as Harbor resolves
    them); other values as they are."""
    resolved = {}
    for key, value in env.items():
        match = _TEMPLATE.match(value)
        if match is None:
            resolved[key] = value
        elif match.group(1) in os.environ:
            resolved[key] = os.environ[match.group(1)]
        elif match.group(2) is not None:
            resolved[key] = match.group(2)
        else:
            raise TaskError(f"task {name!r}: task.toml env {key} = {value!r}: {match.group(1)} is not set here")
    return resolved
