"""On-policy distillation: the teacher's log-probs of the student's tokens (in process and over HTTP), the
per-token reverse-KL advantages, a short run that distils, and the configs it refuses."""

import json
from statistics import fmean

import pytest
import torch

from miles import interrupts
from miles.cli import main
from miles.config import load_config
from miles.loop.distill import Teacher, distill_advantages
from miles.engine.local import LocalEngine
from miles.models.hf import build_model_dir, load_model, load_tokenizer
from miles.rollout.plane import EventLoopThread
from miles.engine.router import Router
from miles.run.runner import prepare, train
from miles.testing import serve_in_thread
from miles.train.logprobs import token_logprobs
from miles.types import Sample, TrainBatch

QUICK = ["run.progress=false", "run.eval_size=0"]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher with the quickstart's tokenizer, taught the task by a short SFT (the student starts untrained)."""
    out = tmp_path_factory.mktemp("teacher")
    train(prepare("configs/sft.yaml", [*QUICK, f"run.dir={out}", "sft.steps=150"]))
    return str(out / "sft_model")


def _batch(tokenizer):
    samples = []
    for prompt, response in [("3+4=", "7"), ("5+5=", "10"), ("2+2=", "91")]:
        sample = Sample(prompt_ids=tokenizer(prompt)["input_ids"], reward=0.0)
        ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sample.append(ids, [-0.5] * len(ids), from_policy=True)
        samples.append(sample)
    return TrainBatch.from_samples(samples, tokenizer.pad_token_id or 0)


def test_the_teachers_logprobs_are_those_of_a_plain_forward_in_process_and_over_http(teacher_dir):
    tokenizer = load_tokenizer(teacher_dir)
    batch = _batch(tokenizer)
    with torch.no_grad():
        expected = token_logprobs(load_model(teacher_dir).eval(), batch.input_ids) * batch.loss_mask
    engine = LocalEngine()
    engine.load_model(teacher_dir)
    in_process = Teacher(engine, interrupts.run, 1.0, 0.0).logprobs(batch)
    assert torch.allclose(in_process * batch.loss_mask, expected, atol=1e-5)
    assert (in_process * (1 - batch.loss_mask)).abs().sum() == 0  # nothing outside the response
    loop = EventLoopThread()
    with serve_in_thread(engine) as url:
        router = Router([url])
        loop.run(router.start())
        try:
            over_http = Teacher(router, loop.run, 1.0, 0.0).logprobs(batch)
        finally:
            loop.run(router.close())
            loop.close()
    assert torch.equal(over_http, in_process)


def test_advantages_are_the_negative_reverse_kl_on_loss_tokens_plus_the_weighted_reward_advantages():
    batch = TrainBatch(
        input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.long),
        loss_mask=torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]),
        rollout_logprobs=torch.tensor([[-9.0, -1.0, -2.0], [-9.0, -0.5, -7.0]]),
        rewards=torch.zeros(2), group_index=torch.zeros(2, dtype=torch.long),
        advantages=torch.tensor([[3.0, 3.0, 3.0], [-1.0, -1.0, -1.0]]))
    teacher = torch.tensor([[0.0, -0.25, -4.0], [0.0, -2.5, 0.0]])
    advantages, metrics = distill_advantages(batch, teacher, kl_coef=2.0, reward_coef=0.5)
    expected = torch.tensor([[0.0, 2 * (-0.25 + 1.0) + 1.5, 2 * (-4.0 + 2.0) + 1.5],
                             [0.0, 2 * (-2.5 + 0.5) - 0.5, 0.0]])
    assert torch.allclose(advantages, expected)
    assert metrics["distill/reverse_kl"] == pytest.approx(((-1.0 + 0.25) + (-2.0 + 4.0) + (-0.5 + 2.5)) / 3)
    assert metrics["distill/teacher_logprob_mean"] == pytest.approx((-0.25 - 4.0 - 2.5) / 3)


def test_distillation_brings_the_student_to_the_teacher(teacher_dir, tmp_path):
    """An untrained student (no SFT) distilled with the reward left out of its advantages: the reverse KL to
    the teacher falls and the reward, which it never saw, rises. The fall is not steady: on some CPUs (float
    rounding differs) the KL rests near 0.7 of its start from step 16 to 80 before it falls on, so the run is 160
    steps (0.52 and +0.08 on an AMD EPYC; 80 steps passed on an earlier machine and failed there)."""
    train(prepare("configs/opd.yaml", [*QUICK, f"run.dir={tmp_path}", f"distill.teacher={teacher_dir}",
                                       "sft.steps=0", "run.steps=160", "backend.lr=3e-3"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kl = [r["distill/reverse_kl"] for r in rows]
    reward = [r["reward/mean"] for r in rows]
    assert fmean(kl[-8:]) < 0.6 * fmean(kl[:8]), kl
    assert fmean(reward[-8:]) > fmean(reward[:8]) + 0.03, reward


@pytest.mark.parametrize("overrides, message", [
    (["distill.teacher=/nonexistent"], "distill.teacher '/nonexistent' is not an HF model directory"),
    (["distill.teacher=X", "distill.teacher_url=http://127.0.0.1:1"], "not both"),
    (["distill.kl_coef=0"], "kl_coef and reward_coef are both 0"),
    (["distill.kl_coef=-1"], "distill.kl_coef: expected a number >= 0"),
])
def test_bad_distill_configs_exit_2(tmp_path, capsys, overrides, message):
    code = main(["train", "configs/opd.yaml", f"run.dir={tmp_path / 'run'}", *QUICK, *overrides])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_teacher_with_another_vocabulary_is_refused_before_the_run_starts(tmp_path, capsys):
    config = load_config("configs/retool.yaml")
    other = build_model_dir(config.model.build, config.model.tokenizer, tmp_path / "other", seed=0)
    code = main(["train", "configs/opd.yaml", f"run.dir={tmp_path / 'run'}", *QUICK, f"distill.teacher={other}"])
    assert code == 2 and "need the same tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
