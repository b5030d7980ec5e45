"""Setting a task up in a sandbox, and the shell script every command is wrapped in.

Works with anything that keeps Miles' sandbox protocol, ``await run(command, *, timeout_s, files=None)``
returning ``stdout``, ``stderr``, ``exit_code`` and ``timed_out``: a Miles sandbox in the ``harbor`` env,
the sandbox client on Harbor's side. ``files`` are absolute paths inside the sandbox's mounts.

Stdlib only: Harbor's side imports it too.
"""

from __future__ import annotations

import shlex
from typing import Any

from miles_harbor.dockerfile import Build, Files, Tree

__all__ = ["SetupError", "provision", "script", "tail", "write_tree"]

TAIL_CHARS = 800


class SetupError(RuntimeError):
    """The task's build did not run in the sandbox (a ``RUN`` line failed, or files could not be put)."""


def script(command: str, *, dockerfile_env: dict[str, str] | None = None, env: dict[str, str] | None = None,
           cwd: str | None = None) -> str:
    """``command`` after exporting the variables and changing to ``cwd``. ``dockerfile_env`` values are
    expanded by the shell (``PATH=/opt/bin:$PATH``, as Docker expands them); ``env`` values are literal."""
    lines = [f'export {key}="{_double_quoted(value)}"' for key, value in (dockerfile_env or {}).items()]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in (env or {}).items()]
    if cwd:
        lines.append(f"cd -- {shlex.quote(cwd)} || exit 1")
    return "\n".join([*lines, command])


def _double_quoted(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")


def _tree_command(tree: Tree) -> list[str]:
    lines = [f"mkdir -p -- {shlex.join(tree.dirs)} || exit 1"] if tree.dirs else []
    if tree.executables:
        lines.append(f"chmod +x -- {shlex.join(tree.executables)} || exit 1")
    return lines


def _files(tree: Tree) -> dict[str, bytes]:
    return {dest: source.read_bytes() for dest, source in tree.files.items()}


def tail(result: Any) -> str:
    """The end of a run's output (stderr, else stdout), for an error message."""
    text = (result.stderr or result.stdout or "").strip()
    return ("..." + text[-TAIL_CHARS:]) if len(text) > TAIL_CHARS else text or "(no output)"


async def write_tree(sandbox: Any, tree: Tree, *, timeout_s: float = 60.0) -> None:
    """Put ``tree``'s files and folders in the sandbox (executables marked so)."""
    result = await sandbox.run("\n".join([*_tree_command(tree), ":"]), timeout_s=timeout_s, files=_files(tree))
    if result.timed_out or result.exit_code != 0:
        raise SetupError(f"could not put files in the sandbox: {tail(result)}")


async def provision(sandbox: Any, build: Build, *, timeout_s: float, env: dict[str, str] | None = None) -> None:
    """Do what the Dockerfile does, in order: files are put in place, each ``RUN`` line runs (within
    ``timeout_s``) with the variables of its point in the file and ``env``. Raises :class:`SetupError`
    naming the line that failed and its output."""
    pending = Tree()
    for step in build.steps:
        if isinstance(step, Files):
            pending.update(step.tree)
            continue
        command = "\n".join([*_tree_command(pending),
                             script(step.command, dockerfile_env=step.env, env=env, cwd=step.workdir)])
        result = await sandbox.run(command, timeout_s=timeout_s, files=_files(pending))
        pending = Tree()
        if result.timed_out:
            raise SetupError(f"Dockerfile line {step.line}: RUN {_short(step.command)} ran past {timeout_s:g} s "
                             f"([environment] build_timeout_sec)")
        if result.exit_code != 0:
            raise SetupError(f"Dockerfile line {step.line}: RUN {_short(step.command)} exited with code "
                             f"{result.exit_code} (RUN lines run in the sandbox: no network, read-only system "
                             f"folders): {tail(result)}")
    if pending.files or pending.dirs:
        await write_tree(sandbox, pending, timeout_s=timeout_s)


def _short(command: str, limit: int = 80) -> str:
    command = " ".join(command.split())
    return repr(command if len(command) <= limit else command[:limit] + "...")
