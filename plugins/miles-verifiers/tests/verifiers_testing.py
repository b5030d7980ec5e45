"""Helpers of the miles-verifiers tests: where the verifiers env of the tests lives, and what the verifiers
workers of a process started."""

from __future__ import annotations

from pathlib import Path

ENVS = Path(__file__).parent / "envs"  # verifiers code, imported by the worker only (it runs in the verifiers venv)


def started_by(pid: int) -> list[str]:
    """The live processes the verifiers workers of process ``pid`` started (the workers included): they carry
    ``MILES_VERIFIERS_PARENT=<pid>`` in their environment."""
    marker = f"\0MILES_VERIFIERS_PARENT={pid}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environ = b"\0" + (entry / "environ").read_bytes()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z" and marker in environ:
            found.append(f"{entry.name}: {command[:200]}")
    return found
