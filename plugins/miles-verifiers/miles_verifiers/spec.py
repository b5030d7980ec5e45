"""Which verifiers env to run, as the config gives it, and the check that it loads.

Every component of this plugin (the agent, the reward, the data generator) takes the same arguments:

- ``env``: a verifiers taskset id (the importable name of a taskset package, e.g. ``alphabet_sort``), or the
  import path ``package.module:function`` of a function returning a ``verifiers.v1.Env``;
- ``env_args``: for a taskset id, the rest of verifiers' ``[env]`` config (``agent: {harness: {id: null},
  runtime: {type: subprocess}}``, ``taskset: {...}`` knobs, ``id`` of a paired Env); for a function, its
  keyword arguments;
- ``python``: the interpreter of the verifiers venv (default: the one ``python -m miles_verifiers`` builds);
- ``pythonpath``: folders to import the env's modules from, in the worker (and its tool servers).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_verifiers.venv import venv_python

__all__ = ["EnvSpec", "check_spec_args", "describe_tasks", "WORKER_DIR"]

WORKER_DIR = Path(__file__).resolve().parent / "worker"
PARENT_ENV = "MILES_VERIFIERS_PARENT"
DESCRIBE_TIMEOUT_S = 600.0  # a safety net for loading the env; importing verifiers alone takes seconds


@dataclass(frozen=True)
class EnvSpec:
    env: str
    env_args_json: str  # the env_args, as canonical JSON (hashable; what the worker gets)
    python: str
    pythonpath: tuple[str, ...]

    @classmethod
    def from_args(cls, env: Any, env_args: Any = None, python: Any = None, pythonpath: Any = None) -> EnvSpec:
        """The spec for the config's arguments; a ValueError names the argument that is wrong."""
        if not isinstance(env, str) or not env.strip():
            raise ValueError(f"env: expected a verifiers taskset id or an import path 'package.module:function' "
                             f"returning a verifiers Env, got {env!r}")
        if env_args is None:
            env_args = {}
        if not isinstance(env_args, Mapping):
            raise ValueError(f"env_args: expected a mapping (the env's arguments), got {type(env_args).__name__}")
        try:
            args_json = json.dumps(_plain(env_args), sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"env_args: expected JSON-like values (they go to the verifiers worker): {exc}") from None
        if python is not None and not isinstance(python, str):
            raise ValueError(f"python: expected the path of the verifiers venv's interpreter, got {python!r}")
        interpreter = python or str(venv_python())
        if not os.access(interpreter, os.X_OK):
            hint = "" if python else " (build it with `python -m miles_verifiers`)"
            raise ValueError(f"python: the verifiers venv's interpreter {interpreter} does not exist{hint}")
        if pythonpath is None:
            pythonpath = ()
        if isinstance(pythonpath, str) or not isinstance(pythonpath, Sequence) \
                or not all(isinstance(p, str) for p in pythonpath):
            raise ValueError(f"pythonpath: expected a list of folders, got {pythonpath!r}")
        absent = [p for p in pythonpath if not Path(p).is_dir()]
        if absent:
            raise ValueError(f"pythonpath: {', '.join(absent)} is not a folder")
        return cls(env.strip(), args_json, interpreter, tuple(str(Path(p).resolve()) for p in pythonpath))

    @property
    def wire(self) -> str:
        """The spec as the worker's ``--spec`` argument."""
        return json.dumps({"env": self.env, "env_args": json.loads(self.env_args_json)})

    def command(self, mode: str, *extra: str) -> list[str]:
        return [self.python, str(WORKER_DIR), mode, "--spec", self.wire, *extra]

    def environ(self) -> dict[str, str]:
        """The worker's environment: Miles' own, without its Python path settings, plus ``pythonpath`` and
        ``MILES_VERIFIERS_PARENT`` (this process' id, inherited by everything the worker starts, so that what
        a run started can be found)."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env[PARENT_ENV] = str(os.getpid())
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(self.pythonpath)
        return env


def _plain(value: Any) -> Any:
    """Mappings and sequences of a config (OmegaConf's included) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


_described: dict[tuple[EnvSpec, int | None], dict[str, Any]] = {}


def describe_tasks(spec: EnvSpec, limit: int | None = None) -> dict[str, Any]:
    """Load the env in a one-off worker and list its first ``limit`` tasks (without a limit: all tasks of a finite
    taskset, the first of an infinite one), with ``bounded``. Cached per spec in this process, so that the config
    check and the data generator load the env once. A ValueError says why the env does not load."""
    whole = _described.get((spec, None))
    if whole is not None and whole["bounded"]:
        return {**whole, "tasks": whole["tasks"][:limit]}
    if (spec, limit) not in _described:
        try:
            done = subprocess.run(spec.command("describe", *(["--limit", str(limit)] if limit is not None else [])),
                                  env=spec.environ(), capture_output=True, text=True, timeout=DESCRIBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ValueError(f"env {spec.env!r}: loading it took more than {DESCRIBE_TIMEOUT_S:.0f} s") from None
        lines = done.stdout.strip().splitlines()
        answer = json.loads(lines[-1]) if lines else {"error": f"the worker exited with {done.returncode}: "
                                                               f"{done.stderr.strip()[-2000:]}"}
        if "error" in answer:
            raise ValueError(f"env {spec.env!r} does not load: {answer['error']}")
        _described[(spec, limit)] = answer
    return _described[(spec, limit)]


def check_spec_args(args: Mapping[str, Any]) -> EnvSpec:
    """The config check every component runs on its env arguments: they are well-formed, and the env loads in
    the verifiers venv and has a task."""
    spec = EnvSpec.from_args(args.get("env"), args.get("env_args"), args.get("python"), args.get("pythonpath"))
    if not describe_tasks(spec)["tasks"]:
        raise ValueError(f"env {spec.env!r}: its taskset has no tasks")
    return spec
