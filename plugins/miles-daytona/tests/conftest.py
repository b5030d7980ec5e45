import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from standin_daytona import DaytonaStandIn  # noqa: E402


@pytest.fixture(scope="session")
def standin_service():
    """The Daytona stand-in (see standin_daytona.py), one for the test session."""
    service = DaytonaStandIn().start()
    yield service
    service.stop()
