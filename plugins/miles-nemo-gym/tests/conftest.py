"""Fixtures: the NeMo Gym venv (built once into ``${MILES_VENV_CACHE:-~/.cache/miles/venvs}``, reused after),
and real NeMo Gym servers of the pinned package started from it on 127.0.0.1 free ports."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from miles_nemo_gym.servers import GymServer  # noqa: E402
from miles_nemo_gym.venv import PYTHON_ENV, ensure_venv, find_python, is_built, venv_dir  # noqa: E402

from miles.testing import chat_model_dir, tiny_model_dir  # noqa: E402,F401  (the fixtures)

torch.set_num_threads(1)

COUNTER = "resources_servers/example_session_state_mgmt"  # a stateful tool-using server: no LLM, no network


@pytest.fixture(scope="session")
def gym_python():
    """The NeMo Gym venv's interpreter; skips when there is no Python >= 3.12 to build it with."""
    if not is_built() and find_python() is None:
        pytest.skip(f"NeMo Gym needs Python >= 3.12 and none was found (looked for ${PYTHON_ENV}, python3.12/3.13 "
                    f"on PATH and pyenv's versions, e.g. /root/.pyenv/versions/3.12.1)")
    return ensure_venv()


@pytest.fixture(scope="session")
def counter_server(gym_python, tmp_path_factory):
    """NeMo Gym's ``example_session_state_mgmt`` resources server (a counter per session cookie)."""
    with GymServer.start(COUNTER, python=gym_python, workdir=tmp_path_factory.mktemp("counter")) as server:
        yield server


@pytest.fixture
def start_counter_server(gym_python, tmp_path):
    """Starts another counter server for this test only (stopped after it)."""
    started = []

    def start():
        started.append(GymServer.start(COUNTER, python=gym_python, workdir=tmp_path / f"counter{len(started)}"))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def counter_rows(gym_python):
    """The rows of that server's example dataset, as the package ships them."""
    found = sorted(venv_dir().glob(f"lib/python3.*/site-packages/{COUNTER}/data/example.jsonl"))
    assert found, f"no example.jsonl of {COUNTER} in {venv_dir()}"
    return [json.loads(line) for line in found[0].read_text().splitlines() if line.strip()]
