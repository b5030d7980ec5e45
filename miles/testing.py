"""Helpers and pytest fixtures for plugin authors (and Miles' own tests).

Use the fixtures with ``pytest_plugins = ["miles.testing"]`` in a ``conftest.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from miles.config.schema import ModelBuildConfig, TokenizerConfig
from miles.models import build_model_dir
from miles.plugins import build_plugin_manager
from miles.registry import Registry
from miles.types import Sample, SampleStatus

__all__ = ["build_tiny_model", "make_registry", "make_sample", "tiny_model_dir", "miles_registry"]

ADDITION_ALPHABET = "0123456789+="


def build_tiny_model(path: str | Path, alphabet: str = ADDITION_ALPHABET, seed: int = 0, **build: Any) -> Path:
    """A random-init Qwen3 model (hidden 64, 2 layers unless overridden) with a char tokenizer."""
    build_cfg = OmegaConf.merge(OmegaConf.structured(ModelBuildConfig), build)
    tokenizer_cfg = OmegaConf.structured(TokenizerConfig(alphabet=alphabet))
    return build_model_dir(build_cfg, tokenizer_cfg, path, seed)


def make_registry(*plugins: object, autoload: bool = False) -> Registry:
    """A registry of the builtins plus ``plugins`` (modules or objects with ``@hookimpl`` methods)."""
    pm = build_plugin_manager(autoload=autoload, extra_plugins=[(f"test-plugin-{i}", p) for i, p in enumerate(plugins)])
    return Registry.from_plugin_manager(pm)


def make_sample(response_text: str = "", label: Any = None, **fields: Any) -> Sample:
    """A completed sample for testing rewards and selectors."""
    fields.setdefault("prompt_ids", [0])
    fields.setdefault("status", SampleStatus.COMPLETED)
    return Sample(response_text=response_text, label=label, **fields)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HF-format model directory, built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("miles-tiny-model") / "model")


@pytest.fixture
def miles_registry() -> Registry:
    """A registry of the builtins only (no installed plugins)."""
    return make_registry()
