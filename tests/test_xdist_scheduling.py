"""The root conftest's xdist scheduler (the tests that start Ray take turns) on a worker that dies mid-test: the run
goes on with a replacement, the test is reported failed once and named, every other test runs, and the run ends
(xdist 3.8.0's own scope scheduler hung there: a CI run waited until it was stopped)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_worker_that_dies_fails_its_test_once_and_the_run_ends(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('miles_root_conftest', {str(ROOT / 'conftest.py')!r})\n"
        "root = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(root)\n"
        "pytest_xdist_make_scheduler, pytest_handlecrashitem = root.pytest_xdist_make_scheduler, "
        "root.pytest_handlecrashitem\n")
    (tmp_path / "test_dies.py").write_text(
        "import os\nimport pytest\n\n\n@pytest.mark.parametrize('i', range(12))\ndef test_one(i):\n"
        "    if i in (3, 11):\n        os._exit(1)  # the worker dies, as a SIGKILL or a native abort would do it\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not Miles' own settings
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)  # a hang: the failure it guards
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "2 failed, 10 passed" in out
    assert out.count("node down") == 2  # each of the two tests killed one worker: neither ran again
    for i in (3, 11):
        assert f"miles tests: a worker died while running test_dies.py::test_one[{i}]" in out
