"""The chunked log-prob path (``logprob_chunk_tokens``) on FSDP2 workers: the output layer's weight is gathered
only inside the root module's forward, which is where the chunked path computes."""

import pytest

from miles.train.losses import ppo_clip
from miles.errors import ConfigError
from miles.testing import make_train_batch
from miles.train.regularizers import regularized
from miles_fsdp2 import FSDP2Backend


def test_chunked_steps_equal_unchunked_steps(tiny_model_dir):
    """Two steps with an entropy bonus (the entropy's gradient too) and chunks of 5 tokens, which divide no
    worker's micro-batch evenly: every metric equals the unchunked run's within 1e-5."""
    with pytest.raises(ConfigError, match="backend.logprob_kernel: unknown log-prob kernel 'nope'"):
        FSDP2Backend(world_size=2, logprob_kernel="nope")
    loss = regularized(ppo_clip, entropy_coef=0.01)

    def steps(**options):
        backend = FSDP2Backend(world_size=2, lr=1e-2, **options)
        backend.setup(str(tiny_model_dir), seed=0)
        out = [backend.train_step(make_train_batch(seed=k, rows=9), loss) for k in range(2)]
        backend.shutdown()
        return out

    whole, chunked = steps(), steps(logprob_chunk_tokens=5)
    for one, two in zip(whole, chunked):
        assert one.keys() == two.keys()
        for key in one:
            assert two[key] == pytest.approx(one[key], abs=1e-5), key
    assert whole[1]["train/loss"] != whole[0]["train/loss"]
