"""Advantage and loss values against small hand-computed cases."""

import math
import re

import pytest
import torch

from types import SimpleNamespace

from miles.builtin.advantages import batch_whiten, dr_grpo, grpo, reinforce_pp, reinforce_pp_baseline, rloo
from miles.train.losses import aggregate, ppo_clip, sft
from miles.errors import ConfigError
from miles.run.runner import prepare
from miles.types import LossInputs, Sample, SampleStatus, TrainBatch


def close(tensor, expected, tol=1e-5):
    return torch.allclose(tensor, torch.tensor(expected, dtype=tensor.dtype), atol=tol, rtol=tol)


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


def test_sft_with_the_constant_normaliser():
    inputs = loss_inputs([-1.0, -3.0, -5.0], [0.0] * 3, [0.0] * 3, [1, 1, 0], normalizer=4.0)
    loss, _ = sft(inputs, agg="constant", norm_tokens=8)
    assert loss.item() == pytest.approx(4.0 / (1 * 8))  # token sum / (sequences x norm_tokens)


def test_dr_grpo_only_subtracts_the_group_mean():
    batch = batch_of([3.0, 1.0, 2.0, 5.0], [0, 0, 0, 1])
    assert dr_grpo(batch)[:, 1].tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])


def test_rloo_baseline_leaves_the_sample_out():
    batch = batch_of([1.0, 0.0, 0.0, 1.0, 7.0], [0, 0, 0, 0, 1])
    # 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3; a group of one has no baseline: 0.
    assert rloo(batch)[:, 1].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0])


def test_batch_whitening_over_masked_tokens():
    advantages = torch.tensor([[0.0, 1.0, 1.0], [0.0, 3.0, 9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    out = batch_whiten(advantages, mask)  # tokens 1, 1, 3: mean 5/3, population std sqrt(8/9)
    std = math.sqrt(8 / 9)
    assert close(out, [[0.0, -2 / 3 / std, -2 / 3 / std], [0.0, 4 / 3 / std, 0.0]])
    assert (grpo(batch_of([1.0, 0.0, 3.0, 1.0], [0, 0, 1, 1]), whiten=True)[:, 1:].std(unbiased=False)
            == pytest.approx(1.0))


def test_reinforce_pp_returns_carry_the_token_kl_penalty():
    batch = batch_of([1.0, 0.0], [0, 0])  # loss mask [[0, 1, 1], [0, 1, 1]]
    assert close(reinforce_pp(batch)[:, 1:], [[1.0, 1.0], [-1.0, -1.0]])  # whitened
    batch.kl_penalty = torch.tensor([[0.0, 0.1, 0.2], [0.0, 0.3, 0.0]])
    # Token rewards: [-0.1, 1 - 0.2] and [-0.3, 0]; returns sum to the end.
    assert close(reinforce_pp(batch, whiten=False)[:, 1:], [[0.7, 0.8], [-0.3, 0.0]])
    assert reinforce_pp(batch, gamma=0.5, whiten=False)[0, 1].item() == pytest.approx(-0.1 + 0.5 * 0.8)
    assert batch.sequence_rewards().tolist() == pytest.approx([0.7, -0.3])  # what GRPO-style estimators use
    batch.kl_penalty = None
    assert close(reinforce_pp_baseline(batch, whiten=False)[:, 1:], [[0.5, 0.5], [-0.5, -0.5]])


def test_aggregations_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    inputs = LossInputs(values, values, None, mask, 4.0, batch=None, sequence_normalizer=2.0)
    assert aggregate(values, inputs, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(values, inputs, "seq_mean_token_mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert aggregate(values, inputs, "seq_mean_token_sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(values, inputs, "constant", norm_tokens=4).item() == pytest.approx(10 / (2 * 4))


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    inputs = loss_inputs([1.5, 1.5], [0.0, 0.0], [-1.0, 1.0], [1, 1])
    loss, metrics = ppo_clip(inputs, clip_c=3.0)
    # A=-1, r=e^1.5=4.48: PPO gives 4.48, dual clip caps it at 3; A=+1 clips to -1.2.
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2, rel=1e-5)
    assert metrics["train/dual_clip_frac"] == pytest.approx(0.5)
    assert ppo_clip(inputs)[0].item() == pytest.approx((math.exp(1.5) - 1.2) / 2, rel=1e-5)


def test_sequence_ratio_is_length_normalised_with_the_gspo_gradient():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.1]])
    inputs = LossInputs(logprobs, old, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), 2.0, batch=None)
    loss, _ = ppo_clip(inputs, ratio="sequence", clip_low=10.0, clip_high=10.0, agg="seq_mean_token_mean")
    s = math.exp((0.5 + 0.1) / 2)  # exp(mean log-ratio)
    assert loss.item() == pytest.approx(-s, rel=1e-6)
    loss.backward()
    assert close(logprobs.grad, [[-s / 2, -s / 2]])  # -s * mean of grad log p
    clipped, metrics = ppo_clip(inputs, ratio="sequence", clip_low=3e-4, clip_high=4e-4)
    assert clipped.item() == pytest.approx(-1.0004) and metrics["train/clip_frac"] == 1.0


@pytest.mark.parametrize("level, mode, expected_loss", [
    ("token", "truncate", (-2.0 - 1.0) / 2), ("token", "mask", (0.0 - 1.0) / 2),
    ("sequence", "truncate", (-2.0 - 2.0) / 2), ("sequence", "mask", 0.0),
])
def test_truncated_importance_sampling(level, mode, expected_loss):
    old = torch.tensor([[-1.0, -1.0]])
    batch = SimpleNamespace(rollout_logprobs=torch.tensor([[-2.0, -1.0]]))  # weights e^1 and 1 (sequence: e^1)
    inputs = LossInputs(old.clone(), old, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), 2.0, batch=batch)
    loss, metrics = ppo_clip(inputs, tis=level, tis_mode=mode, tis_cap=2.0)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    if level == "token":
        assert metrics["train/is_weight_mean"] == pytest.approx((math.e + 1) / 2)
        assert metrics["train/is_clipped_frac"] == 0.5
    else:
        assert metrics["train/is_weight_mean"] == pytest.approx(math.e) and metrics["train/is_clipped_frac"] == 1.0


def test_masked_importance_sampling_drops_tokens_outside_the_band_on_both_sides():
    """``tis_mode=mask_both``: tokens whose weight leaves [1/cap, cap] are dropped, low ones too (``mask`` keeps
    those)."""
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    batch = SimpleNamespace(rollout_logprobs=torch.tensor([[-2.0, -1.0, 0.0]]))  # weights e, 1, 1/e
    inputs = LossInputs(old.clone(), old, torch.ones(1, 3), torch.ones(1, 3), 3.0, batch=batch)
    both, metrics = ppo_clip(inputs, tis="token", tis_mode="mask_both", tis_cap=2.0)
    assert both.item() == pytest.approx(-1.0 / 3) and metrics["train/is_clipped_frac"] == pytest.approx(2 / 3)
    upper, metrics = ppo_clip(inputs, tis="token", tis_mode="mask", tis_cap=2.0)
    assert upper.item() == pytest.approx(-(1.0 + math.exp(-1)) / 3)
    assert metrics["train/is_clipped_frac"] == pytest.approx(1 / 3)


def test_ppo_gae_hand_computed():
    from miles.builtin.advantages import ppo

    batch = batch_of([1.0], [0])  # loss mask [[0, 1, 1]]
    batch.values = torch.tensor([[9.0, 0.5, 0.8]])  # the prompt column's value is ignored
    assert close(ppo(batch, gamma=1.0, lam=1.0, whiten=False), [[0.0, 0.5, 0.2]])  # = R - V with lam 1
    assert close(batch.returns, [[0.0, 1.0, 1.0]])
    # lam = 0.5: A_1 = delta_1 + 0.5 * delta_2 = (0.8 - 0.5) + 0.5 * 0.2
    assert close(ppo(batch, gamma=1.0, lam=0.5, whiten=False), [[0.0, 0.4, 0.2]])
    # gamma = 0.5: delta_1 = 0.5 * 0.8 - 0.5, delta_2 = 0.2; A_1 = -0.1 + 0.5 * 0.5 * 0.2
    assert close(ppo(batch, gamma=0.5, lam=0.5, whiten=False), [[0.0, -0.05, 0.2]])
    masked = batch_of([1.0], [0], response_len=3)  # an observation token in the middle is skipped
    masked.loss_mask[0, 2] = 0
    masked.values = torch.tensor([[0.0, 0.5, 7.0, 0.8]])
    assert close(ppo(masked, gamma=1.0, lam=1.0, whiten=False), [[0.0, 0.5, 0.0, 0.2]])


@pytest.mark.parametrize("overrides, message", [
    (["sft.loss.agg=constant"], "sft.loss: loss 'sft' rejected its arguments: agg=constant needs norm_tokens"),
    (["sft.loss.agg=constant", "sft.loss.norm_tokens=0"], "agg=constant needs norm_tokens, a whole number >= 1"),
    (["loss.agg=sum"], "loss: loss 'ppo_clip' rejected its arguments: agg='sum' is not an aggregation"),
    (["loss.ratio=seq"], "ratio='seq': expected token or sequence"),
    (["loss.tis=tok"], "tis='tok': expected none, token or sequence"),
    (["loss.tis_mode=drop"], "tis_mode='drop': expected truncate, mask or mask_both"),
    (["loss.tis_cap=0"], "tis_cap must be > 0"),
    (["loss.clip_c=0.9"], "clip_c (the dual clip) must be a number > 1"),
    (["loss.clip_low=1.0"], "need 0 <= clip_low < 1 and clip_high >= 0"),
    (["advantage.eps=0"], "advantage: advantage 'grpo' rejected its arguments: eps must be > 0"),
    (["advantage.name=gspo", "advantage.eps=0"], "advantage: advantage 'gspo' rejected its arguments: eps must be > 0"),
    (["selection=[{name: over_sampling, factor: 0.5}]"],
     "selection[0]: data_selector 'over_sampling' rejected its arguments: factor must be >= 1"),
    (["rollout.n_samples=4", "selection=[{name: dynamic_sampling, min_samples: 5}]"],
     "selection[0]=dynamic_sampling with rollout.n_samples=4 would discard every group forever"),
])
def test_arguments_that_only_work_together_are_refused_at_validation(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        prepare("configs/quickstart.yaml", overrides)


def test_arguments_that_work_together_are_accepted():
    prepare("configs/quickstart.yaml", ["sft.loss.agg=constant", "sft.loss.norm_tokens=8", "advantage.eps=0",
                                        "advantage.normalize_std=false", "loss.clip_c=3", "loss.agg=constant"])


def multi_turn_batch(rewards):
    """Two turns with a tool observation between them: response loss mask [1, 1, 0, 0, 1, 1]."""
    samples = [
        Sample(prompt_ids=[5, 6], group_index=0, response_ids=[7] * 6, loss_mask=[1, 1, 0, 0, 1, 1],
               rollout_logprobs=[-0.1, -0.1, 0.0, 0.0, -0.1, -0.1], reward=r, status=SampleStatus.COMPLETED)
        for r in rewards
    ]
    return TrainBatch.from_samples(samples, pad_token_id=0)


MASK = [0, 1, 1, 0, 0, 1, 1]  # target-aligned: column 0 predicts the last prompt token's successor


def on_mask(per_sequence):
    return [[value * m for m in MASK] for value in per_sequence]


def test_every_estimator_gives_tokens_before_a_tool_call_their_credit():
    from miles.builtin.advantages import gspo, ppo

    batch = multi_turn_batch([1.0, 0.0])
    assert batch.loss_mask.tolist() == [MASK, MASK]
    std = math.sqrt(0.5)  # unbiased std of (1, 0)
    assert close(grpo(batch), on_mask([0.5 / std, -0.5 / std]))
    assert close(gspo(batch), on_mask([0.5 / std, -0.5 / std]))
    assert close(dr_grpo(batch), on_mask([0.5, -0.5]))
    assert close(rloo(batch), on_mask([1.0, -1.0]))
    assert close(reinforce_pp(batch, whiten=False), on_mask([1.0, 0.0]))
    assert close(reinforce_pp_baseline(batch, whiten=False), on_mask([0.5, -0.5]))
    # gamma 0.5 discounts policy tokens only: 1 at the last, 0.5, then over the observation 0.25, 0.125
    assert close(reinforce_pp(batch, gamma=0.5, whiten=False)[0], [0.0, 0.125, 0.25, 0.0, 0.0, 0.5, 1.0])
    batch.kl_penalty = torch.tensor([[0.0, 0.1, 0.0, 0.0, 0.0, 0.2, 0.0]] * 2)
    # token rewards [-0.1, 0, (obs), (obs), -0.2, r]: returns sum to the end across the observation
    assert close(reinforce_pp(batch, whiten=False)[0], [0.0, 0.7, 0.8, 0.0, 0.0, 0.8, 1.0])
    batch.kl_penalty = None
    batch.values = torch.tensor([[0.0, 0.1, 0.2, 9.0, 9.0, 0.3, 0.4]] * 2)  # observation values are ignored
    assert close(ppo(batch, gamma=1.0, lam=1.0, whiten=False)[0], [0.0, 0.9, 0.8, 0.0, 0.0, 0.7, 0.6])
    assert close(ppo(batch, gamma=1.0, lam=1.0, whiten=False)[1], [0.0, -0.1, -0.2, 0.0, 0.0, -0.3, -0.4])
