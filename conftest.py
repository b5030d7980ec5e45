"""Shared by every test folder: tests that start Ray instances run one at a time.

With ``pytest -n`` (pytest-xdist, ``--dist loadgroup`` in setup.cfg) the tests of the files below share one
worker: two Ray instances at once on a small machine each slow the other several times over (measured on
2 cores: a quickstart on Ray took 126 s beside another instance, 28 s alone), so they take turns while the
other workers run everything else.
"""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent

STARTS_RAY = {
    "tests/test_debug_modes.py", "tests/test_engine_chaos.py", "tests/test_gpu_check.py", "tests/test_lora.py",
    "tests/test_multi_node.py", "tests/test_ray_plane.py", "tests/test_schedules_ray.py", "tests/test_startup.py",
    "tests/test_true_on_policy.py",
    "plugins/miles-fsdp2/tests/test_fsdp2.py", "plugins/miles-fsdp2/tests/test_fsdp2_chunked_logprobs.py",
    "plugins/miles-fsdp2/tests/test_fsdp2_lora.py", "plugins/miles-megatron/tests/test_megatron_backend.py",
    "plugins/miles-megatron/tests/test_megatron_parallel.py",
    "plugins/miles-sglang/tests/test_sglang_launcher.py",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(item.fspath).resolve().relative_to(ROOT).as_posix() in STARTS_RAY:
            item.add_marker(pytest.mark.xdist_group("ray"))
