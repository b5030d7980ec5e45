import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from miles.testing import tiny_model_dir  # noqa: E402,F401  (the fixture)

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A real local Ray instance with two CPUs, as on the 2-core CI machine (for the restart test)."""
    from omegaconf import OmegaConf

    from miles.cluster import RayCluster
    from miles.config.schema import ClusterConfig

    cluster = RayCluster(OmegaConf.structured(ClusterConfig(num_cpus=2)), tmp_path_factory.mktemp("ray"))
    yield cluster
    cluster.shutdown()
