"""The shipped example tasks and small task directories written by tests."""

from __future__ import annotations

import json
from pathlib import Path

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
