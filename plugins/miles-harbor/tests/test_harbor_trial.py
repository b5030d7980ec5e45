"""Harbor's own trials (the real harbor package, in a Python 3.12 venv of its own) on
:class:`miles_harbor.harbor_environment.MilesSandboxEnvironment`: the ``oracle`` agent runs each shipped
task's solution/solve.sh, Harbor's verifier runs tests/test.sh and reads the reward; the ``nop`` agent
does nothing and gets 0; a task the environment cannot build is refused with the reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from harbor_testing import PLUGIN, TASKS, harbor_venv, write_task

HOST = "miles_harbor.sandbox_host"


@pytest.fixture(scope="session")
def harbor_python() -> str:
    """The Python of a venv holding the pinned harbor, built once under the venv cache and reused."""
    python = harbor_venv()
    if python is None:
        pytest.skip("Harbor needs Python >= 3.12 and none was found (set MILES_HARBOR_PYTHON, or install "
                    "python3.12); see the README")
    return python


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
