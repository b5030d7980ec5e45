"""The NeMo Gym venv: ``nemo-gym`` needs Python >= 3.12 while Miles runs on 3.11, so its servers run in a venv
of their own, built once under ``${MILES_VENV_CACHE:-~/.cache/miles/venvs}/nemo-gym-<version>`` with the version
this plugin pins (its ``server`` extra in pyproject.toml is the one place the pin is written).

The interpreter is ``$MILES_NEMO_GYM_PYTHON`` when set, else the first Python >= 3.12 found among ``python3.12``,
``python3.13`` on ``PATH`` and pyenv's versions. A build is atomic for its readers: it happens under a lock, and
the venv counts as built only once its marker file is written last.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

__all__ = ["PYTHON_ENV", "nemo_gym_requirement", "find_python", "venv_dir", "venv_python", "is_built", "ensure_venv"]

PYTHON_ENV = "MILES_NEMO_GYM_PYTHON"
_MARKER = ".miles-venv-complete"
_PYENV_VERSIONS = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"


def nemo_gym_requirement() -> str:
    """The pinned requirement, e.g. ``nemo-gym==0.4.0``, as this package's metadata declares it."""
    for requirement in metadata.requires("miles-nemo-gym") or []:
        match = re.match(r"\s*nemo-gym\s*==\s*([\w.]+)", requirement)
        if match:
            return f"nemo-gym=={match.group(1)}"
    raise RuntimeError("miles-nemo-gym's metadata declares no nemo-gym pin; reinstall it (pip install -e ...)")


def _version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out[0]), int(out[1])


def find_python() -> str | None:
    """A Python >= 3.12 for the venv (see the module's docstring), or None when there is none."""
    explicit = os.environ.get(PYTHON_ENV)
    if explicit:
        return explicit
    candidates = [shutil.which(name) for name in ("python3.12", "python3.13")]
    if _PYENV_VERSIONS.is_dir():
        candidates += [str(p / "bin" / "python") for p in sorted(_PYENV_VERSIONS.iterdir())
                       if re.match(r"3\.1[2-9]\.\d+$", p.name)]
    for candidate in filter(None, candidates):
        version = _version(candidate)
        if version is not None and version >= (3, 12):
            return candidate
    return None


def venv_dir() -> Path:
    """Where the venv of the pinned version lives."""
    cache = Path(os.environ.get("MILES_VENV_CACHE") or Path.home() / ".cache" / "miles" / "venvs")
    return cache.expanduser() / nemo_gym_requirement().replace("==", "-")


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def is_built() -> bool:
    return (venv_dir() / _MARKER).is_file()


def ensure_venv(python: str | None = None, *, quiet: bool = True) -> Path:
    """The venv's interpreter, building the venv first when it is not built yet (a few minutes, once)."""
    target = venv_dir()
    if is_built():
        return venv_python()
    python = python or find_python()
    if python is None:
        raise RuntimeError(f"NeMo Gym needs Python >= 3.12 and none was found: set {PYTHON_ENV} to one "
                           f"(e.g. {PYTHON_ENV}=/usr/bin/python3.12)")
    version = _version(python)
    if version is None or version < (3, 12):
        raise RuntimeError(f"{python}: NeMo Gym needs Python >= 3.12, this is "
                           f"{'.'.join(map(str, version)) if version else 'not a working Python'}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then use its venv
        if not (target / _MARKER).is_file():
            shutil.rmtree(target, ignore_errors=True)  # a build that was interrupted
            started = time.perf_counter()
            print(f"miles-nemo-gym: building NeMo Gym's venv at {target} (once; a few minutes) ...", file=sys.stderr,
                  flush=True)
            output = subprocess.DEVNULL if quiet else None
            subprocess.run([python, "-m", "venv", str(target)], check=True, stdout=output)
            subprocess.run([str(target / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                            *(["--quiet"] if quiet else []), nemo_gym_requirement()], check=True, stdout=output)
            (target / _MARKER).write_text(nemo_gym_requirement() + "\n")
            print(f"miles-nemo-gym: NeMo Gym's venv built in {time.perf_counter() - started:.0f} s", file=sys.stderr,
                  flush=True)
    return venv_python()
