"""Prefix-shared ("tree") training on FSDP2 workers (``backend.share_prefixes``): each worker packs its own
micro-batches, and the run equals the unshared one."""

import torch

from miles.builtin.advantages import grpo
from miles.train.losses import ppo_clip
from miles.train.regularizers import regularized
from miles.types import Sample, SampleStatus, TrainBatch
from miles_fsdp2 import FSDP2Backend

TOLERANCE = 1e-5


def _groups(seed: int, groups: int = 2, n: int = 4) -> TrainBatch:
    """GRPO groups of ``n`` answers of different lengths to a long prompt."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g in range(groups):
        prompt = torch.randint(3, 15, (16,), generator=gen).tolist()
        for i in range(n):
            answer = torch.randint(3, 15, (1 + 3 * i,), generator=gen).tolist()
            samples.append(Sample(prompt_ids=prompt, response_ids=answer, loss_mask=[1] * len(answer),
                                  rollout_logprobs=[-1.0] * len(answer), group_index=g, index=i,
                                  status=SampleStatus.COMPLETED, reward=float(i % 2)))
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.advantages = grpo(batch)
    return batch


def test_shared_steps_equal_unshared_steps(tiny_model_dir):
    """Two steps with an entropy bonus and a reference model over two workers: every metric, the log-probs of the
    updated policy and its weights equal the unshared run's."""
    loss = regularized(ppo_clip, kl_coef=0.1, entropy_coef=0.01)
    batches = [_groups(seed=0), _groups(seed=1)]

    def run(share):
        backend = FSDP2Backend(world_size=2, lr=1e-3, share_prefixes=share, micro_batch_size=3)
        backend.setup(str(tiny_model_dir), seed=0, ref_model_path=str(tiny_model_dir))
        metrics = [backend.train_step(batch, loss) for batch in batches]
        after = backend.compute_logprobs(batches[0]), backend.ref_logprobs(batches[0])
        weights = backend.export_weights()
        backend.shutdown()
        return metrics, after, weights

    shared, unshared = run(True), run(False)
    for one, two in zip(unshared[0], shared[0]):
        assert one.keys() == two.keys()
        for key in one:
            assert abs(two[key] - one[key]) <= TOLERANCE, key
    mask = batches[0].loss_mask > 0
    for one, two in zip(unshared[1], shared[1]):
        assert (two - one)[mask].abs().max() <= TOLERANCE
    assert (shared[1][0] - shared[1][1])[mask].abs().max() > 1e-4  # the policy moved away from the reference
    for name, weight in unshared[2].items():
        assert (shared[2][name] - weight).abs().max() <= 1e-4, name  # AdamW: lr x float noise at most


def test_workers_take_each_token_s_sampling_temperature(tiny_model_dir):
    """Two workers, shared and unshared: the log-probs at the temperature the samples were drawn with
    (rollout.logprobs_of) are the torch backend's, and not the temperature-1 ones."""
    from miles.testing import make_train_batch
    from miles.train.torch_backend import TorchBackend

    tempered, plain = make_train_batch(seed=3, temperature=0.4), make_train_batch(seed=3)
    single = TorchBackend()
    single.setup(str(tiny_model_dir), seed=0)
    expected, at_one = single.compute_logprobs(tempered), single.compute_logprobs(plain)
    mask = tempered.loss_mask > 0
    for share in (True, False):
        backend = FSDP2Backend(world_size=2, share_prefixes=share, micro_batch_size=2)
        backend.setup(str(tiny_model_dir), seed=0)
        got = backend.compute_logprobs(tempered)
        backend.shutdown()
        assert (got - expected)[mask].abs().max() <= TOLERANCE
        assert (got - at_one)[mask].abs().max() > 0.05
