"""Helpers and pytest fixtures for plugin authors (and Miles' own tests).

Use the fixtures with ``pytest_plugins = ["miles.testing"]`` in a ``conftest.py``. The package holds:
``fixtures`` (helpers and fixtures), ``backend`` (:class:`BackendConformance`), ``env`` (:class:`EnvConformance`,
:class:`ScriptedPolicy`) and ``sandbox`` (:class:`SandboxConformance`); everything is imported from here.
"""

from miles.testing.backend import BackendConformance
from miles.testing.env import EnvConformance, ScriptedPolicy
from miles.testing.fixtures import (  # the fixtures are here so that pytest_plugins = ["miles.testing"] finds them
    CHAT_ALPHABET, CHAT_TOKENIZER, MILES_WITH_CTRL_C, build_chat_model, build_tiny_model, build_vlm, chat_model_dir,
    free_port, generate_all, local_engine,
    make_registry, make_sample, make_train_batch, miles_registry, ray_cluster, serve_engine, serve_in_thread,
    tiny_model_dir, vlm_model_dir,
)
from miles.testing.fixtures import ADDITION_ALPHABET, fixture, pytest  # noqa: F401 (importable here, as before)
from miles.testing.sandbox import SandboxConformance

__all__ = [
    "BackendConformance", "build_chat_model", "build_tiny_model", "chat_model_dir", "make_registry", "make_sample",
    "make_train_batch", "tiny_model_dir", "miles_registry", "MILES_WITH_CTRL_C", "SandboxConformance", "EnvConformance",
    "ScriptedPolicy", "CHAT_ALPHABET", "CHAT_TOKENIZER", "ray_cluster", "serve_engine", "serve_in_thread",
    "build_vlm", "vlm_model_dir", "free_port", "generate_all", "local_engine",
]
