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


class _Worker:
    """What the scheduler uses of an xdist worker: its id, the tests it is sent, and its shutdown."""

    def __init__(self, name: str) -> None:
        self.gateway = type("Gateway", (), {"id": name})()
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def test_a_replacement_still_collecting_is_skipped_when_another_finishes(tmp_path):
    """Two workers dead at once: their replacements collect, and the first to finish makes the scheduler hand out
    work while the other has no collection yet (xdist 3.8.0 raised KeyError there, an INTERNALERROR in CI). It gets
    its share once its collection comes."""
    import importlib.util

    import pytest

    spec = importlib.util.spec_from_file_location("miles_root_conftest", ROOT / "conftest.py")
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    config = pytest.Config.fromdictargs({"tx": ["2*popen"], "dist": "loadscope"}, [])
    sched = root.pytest_xdist_make_scheduler(config, None)
    collection = [f"test_{i}.py::test" for i in range(8)]
    first, second = _Worker("gw0"), _Worker("gw1")
    for node in (first, second):
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    assert first.sent and second.sent
    for node, done in ((first, first.sent[0]), (second, second.sent[0])):
        sched.mark_test_complete(node, done)
    assert sched.remove_node(first) and sched.remove_node(second)  # both died, each in its second test
    third, fourth = _Worker("gw2"), _Worker("gw3")
    sched.add_node(third)
    sched.add_node(fourth)
    sched.add_node_collection(fourth, collection)
    sched.schedule()  # gw2 has no collection yet
    assert fourth.sent and not third.sent
    sched.add_node_collection(third, collection)
    sched.schedule()
    assert third.sent
