"""The verifiers venv: where verifiers runs, apart from Miles.

verifiers 0.4.0 requires ``openai>=2.54,<3`` and Miles pins ``openai==3.57.0`` (its ``test`` extra; the session
server's clients), so verifiers cannot share Miles' environment. It gets a venv of its own under
``${MILES_VENV_CACHE:-~/.cache/miles/venvs}/verifiers-<version>``, built once with the pinned requirement
(the ``worker`` extra of this plugin's metadata) and reused; the worker process runs there.

    python -m miles_verifiers                      # build it (idempotent), print its interpreter
    python -m miles_verifiers --with my-taskset    # also install packages your envs need
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import os
import shutil
import subprocess
import sys
import time
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

__all__ = ["requirements", "venv_dir", "venv_python", "ensure_venv"]

DISTRIBUTION = "miles-verifiers"
EXTRA = "worker"
COMPLETE = ".miles-complete"  # written last: a venv without it was interrupted and is rebuilt


@functools.cache
def requirements() -> tuple[str, ...]:
    """What the venv holds: the ``worker`` extra of this plugin's metadata (``verifiers==0.4.0``)."""
    found = tuple(str(r).split(";")[0].strip() for r in map(Requirement, requires(DISTRIBUTION) or [])
                  if r.marker is not None and r.marker.evaluate({"extra": EXTRA}))
    if not found:
        raise RuntimeError(f"{DISTRIBUTION} declares no '{EXTRA}' requirements; reinstall the plugin")
    return found


def venv_dir() -> Path:
    """``${MILES_VENV_CACHE:-~/.cache/miles/venvs}/verifiers-<pinned version>``."""
    pinned = next(r for r in map(Requirement, requirements()) if r.name == "verifiers")
    version = str(pinned.specifier).removeprefix("==")
    return Path(os.environ.get("MILES_VENV_CACHE") or "~/.cache/miles/venvs").expanduser() / f"verifiers-{version}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def ensure_venv(extra: list[str] | tuple[str, ...] = ()) -> Path:
    """Build the venv unless a complete one is there, install ``extra`` packages into it, and return its
    interpreter. Concurrent callers (pytest workers, CI jobs sharing the cache) wait for one build."""
    root = venv_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / COMPLETE).is_file():
            shutil.rmtree(root, ignore_errors=True)
            started = time.perf_counter()
            print(f"miles-verifiers: building verifiers' venv at {root} (once; a few minutes) ...", file=sys.stderr,
                  flush=True)
            _run([sys.executable, "-m", "venv", str(root)])
            _pip(root, list(requirements()))
            (root / COMPLETE).write_text("\n".join(requirements()) + "\n")
            print(f"miles-verifiers: verifiers' venv built in {time.perf_counter() - started:.0f} s", file=sys.stderr,
                  flush=True)
        if extra:
            _pip(root, list(extra))
    return root / "bin" / "python"


def _pip(root: Path, packages: list[str]) -> None:
    _run([str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", *packages])


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles_verifiers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--with", dest="extra", action="append", default=[], metavar="PACKAGE",
                        help="a pip requirement to install too (repeatable), e.g. the package of your taskset")
    args = parser.parse_args(argv)
    print(ensure_venv(args.extra))
