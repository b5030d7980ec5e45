import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from miles.testing import ray_cluster, tiny_model_dir  # noqa: E402,F401  (the fixtures)

torch.set_num_threads(1)
