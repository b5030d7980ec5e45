"""rollout.true_on_policy: the engine's log-probs of the tokens it sampled are bit-identical to the trainer's, whatever
the batch composition (continuous batching with prompts of mixed lengths on one side, other micro-batches on the
other), for a dense model on CPU."""

import asyncio
import json
import random

import pytest
import torch

from miles.cli import main
from miles.engine.local import LocalEngine
from miles.models.hf import exact_logprobs, load_model
from miles.train.torch_backend import TorchBackend
from miles.types import Sample, SampleStatus, TrainBatch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from miles.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("exact") / "model", max_position_embeddings=96, num_layers=2)


def test_a_position_s_log_prob_does_not_depend_on_what_follows_it_or_the_batch(model_dir):
    model = load_model(model_dir).eval()
    torch.manual_seed(0)
    ids = torch.randint(3, 15, (40,)).tolist()
    with torch.no_grad():
        whole = exact_logprobs(model, ids, length=96, pad_token_id=0)
        prefix = exact_logprobs(model, ids[:25], length=96, pad_token_id=0)
        other = exact_logprobs(model, ids[:25] + [5] * 30, length=96, pad_token_id=2)
        batched = model(input_ids=torch.tensor([ids, ids[:20] + [1] * 20])).logits[0, :-1].float().log_softmax(-1)
    assert torch.equal(whole[:24], prefix) and torch.equal(prefix, other[:24])
    # the ordinary batched forward is what differs: the reason for the exact path
    assert batched.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).sub(whole).abs().max() < 1e-4


def _rollouts(model_dir, exact: bool, prompts: list[list[int]]) -> list[Sample]:
    engine = LocalEngine(seed=0, exact_logprobs=exact)
    engine.load_model(str(model_dir))

    async def generate():
        return await asyncio.gather(*(engine.generate(p, {"max_new_tokens": 12 + i % 7, "temperature": 1.0})
                                      for i, p in enumerate(prompts)))

    answers = asyncio.run(generate())
    engine.close()
    samples = []
    for prompt, answer in zip(prompts, answers):
        sample = Sample(prompt_ids=list(prompt), status=SampleStatus.COMPLETED, reward=0.0)
        sample.append(answer["output_ids"], [t[0] for t in answer["meta_info"]["output_token_logprobs"]],
                      from_policy=True)
        sample.metadata["sampling_gap"] = answer["meta_info"].get("sampling_logprob_abs_diff_max")
        samples.append(sample)
    return samples


def _trainer_gap(model_dir, samples, micro_batch_size: int, exact: bool) -> float:
    backend = TorchBackend(exact_logprobs=exact, micro_batch_size=micro_batch_size)
    backend.setup(str(model_dir), seed=0)
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    with torch.no_grad():
        logprobs = backend.compute_logprobs(batch)
    return float(((logprobs - batch.rollout_logprobs).abs() * batch.loss_mask).max())


def test_engine_and_trainer_log_probs_are_bit_identical_whatever_the_batches(model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 15) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    samples = _rollouts(model_dir, True, prompts)
    assert all(s.response_ids for s in samples)
    # the trainer sees other batches: shuffled, in micro-batches of 1, 5 and all
    shuffled = samples[:]
    rng.shuffle(shuffled)
    for micro in (1, 5, 256):
        assert _trainer_gap(model_dir, shuffled, micro, exact=True) == 0.0
    # the decode that sampled the tokens differs from the exact log-probs by float rounding only, and says so
    assert all(0.0 <= s.metadata["sampling_gap"] < 1e-4 for s in samples)


def test_without_it_the_engine_and_trainer_differ(model_dir):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 15) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    gap = _trainer_gap(model_dir, _rollouts(model_dir, False, prompts), 256, exact=False)
    assert 0.0 < gap < 1e-3


@pytest.mark.parametrize("true_on_policy", [True, False])
def test_a_run_reports_the_gap_every_step(tmp_path, true_on_policy):
    run_dir = tmp_path / "run"
    code = main(["train", "configs/quickstart.yaml", f"run.dir={run_dir}", "run.steps=3", "sft.steps=2",
                 "rollout.prompts_per_step=4", "rollout.n_samples=4", "run.eval_size=0", "run.progress=false",
                 f"rollout.true_on_policy={str(true_on_policy).lower()}"])
    assert code == 0
    gaps = [json.loads(line)["train/logprob_abs_diff_max"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(gaps) == 3
    assert all(gap == 0.0 for gap in gaps) if true_on_policy else all(0.0 < gap < 1e-4 for gap in gaps)


@pytest.mark.parametrize("override, message", [
    ("rollout.engine={name: miles_server, num_engines: 1}", "needs the local engine"),
    ("model.build.arch=qwen3_moe", "dense models only"),
])
def test_what_true_on_policy_cannot_do_is_refused_at_start(override, message, capsys):
    assert main(["config", "configs/quickstart.yaml", "rollout.true_on_policy=true", override]) == 2
    assert message in capsys.readouterr().err
