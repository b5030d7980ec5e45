"""The plugin as Miles finds it, with no Ray instance: the GPU check's dry run selects this test for a quick pass
through the plugin's pytest call (scripts/gpu_check.py); the modules beside it start Ray for every test."""

from miles.testing import make_registry
from miles_megatron import MegatronBackend


def test_the_backend_is_registered_as_megatron():
    registry = make_registry(autoload=True)
    assert registry.get("backend", "megatron").obj is MegatronBackend
