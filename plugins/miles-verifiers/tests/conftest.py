"""Fixtures of the miles-verifiers tests: the tiny chat model and the verifiers venv."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from miles.testing import chat_model_dir  # noqa: E402,F401  (the fixture)

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def verifiers_python() -> str:
    """The verifiers venv's interpreter: built once under ${MILES_VENV_CACHE:-~/.cache/miles/venvs}, then reused."""
    from miles_verifiers import ensure_venv

    return str(ensure_venv())
