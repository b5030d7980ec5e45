import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from miles.testing import ray_cluster, tiny_model_dir, vlm_model_dir  # noqa: E402,F401  (the fixtures)

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):  # noqa: F811  (the fixture imported above)
    """Every module here trains on Ray: miles.testing's two-CPU instance, for the module."""
    yield ray_cluster
