"""A vision-language model (a tiny Qwen2.5-VL) on FSDP2 workers: each worker's rows carry their own images, the
training log-probs equal the engine's, and a step equals the single-process backend's."""

import torch

from miles.testing.vision import vlm_samples
from miles.train.losses import ppo_clip
from miles.train.torch_backend import TorchBackend
from miles.types import TrainBatch
from miles_fsdp2 import FSDP2Backend


def test_fsdp2_trains_a_vlm_as_the_torch_backend_does(vlm_model_dir, tmp_path):
    samples = vlm_samples(vlm_model_dir, tmp_path)
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.advantages = (batch.rewards - 0.5).unsqueeze(1) * batch.loss_mask
    mask = batch.loss_mask.bool()

    fsdp2 = FSDP2Backend(world_size=2, lr=1e-2, micro_batch_size=2, freeze_vision=True)
    fsdp2.setup(str(vlm_model_dir), seed=0)
    single = TorchBackend(lr=1e-2, micro_batch_size=2, freeze_vision=True)
    single.setup(str(vlm_model_dir), seed=0)
    try:
        before = fsdp2.compute_logprobs(batch)
        assert torch.allclose(before[mask], batch.rollout_logprobs[mask], atol=1e-4)
        metrics = fsdp2.train_step(batch, ppo_clip), single.train_step(batch, ppo_clip)
        assert abs(metrics[0]["train/loss"] - metrics[1]["train/loss"]) <= 1e-5
        after = fsdp2.compute_logprobs(batch), single.compute_logprobs(batch)
        assert (after[0] - after[1])[mask].abs().max() <= 1e-4
        assert (after[0] - before)[mask].abs().max() > 1e-3  # the step moved the policy
        exported, own = fsdp2.export_weights(), single.export_weights()
        tower = [name for name in exported if ".visual." in name]
        assert tower and all(torch.equal(exported[name], own[name]) for name in tower)  # frozen on both
    finally:
        fsdp2.shutdown()


def test_an_fsdp2_vlm_checkpoint_resumes_bitwise(vlm_model_dir, tmp_path):
    """Saved after one step (tower trained, images in every batch), loaded by fresh workers: the next step is the
    uninterrupted one's, bit for bit, tower included."""
    samples = vlm_samples(vlm_model_dir, tmp_path)
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.advantages = (batch.rewards - 0.5).unsqueeze(1) * batch.loss_mask

    def workers():
        backend = FSDP2Backend(world_size=2, lr=1e-2, micro_batch_size=2, freeze_vision=False)
        backend.setup(str(vlm_model_dir), seed=0)
        return backend

    first = workers()
    try:
        first.train_step(batch, ppo_clip)
        (tmp_path / "ckpt").mkdir()  # the run makes each checkpoint's folder
        first.save_checkpoint(str(tmp_path / "ckpt"))
        expected = first.train_step(batch, ppo_clip)
        weights = first.export_weights()
    finally:
        first.shutdown()
    resumed = workers()
    try:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        again = resumed.train_step(batch, ppo_clip)
        assert again["train/loss"] == expected["train/loss"] and again["train/grad_norm"] == expected["train/grad_norm"]
        own = resumed.export_weights()
        assert any(".visual." in name for name in own)
        assert all(torch.equal(own[name], weights[name]) for name in weights)
    finally:
        resumed.shutdown()
