import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from miles.testing import chat_model_dir, tiny_model_dir  # noqa: E402,F401  (the fixtures)
