"""The builtin torch backend and the models it writes."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.train.losses import ppo_clip
from miles.train.torch_backend import TorchBackend
from miles.testing import BackendConformance, make_train_batch


def grads_after_step(model_dir, micro_batch_size):
    backend = TorchBackend(lr=1e-3, micro_batch_size=micro_batch_size, max_grad_norm=1e9)
    backend.setup(str(model_dir), seed=0)
    metrics = backend.train_step(make_train_batch(), ppo_clip)
    return metrics, {n: p.grad.clone() for n, p in backend.model.named_parameters()}


def test_micro_batching_does_not_change_the_gradient(tiny_model_dir):
    whole, grads_whole = grads_after_step(tiny_model_dir, 6)
    split, grads_split = grads_after_step(tiny_model_dir, 2)
    assert whole["train/loss"] == pytest.approx(split["train/loss"], abs=1e-6)
    assert whole["train/grad_norm"] == pytest.approx(split["train/grad_norm"], rel=1e-5)
    for name in grads_whole:
        assert torch.allclose(grads_whole[name], grads_split[name], atol=1e-6), name


def test_training_step_changes_weights_and_export_matches(tiny_model_dir):
    backend = TorchBackend(lr=1e-2)
    backend.setup(str(tiny_model_dir), seed=0)
    before = {k: v.clone() for k, v in backend.export_weights().items()}
    metrics = backend.train_step(make_train_batch(), ppo_clip)
    assert {"train/loss", "train/grad_norm", "train/clip_frac"} <= set(metrics)
    after = backend.export_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_saved_model_loads_with_transformers_and_generates(tiny_model_dir, tmp_path):
    backend = TorchBackend()
    backend.setup(str(tiny_model_dir), seed=0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend.save_pretrained(str(tmp_path / "out"), tokenizer)
    assert (tmp_path / "out" / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = loaded_tok("3+4=", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert loaded_tok.decode(ids[0]) == "3+4="
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, backend.model.state_dict()[name]), name


def test_token_budget_packing_covers_every_row_once_within_budget():
    from miles.train.batching import micro_batch_indices

    lengths = torch.tensor([5, 9, 3, 9, 4, 12, 2, 7])
    groups = micro_batch_indices(lengths, max_tokens=20)
    assert sorted(i for g in groups for i in g) == list(range(8))
    for group in groups:
        assert len(group) * max(int(lengths[i]) for i in group) <= 20
    assert micro_batch_indices(lengths, max_tokens=5)[0] == [5]  # longer than the budget: alone
    assert micro_batch_indices(lengths, max_samples=3) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_token_budget_split_gives_the_same_gradient(tiny_model_dir):
    def run(**split):
        backend = TorchBackend(lr=1e-3, max_grad_norm=1e9, **split)
        backend.setup(str(tiny_model_dir), seed=0)
        metrics = backend.train_step(make_train_batch(), ppo_clip)
        return metrics, {n: p.grad.clone() for n, p in backend.model.named_parameters()}

    by_count, grads_count = run(micro_batch_size=4)
    by_tokens, grads_tokens = run(max_tokens_per_micro_batch=14)
    assert by_count["train/micro_batches"] == 2 and by_tokens["train/micro_batches"] >= 3
    assert by_count["train/loss"] == pytest.approx(by_tokens["train/loss"], abs=1e-6)
    for name in grads_count:
        assert torch.allclose(grads_count[name], grads_tokens[name], atol=1e-5), name


class TestTorchBackendConformance(BackendConformance):
    split_options = ({"micro_batch_size": 6}, {"micro_batch_size": 2}, {"max_tokens_per_micro_batch": 14})

    def make_backend(self, **split):
        return TorchBackend(lr=1e-3, max_grad_norm=1e9, **split)


def test_recomputed_old_logprobs_start_the_ratio_at_one(tiny_model_dir):
    """The fixture batch's rollout log-probs (-2.0) are not the model's: with them the ratio is off and
    clips; recomputed by the trainer, the ratio starts at exactly one."""
    def step(mode):
        backend = TorchBackend(lr=1e-3, old_logprobs=mode)
        backend.setup(str(tiny_model_dir), seed=0)
        return backend.train_step(make_train_batch(), ppo_clip)

    rollout, recompute = step("rollout"), step("recompute")
    assert recompute["train/approx_kl"] == 0.0 and recompute["train/clip_frac"] == 0.0
    assert rollout["train/approx_kl"] > 0.0
    assert rollout["train/rollout_logprob_abs_diff"] == recompute["train/rollout_logprob_abs_diff"] > 0
    with pytest.raises(ValueError, match="old_logprobs must be"):
        TorchBackend(old_logprobs="engine")


def test_step_plans_balance_tokens_over_ranks_with_equal_micro_batch_counts():
    from miles.train.batching import plan_step

    lengths = torch.tensor([12, 3, 9, 4, 8, 2, 7, 5, 6])
    plan = plan_step(lengths, world_size=2, max_tokens=16)
    (mini,) = plan
    rows = sorted(r for share in mini for micro in share for r in micro)
    assert rows == list(range(9))  # every row once
    tokens = [sum(int(lengths[r]) for micro in share for r in micro) for share in mini]
    assert abs(tokens[0] - tokens[1]) <= 2  # 56 tokens split 28/28 or close
    assert len(mini[0]) == len(mini[1])  # the same number of forward passes on every rank
    for share in mini:
        for micro in share:
            assert not micro or len(micro) * max(int(lengths[r]) for r in micro) <= 16
    one = plan_step(torch.tensor([5, 5, 5]), world_size=4)[0]
    assert [len(share) for share in one] == [1, 1, 1, 1] and one[3] == [[]]  # a placeholder where there is no row
    assert [len(m[0][0]) for m in plan_step(torch.ones(10), mini_batches=3)] == [3, 4, 3]


def test_lr_schedules_warm_up_and_decay():
    from miles.train.options import TrainOptions

    cosine = TrainOptions(lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert [cosine.lr_factor(k, 12) for k in (0, 1)] == [0.5, 1.0]
    assert cosine.lr_factor(2, 12) == pytest.approx(1.0)
    assert cosine.lr_factor(7, 12) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert cosine.lr_factor(12, 12) == pytest.approx(0.1)
    linear = TrainOptions(lr_schedule="linear")
    assert linear.lr_factor(5, 10) == pytest.approx(0.5)
    assert TrainOptions().lr_factor(9, 10) == 1.0


def test_the_backend_follows_the_schedule(tiny_model_dir):
    backend = TorchBackend(lr=1e-2, lr_schedule="linear", warmup_steps=1)
    backend.setup(str(tiny_model_dir), seed=0, total_steps=3)
    lrs = [backend.train_step(make_train_batch(seed=k), ppo_clip)["train/lr"] for k in range(3)]
    assert lrs == pytest.approx([1e-2, 1e-2, 0.5e-2])


def test_mini_batches_are_optimizer_steps_on_successive_shares(tiny_model_dir):
    batch = make_train_batch()
    split = TorchBackend(lr=1e-2, mini_batches=2, micro_batch_size=2)
    split.setup(str(tiny_model_dir), seed=0)
    metrics = split.train_step(batch, ppo_clip)
    assert split.policy.scheduler.last_epoch == 2 and metrics["train/micro_batches"] == 4  # 3 rows each, 2 per pass

    by_hand = TorchBackend(lr=1e-2)
    by_hand.setup(str(tiny_model_dir), seed=0)
    halves = [by_hand.train_step(batch.select(rows), ppo_clip) for rows in ([0, 1, 2], [3, 4, 5])]
    assert metrics["train/loss"] == pytest.approx((halves[0]["train/loss"] + halves[1]["train/loss"]) / 2, abs=1e-6)
    for name, tensor in split.export_weights().items():
        assert (tensor - by_hand.export_weights()[name]).abs().max() < 1e-4, name  # Adam magnifies float noise


def test_epochs_pass_over_the_batch_again_and_report_the_staleness(tiny_model_dir):
    batch = make_train_batch()
    passes = TorchBackend(lr=1e-2, mini_batches=2, epochs=2, old_logprobs="recompute")
    passes.setup(str(tiny_model_dir), seed=0, total_steps=10)
    metrics = passes.train_step(batch, ppo_clip)
    assert passes.policy.scheduler.last_epoch == 4 and metrics["train/micro_batches"] == 4
    assert (metrics["train/optimizer_steps"], metrics["train/policy_lag_max"]) == (4.0, 3.0)
    assert metrics["train/approx_kl"] > 0  # later passes see a policy that moved from the one that sampled

    by_hand = TorchBackend(lr=1e-2)  # old log-probs: the batch's, set to the policy's before the first step
    by_hand.setup(str(tiny_model_dir), seed=0)
    halves = [batch.select(rows) for rows in ([0, 1, 2], [3, 4, 5])]
    for half in halves:
        half.rollout_logprobs = by_hand.compute_logprobs(half)
    for _ in range(2):
        for half in halves:
            by_hand.train_step(half, ppo_clip)
    for name, tensor in passes.export_weights().items():
        assert (tensor - by_hand.export_weights()[name]).abs().max() < 1e-4, name


@pytest.mark.parametrize(("overrides", "message"), [
    (["backend.mini_batches=3"], "backend.mini_batches=3 does not divide rollout.prompts_per_step=16"),
    (["backend.name=fsdp2", "backend.world_size=4", "rollout.prompts_per_step=2", "rollout.n_samples=1"],
     "backend.world_size: 4 data-parallel workers for mini-batches of 2 samples"),
])
def test_batch_arithmetic_that_cannot_be_planned_is_a_config_error(capsys, tmp_path, overrides, message):
    from miles.cli import main

    assert main(["config", "configs/quickstart.yaml", f"run.dir={tmp_path}/run", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_the_batch_arithmetic_is_spelled_out():
    from miles.run.settings import batch_arithmetic
    from miles.run.runner import prepare

    config = prepare("configs/quickstart.yaml", ["backend.mini_batches=4", "backend.epochs=2"]).config
    assert batch_arithmetic(config) == (
        "batch: 16 prompts x 8 samples = 128 samples per step; 4 mini-batches of 32 x 2 epochs = 8 optimizer steps "
        "per rollout; the last trains on samples from a policy 7 optimizer steps older (train/policy_lag_max)")
    assert batch_arithmetic(prepare("configs/quickstart.yaml", []).config) == (
        "batch: 16 prompts x 8 samples = 128 samples per step; 1 mini-batch of 128 x 1 epoch = 1 optimizer step "
        "per rollout")


def test_bfloat16_and_cuda_are_refused_without_a_gpu(tiny_model_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="dtype bfloat16 needs a GPU"):
        TorchBackend(dtype="bfloat16").setup(str(tiny_model_dir), seed=0)
    with pytest.raises(ValueError, match="device is 'cuda' but torch sees no GPU"):
        TorchBackend(device="cuda").setup(str(tiny_model_dir), seed=0)
    backend = TorchBackend(dtype="auto")
    backend.setup(str(tiny_model_dir), seed=0)
    assert backend.policy.autocast is None and next(backend.model.parameters()).dtype == torch.float32


def test_value_model_learns_returns_after_policy_warm_up(tiny_model_dir, tmp_path):
    from miles.builtin.advantages import ppo

    backend = TorchBackend(lr=1e-2, critic_lr=1e-2, critic_warmup_steps=1)
    backend.setup(str(tiny_model_dir), seed=0, critic_model_path=str(tiny_model_dir))

    def ppo_batch():
        batch = make_train_batch()
        batch.values = backend.compute_values(batch)
        batch.advantages = ppo(batch)
        return batch

    policy_before = {k: v.clone() for k, v in backend.export_weights().items()}
    first = backend.train_step(ppo_batch(), ppo_clip)
    assert first["train/critic_warmup"] == 1.0
    assert all(torch.equal(policy_before[k], v) for k, v in backend.export_weights().items())  # only the critic moved
    losses = [backend.train_step(ppo_batch(), ppo_clip)["critic/loss"] for _ in range(5)]
    assert losses[-1] < losses[0] < first["critic/loss"]  # the value model fits the returns
    assert any(not torch.equal(policy_before[k], v) for k, v in backend.export_weights().items())

    (tmp_path / "ckpt").mkdir()
    backend.save_checkpoint(str(tmp_path / "ckpt"))
    batch = ppo_batch()
    expected = backend.train_step(batch, ppo_clip)
    resumed = TorchBackend(lr=1e-2, critic_lr=1e-2, critic_warmup_steps=1)
    resumed.setup(str(tiny_model_dir), seed=0, critic_model_path=str(tiny_model_dir))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert torch.equal(resumed.compute_values(batch), batch.values)
    again = resumed.train_step(batch, ppo_clip)
    assert again["critic/loss"] == expected["critic/loss"] and again["train/loss"] == expected["train/loss"]


@pytest.mark.parametrize(("spoil", "loss", "cause"), [
    ("advantages", "-inf", "the advantages hold NaN or inf at loss tokens"),
    ("rollout_logprobs", "nan", "the log-probs it was sampled with hold NaN or inf at loss tokens"),
])
def test_a_non_finite_loss_takes_no_optimizer_step_and_names_its_cause(tiny_model_dir, spoil, loss, cause):
    from miles.train.losses import NonFiniteLoss

    backend = TorchBackend(lr=1e-2, micro_batch_size=2)
    backend.setup(str(tiny_model_dir), seed=0)
    before = {k: v.clone() for k, v in backend.export_weights().items()}
    batch = make_train_batch()
    row = 3  # the second micro-batch's
    column = int(batch.loss_mask[row].nonzero()[0])
    getattr(batch, spoil)[row, column] = float("inf") if spoil == "advantages" else float("nan")
    with pytest.raises(NonFiniteLoss) as raised:
        backend.train_step(batch, ppo_clip)
    assert str(raised.value).startswith(f"the loss of micro-batch 2 of optimizer step 1 is {loss}: ") and cause in str(
        raised.value) and str(raised.value).endswith("that optimizer step was not taken, so no weight holds NaN or inf")
    after = backend.export_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)  # untouched, never NaN
    fresh = TorchBackend(lr=1e-2, micro_batch_size=2)
    fresh.setup(str(tiny_model_dir), seed=0)
    # the next step trains as a first step would: nothing of the refused one is left in the gradients
    assert backend.train_step(make_train_batch(), ppo_clip)["train/loss"] == \
        fresh.train_step(make_train_batch(), ppo_clip)["train/loss"]
