import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

pytest_plugins = ["miles.testing"]

ROOT = Path(__file__).resolve().parent.parent


def run_miles(*args: str, cwd: Path | None = None, env: dict | None = None,
              timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the ``miles`` command line in a fresh process, as a user would."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "miles", *args], cwd=cwd or ROOT, env=full_env,
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def miles_cli():
    return run_miles
