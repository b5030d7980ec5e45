"""Advantage and loss values against small hand-computed cases."""

import math

import pytest
import torch

from miles.builtin.advantages import grpo
from miles.builtin.losses import ppo_clip, sft
from miles.types import LossInputs, Sample, SampleStatus, TrainBatch


def batch_of(rewards, groups, response_len=2):
    samples = [
        Sample(prompt_ids=[5, 6], group_index=g, response_ids=[7] * response_len, loss_mask=[1] * response_len,
               rollout_logprobs=[-0.1] * response_len, reward=r, status=SampleStatus.COMPLETED)
        for r, g in zip(rewards, groups)
    ]
    return TrainBatch.from_samples(samples, pad_token_id=0)


def test_train_batch_is_target_aligned():
    sample = Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 1], loss_mask=[1, 0, 1],
                    rollout_logprobs=[-0.5, 0.0, -0.25], reward=1.0, status=SampleStatus.COMPLETED)
    short = Sample(prompt_ids=[5], response_ids=[8], loss_mask=[1], rollout_logprobs=[-1.0], reward=0.0,
                   status=SampleStatus.COMPLETED)
    batch = TrainBatch.from_samples([sample, short], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 1], [5, 8, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]
    # Column t predicts token t+1: the response starts at column len(prompt) - 1.
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0, 1], [1, 0, 0, 0, 0]]
    assert batch.rollout_logprobs.tolist() == [[0, 0, -0.5, 0, -0.25], [-1.0, 0, 0, 0, 0]]
    assert batch.num_tokens == 3
    micro = batch.select(slice(1, 2))
    assert micro.input_ids.tolist() == [[5, 8]] and micro.loss_mask.tolist() == [[1]]


def test_grpo_group_normalized():
    batch = batch_of([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5], [0, 0, 0, 0, 1, 1, 2])
    advantages = grpo(batch)
    per_sample = advantages[:, 1].tolist()  # column 1 is the first response token
    expected = 0.5 / math.sqrt(1 / 3)  # mean 0.5, unbiased std sqrt(1/3)
    assert per_sample[:4] == pytest.approx([expected, -expected, -expected, expected], rel=1e-5)
    assert per_sample[4:] == [0.0, 0.0, 0.0]  # equal rewards and a group of one carry no signal
    assert advantages[:, 0].tolist() == [0.0] * 7  # prompt columns are masked
    assert (advantages[:, 1] == advantages[:, 2]).all()  # broadcast over the response tokens


def test_grpo_without_std_normalization():
    batch = batch_of([3.0, 1.0, 2.0], [4, 4, 4])
    assert grpo(batch, normalize_std=False)[:, 1].tolist() == pytest.approx([1.0, -1.0, 0.0])


def loss_inputs(logprobs, old, advantages, mask, normalizer=None):
    t = lambda x: torch.tensor([x], dtype=torch.float)  # noqa: E731
    mask_t = t(mask)
    return LossInputs(t(logprobs), t(old), t(advantages), mask_t,
                      normalizer if normalizer is not None else float(mask_t.sum()), batch=None)


def test_ppo_clip_hand_computed():
    up, down = 0.5, -0.5  # ratios e^0.5 = 1.6487 and e^-0.5 = 0.6065
    inputs = loss_inputs([up, down, up, down, up], [0.0] * 5, [1, 1, -1, -1, 1], [1, 1, 1, 1, 0])
    loss, metrics = ppo_clip(inputs, clip_low=0.2, clip_high=0.2)
    # A=+1, r=1.65: clipped to 1.2 -> -1.2; A=+1, r=0.61: -0.6065; A=-1, r=1.65: 1.6487; A=-1, r=0.61: 0.8.
    expected = (-1.2 - math.exp(-0.5) + math.exp(0.5) + 0.8) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["train/clip_frac"] == pytest.approx(0.5)


def test_ppo_clip_higher_upper_range():
    inputs = loss_inputs([0.5], [0.0], [1.0], [1])
    loss, _ = ppo_clip(inputs, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28)


def test_ppo_clip_gradient_is_policy_gradient_on_policy():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inputs = LossInputs(logprobs, logprobs.detach(), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), 2.0, batch=None)
    loss, _ = ppo_clip(inputs)
    loss.backward()
    assert logprobs.grad.tolist() == [[-1.0, 0.5]]  # -A / N at ratio 1


def test_sft_is_token_mean_nll_over_the_global_batch():
    inputs = loss_inputs([-1.0, -3.0, -5.0], [0.0] * 3, [0.0] * 3, [1, 1, 0], normalizer=4.0)
    loss, _ = sft(inputs)
    assert loss.item() == pytest.approx(4.0 / 4.0)
