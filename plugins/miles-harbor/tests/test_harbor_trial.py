"""Harbor's own trials (the real harbor package, in a Python 3.12 venv of its own) on
:class:`miles_harbor.harbor_environment.MilesSandboxEnvironment`: the ``oracle`` agent runs each shipped
task's solution/solve.sh, Harbor's verifier runs tests/test.sh and reads the reward; the ``nop`` agent
does nothing and gets 0; a task the environment cannot build is refused with the reason."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from harbor_testing import TASKS, write_task

PLUGIN = Path(__file__).resolve().parents[1]
PIN = next(dep for dep in tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]["optional-dependencies"]
           ["harbor"] if dep.startswith("harbor=="))
REQUIREMENT = PIN.split(";")[0].strip()  # harbor==X.Y.Z
HOST = "miles_harbor.sandbox_host"


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


@pytest.fixture(scope="session")
def harbor_python() -> str:
    """The Python of a venv holding the pinned harbor, built once under the venv cache and reused."""
    base = python312()
    if base is None:
        pytest.skip("Harbor needs Python >= 3.12 and none was found (set MILES_HARBOR_PYTHON, or install "
                    "python3.12); see the README")
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


def host_processes() -> list[int]:
    """Running sandbox hosts (any left after their trials would be a leak)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and HOST in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_harbor_trials_run_on_the_miles_sandbox(harbor_python: str, tmp_path: Path) -> None:
    broken = write_task(tmp_path / "tasks", "needs-shell", dockerfile='FROM ubuntu\nSHELL ["/bin/bash", "-c"]\n')
    workspaces = Path(tempfile.mkdtemp(prefix="miles-harbor-ws-"))
    workspaces.chmod(0o755)  # reachable by uid nobody, who runs the commands when the tests run as root
    kwargs = {"miles_python": sys.executable, "sandbox": {"workspace_root": str(workspaces)}}
    runs = [f"{TASKS / 'fix-bug'}:oracle", f"{TASKS / 'create-file'}:oracle", f"{TASKS / 'partial-credit'}:oracle",
            f"{TASKS / 'fix-bug'}:nop", f"{broken}:oracle"]
    before = host_processes()
    try:
        done = subprocess.run([harbor_python, str(Path(__file__).parent / "harbor_trials.py"), str(tmp_path / "trials"),
                               json.dumps(kwargs), *runs], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(PLUGIN)})
        assert done.returncode == 0, done.stderr[-4000:]
        results = json.loads(done.stdout.strip().splitlines()[-1])
        assert [results[run] for run in runs[:4]] == [
            {"rewards": {"reward": 1.0}, "exception": None},
            {"rewards": {"reward": 1.0}, "exception": None},
            {"rewards": {"reward": 1.0, "rows": 1.0, "total": 1.0}, "exception": None},
            {"rewards": {"reward": 0.0}, "exception": None}]
        assert results[runs[4]]["rewards"] is None
        assert "Dockerfile line 2: SHELL is not supported" in results[runs[4]]["exception"]
        oracle_logs = list((tmp_path / "trials").glob("fix-bug__*/verifier/test-stdout.txt"))
        assert oracle_logs and all("Ran 3 tests" in log.read_text() for log in oracle_logs)  # downloaded by Harbor
        assert set(host_processes()) <= set(before), "a sandbox host outlived its trial"
        assert list(workspaces.iterdir()) == [], "a sandbox workspace was left behind"
    finally:
        shutil.rmtree(workspaces, ignore_errors=True)
