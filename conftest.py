"""Shared by every test folder: the tests that start Ray instances take turns.

With ``pytest -n 2`` (pytest-xdist) every test that starts Ray (the files and folders below, and the tests named in the
files of ``STARTS_RAY_IN_PART``) runs on one worker, in order, while the other workers run everything else
(:func:`pytest_xdist_make_scheduler`). A run joins the Ray instance its process already has, so a test module
that leaves one running is stopped here too. A worker that dies is replaced; its test fails, named at once, and
is not run again.
"""

import sys

import pytest

STARTS_RAY = {
    "tests/test_debug_modes.py", "tests/test_engine_chaos.py", "tests/test_fleet.py", "tests/test_gpu_check.py",
    "tests/test_lora.py", "tests/test_multi_node.py", "tests/test_ray_plane.py", "tests/test_schedules_ray.py",
    "tests/test_startup.py", "tests/test_true_on_policy.py",
    "plugins/miles-megatron/tests/test_megatron_backend.py", "plugins/miles-megatron/tests/test_megatron_parallel.py",
}
# Every module of these folders starts Ray (their conftest gives each a Ray instance), new ones too.
STARTS_RAY_FOLDERS = ("plugins/miles-fsdp2/tests/",)
# In these files only the tests named start Ray (the rest launch servers as plain processes, or fail at config).
STARTS_RAY_IN_PART = {
    "plugins/miles-sglang/tests/test_sglang_launcher.py": (
        "test_server_killed_restarts_its_actor_and_is_caught_up",
        "test_quickstart_with_a_server_per_engine_and_memory_released_during_training",
        "test_an_engine_reserves_a_gpu_per_tensor_parallel_rank"),
}


def starts_ray(nodeid: str) -> bool:
    path, _, test = nodeid.partition("::")
    return (path in STARTS_RAY or path.startswith(STARTS_RAY_FOLDERS)
            or test.split("[", 1)[0] in STARTS_RAY_IN_PART.get(path, ()))


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with one scope for every test that starts Ray, and one per test otherwise."""
    from xdist.scheduler import LoadScopeScheduling

    class RayTakesTurns(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if starts_ray(nodeid) else nodeid

        def remove_node(self, node):
            """xdist 3.8.0's, less two faults (pytest-xdist issues 1323 and 1371): a crashed worker's finished units
            went back to the queue, and the worker sent one of them waited for its tests for ever (the whole run
            hung); and the test that crashed the worker ran again, on its replacement."""
            workload = self.assigned_work.pop(node)
            pending = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
            if not pending:
                return None
            crashitem = next(nodeid for unit in pending.values() for nodeid, done in unit.items() if not done)
            for scope, unit in pending.items():
                unit.pop(crashitem, None)  # reported failed by xdist; not run again
                if not all(unit.values()):
                    self.workqueue[scope] = unit
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

        def _reschedule(self, node):
            """Not before the worker's collection came: a worker that replaced a dead one may still be collecting
            when another finishes (xdist 3.8.0 raised KeyError there: two workers dead at once, CI)."""
            if node in self.registered_collections:
                super()._reschedule(node)

    return RayTakesTurns(config, log)


def pytest_handlecrashitem(crashitem, report, sched):
    """A test worker died: its test is named at once (xdist names it only in the session's summary)."""
    sys.stderr.write(f"\nmiles tests: a worker died while running {crashitem}\n")


@pytest.fixture(scope="module", autouse=True)
def _no_ray_left_running():
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
