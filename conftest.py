"""Shared by every test folder: the tests that start Ray instances take turns.

With ``pytest -n 2`` (pytest-xdist) every test that starts Ray (the files below, and the tests named in the
files of ``STARTS_RAY_IN_PART``) runs on one worker, in order, while the other workers run everything else
(:func:`pytest_xdist_make_scheduler`). A run joins the Ray instance its process already has, so a test module
that leaves one running is stopped here too.
"""

import sys

import pytest

STARTS_RAY = {
    "tests/test_debug_modes.py", "tests/test_engine_chaos.py", "tests/test_gpu_check.py", "tests/test_lora.py",
    "tests/test_multi_node.py", "tests/test_ray_plane.py", "tests/test_schedules_ray.py", "tests/test_startup.py",
    "tests/test_true_on_policy.py",
    "plugins/miles-fsdp2/tests/test_fsdp2.py", "plugins/miles-fsdp2/tests/test_fsdp2_chunked_logprobs.py",
    "plugins/miles-fsdp2/tests/test_fsdp2_lora.py", "plugins/miles-megatron/tests/test_megatron_backend.py",
    "plugins/miles-megatron/tests/test_megatron_parallel.py",
}
# In these files only the tests named start Ray (the rest launch servers as plain processes, or fail at config).
STARTS_RAY_IN_PART = {
    "plugins/miles-sglang/tests/test_sglang_launcher.py": (
        "test_server_killed_restarts_its_actor_and_is_caught_up",
        "test_quickstart_with_a_server_per_engine_and_memory_released_during_training",
        "test_an_engine_reserves_a_gpu_per_tensor_parallel_rank"),
}


def starts_ray(nodeid: str) -> bool:
    path, _, test = nodeid.partition("::")
    return path in STARTS_RAY or test.split("[", 1)[0] in STARTS_RAY_IN_PART.get(path, ())


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with one scope for every test that starts Ray, and one per test otherwise."""
    from xdist.scheduler import LoadScopeScheduling

    class RayTakesTurns(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if starts_ray(nodeid) else nodeid

    return RayTakesTurns(config, log)


@pytest.fixture(scope="module", autouse=True)
def _no_ray_left_running():
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
