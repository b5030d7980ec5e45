"""The shipped example tasks, small task directories written by tests, and the venv that runs Harbor itself.

Run as a script, it builds that venv (CI starts it early, in the background, so no test worker waits for it).
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1]
PIN = next(dep for dep in tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]["optional-dependencies"]
           ["harbor"] if dep.startswith("harbor=="))
REQUIREMENT = PIN.split(";")[0].strip()  # harbor==X.Y.Z

TASKS = Path(__file__).resolve().parents[1] / "tasks"
NAMES = ("fix-bug", "create-file", "partial-credit")
FULL = {"fix-bug": 1.0, "create-file": 1.0, "partial-credit": {"reward": 1.0, "rows": 1.0, "total": 1.0, "score": 1.0}}

TOML = """schema_version = "1.4"

[verifier]
timeout_sec = 30.0
"""


def solution(name: str) -> str:
    return (TASKS / name / "solution" / "solve.sh").read_text()


def bash_call(command: str) -> str:
    """A policy turn that calls the bash tool (the hermes format)."""
    return "<tool_call>" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "</tool_call>"


def write_task(root: Path, name: str, *, dockerfile: str = "FROM ubuntu:24.04\nWORKDIR /app\n",
               test: str | None = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n", toml: str | None = TOML,
               instruction: str = "Do the thing.", files: dict[str, str] | None = None) -> Path:
    """A task directory ``root/name``; ``test`` / ``toml`` None leave tests/test.sh / task.toml out."""
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "instruction.md").write_text(instruction)
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    for path, text in (files or {}).items():
        (task / path).parent.mkdir(parents=True, exist_ok=True)
        (task / path).write_text(text)
    if toml is not None:
        (task / "task.toml").write_text(toml)
    if test is not None:
        (task / "tests").mkdir()
        (task / "tests" / "test.sh").write_text(test)
    return task


def python312() -> str | None:
    """A working Python >= 3.12 for Harbor: $MILES_HARBOR_PYTHON, pyenv's, or python3.12/3.13 on PATH."""
    found = [os.environ.get("MILES_HARBOR_PYTHON"),
             *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[23]*/bin/python"))),
             shutil.which("python3.12"), shutil.which("python3.13")]
    for python in filter(None, found):
        check = [python, "-c", "import sys; sys.exit(sys.version_info < (3, 12))"]
        if subprocess.run(check, capture_output=True, timeout=60).returncode == 0:  # a pyenv shim may not run
            return python
    return None


def harbor_venv() -> str | None:
    """The Python of a venv holding the pinned harbor, built once under ${MILES_VENV_CACHE:-~/.cache/miles/venvs}
    and reused; None when no Python >= 3.12 is found."""
    base = python312()
    if base is None:
        return None
    cache = Path(os.environ.get("MILES_VENV_CACHE", "~/.cache/miles/venvs")).expanduser()
    venv = cache / REQUIREMENT.replace("==", "-")
    ready = venv / ".miles-ready"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others wait, then reuse it
        if not ready.exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", REQUIREMENT],
                           check=True, timeout=1800)
            ready.write_text(REQUIREMENT + "\n")
    return str(venv / "bin" / "python")


if __name__ == "__main__":
    print(harbor_venv() or "no Python >= 3.12: the Harbor tests will be skipped")
