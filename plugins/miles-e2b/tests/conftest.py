import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # the stand-in module, for the tests and their scripts

import pytest  # noqa: E402

from miles.agentic.sandboxes.local import bwrap_problem  # noqa: E402
from standin_e2b import E2BStandIn  # noqa: E402

from miles.testing import chat_model_dir, tiny_model_dir  # noqa: E402,F401  (the fixtures)

E2B_VARIABLES = ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN", "E2B_DEBUG", "E2B_ACCESS_TOKEN")


@pytest.fixture(scope="session")
def standin():
    """The E2B stand-in (tests/standin_e2b.py), serving for the whole session; it runs its sandboxes'
    commands in Miles' local sandbox with bubblewrap."""
    if bwrap_problem() is not None:
        pytest.skip(f"the E2B stand-in runs commands with bubblewrap, which does not work here: {bwrap_problem()}")
    server = E2BStandIn().start()
    yield server
    server.stop()


@pytest.fixture
def e2b(standin, monkeypatch):
    """The SDK pointed at the stand-in (and nowhere else) for one test, which must leave no sandbox."""
    for name in E2B_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in standin.env().items():
        monkeypatch.setenv(name, value)
    standin.reset()
    yield standin
    left = standin.live()
    standin.remove_all()
    assert left == [], f"the test left sandboxes behind: {left}"
