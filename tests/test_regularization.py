"""KL to a reference policy (k1, k2, k3) and the entropy bonus."""

import json
import math

import pytest
import torch

from miles.train.losses import sft
from miles.run.runner import prepare, train
from miles.train.regularizers import kl_estimate, regularized
from miles.types import LossInputs


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    d = [0.5, -1.0, 0.0]  # log p - log p_ref
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx(d)
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5, 0.0])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-x) - 1 + x for x in d])
    assert kl_estimate(logp, ref, "k3").tolist()[1] == pytest.approx(math.e - 2)


def test_regularized_loss_adds_kl_and_subtracts_entropy():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    entropy = torch.tensor([[0.7, 0.3]], requires_grad=True)
    inputs = LossInputs(logp, logp.detach(), None, torch.tensor([[1.0, 1.0]]), 2.0, batch=None,
                        ref_logprobs=torch.tensor([[-1.5, -1.0]]), entropy=entropy)
    base, _ = sft(inputs)
    loss, _ = regularized(sft, kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01)(inputs)
    assert loss.item() == pytest.approx(base.item() + 0.1 * (0.125 + 0.5) / 2 - 0.01 * (0.7 + 0.3) / 2)
    loss.backward()
    assert entropy.grad.tolist()[0] == pytest.approx([-0.005, -0.005])  # the bonus pushes entropy up
    assert regularized(sft) is sft


def short(tmp_path, *overrides):
    return prepare("configs/quickstart.yaml", [f"run.dir={tmp_path}", "run.progress=false", "sft.steps=20",
                                               "run.steps=6", "run.eval_size=0", *overrides])


def test_kl_as_a_loss_term_starts_at_zero_and_grows(tmp_path):
    train(short(tmp_path, "regularization.kl_coef=0.05", "regularization.entropy_coef=0.001"))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["train/kl"] == pytest.approx(0.0, abs=1e-7)  # the reference is the starting policy
    assert rows[-1]["train/kl"] > 0


def test_kl_as_a_reward_penalty(tmp_path):
    train(short(tmp_path, "regularization.kl_coef=0.5", "regularization.kl_in=reward",
                "regularization.kl_estimator=k1"))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["rollout/kl_penalty_mean"] == pytest.approx(0.0, abs=1e-5)
    assert any(abs(r["rollout/kl_penalty_mean"]) > 1e-4 for r in rows[1:])
