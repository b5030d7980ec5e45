import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from miles.testing import ray_cluster, tiny_model_dir  # noqa: E402,F401  (the fixtures)

torch.set_num_threads(1)
# Without Apex or Transformer Engine, megatron-core warns at import that it falls back to PyTorch.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


@pytest.fixture(scope="session")
def megatron_process():
    """megatron-core in this process: a one-process gloo world and its model-parallel groups."""
    from miles_megatron import parallel
    from miles_megatron.model import Parallel

    parallel.init_world(0, 1)
    parallel.init_model_parallel(Parallel(), seed=0)
    yield
    parallel.shutdown()
