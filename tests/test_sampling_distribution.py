"""rollout.logprobs_of: the engine reports, and the trainer computes, the log-prob of each sampled token under the
distribution it was drawn from (its temperature; top-p/top-k too with ``truncated``), on every log-prob path."""

import collections
import math

import pytest
import torch

from miles.cli import main
from miles.testing import generate_all, local_engine
from miles.models.hf import load_model, save_pretrained
from miles.models.sampling import distribution_logits
from miles.train.torch_backend import TorchBackend
from miles.types import SampledWith, Sample, SampleStatus, TrainBatch

PROMPT = [4, 13, 5, 14]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model whose next-token distributions are peaked (its final norm scaled by 4: the logits are four times a
    random model's), so that temperature, top-p and top-k each change them visibly."""
    from miles.testing import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("peaked") / "built", max_position_embeddings=64)
    model = load_model(path)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    out = tmp_path_factory.mktemp("peaked") / "model"
    from miles.models.hf import load_tokenizer

    save_pretrained(model, load_tokenizer(path), out)
    return out


def _engine(model_dir, logprobs_of="sampling", **kwargs):
    return local_engine(model_dir, logprobs_of=logprobs_of, **kwargs)


_generate = generate_all


def _model_logits(model_dir, ids):
    model = load_model(model_dir).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


# -- the engine: what it reports is the distribution it drew from ----------------------------------------------------

DRAWS = 6000


@pytest.mark.parametrize("logprobs_of, params", [
    ("sampling", {"temperature": 0.7}),
    ("sampling", {"temperature": 1.6}),
    ("truncated", {"temperature": 0.7, "top_p": 0.9}),
    ("truncated", {"temperature": 1.3, "top_k": 3}),
    ("truncated", {"temperature": 1.0, "top_p": 0.6, "top_k": 4}),
    ("model", {"temperature": 1.0}),
])
def test_the_reported_log_prob_is_of_the_distribution_the_token_was_drawn_from(model_dir, logprobs_of, params):
    """6000 first tokens of one prompt: each token's reported probability is its observed frequency (within five
    standard errors), and the same for every draw of it."""
    engine = _engine(model_dir, logprobs_of, max_batch_size=2048)
    answers = _generate(engine, [PROMPT] * DRAWS, {"max_new_tokens": 1, "ignore_eos": True, **params})
    engine.close()
    counts, reported = collections.Counter(), collections.defaultdict(set)
    for answer in answers:
        [(logprob, token, _)] = answer["meta_info"]["output_token_logprobs"]
        counts[token] += 1
        reported[token].add(logprob)
    assert all(max(values) - min(values) < 1e-4 for values in reported.values()), reported  # float rounding only
    probability = {token: math.exp(max(values)) for token, values in reported.items()}
    assert sum(probability.values()) <= 1 + 1e-5
    for token, p in probability.items():
        error = math.sqrt(p * (1 - p) / DRAWS)
        assert abs(counts[token] / DRAWS - p) <= 5 * error + 1e-3, (token, counts[token] / DRAWS, p)


def test_the_model_distribution_is_temperature_one_and_a_greedy_token_is_the_model_s(model_dir):
    """``model`` reports softmax(logits) at any temperature; every mode reports a greedy token under it."""
    expected = _model_logits(model_dir, PROMPT)[-1].log_softmax(-1)
    for logprobs_of, params in (("model", {"temperature": 0.5}), ("sampling", {"temperature": 0.0}),
                                ("truncated", {"temperature": 0.0, "top_p": 0.5, "top_k": 2})):
        engine = _engine(model_dir, logprobs_of)
        [answer] = _generate(engine, [PROMPT], {"max_new_tokens": 1, **params})
        engine.close()
        [(logprob, token, _)] = answer["meta_info"]["output_token_logprobs"]
        assert abs(logprob - float(expected[token])) < 1e-5, (logprobs_of, params)


def test_extreme_temperatures_sample_and_report_finite_log_probs(model_dir):
    """A temperature far below any float32 logit gap is taken as 1e-5 (never an overflow to inf), a huge one is
    uniform; the prompt's log-probs are the model's whatever the temperature."""
    engine = _engine(model_dir)
    tiny, huge = _generate(engine, [PROMPT, PROMPT], {"max_new_tokens": 3, "temperature": 1e-30})[0], \
        _generate(engine, [PROMPT], {"max_new_tokens": 3, "temperature": 1e30})[0]
    engine.close()
    greedy = int(_model_logits(model_dir, PROMPT)[-1].argmax())
    assert tiny["output_ids"][0] == greedy
    assert all(math.isfinite(lp) for lp, _, _ in tiny["meta_info"]["output_token_logprobs"])
    vocab = load_model(model_dir).config.vocab_size
    assert all(abs(lp + math.log(vocab)) < 1e-4 for lp, _, _ in huge["meta_info"]["output_token_logprobs"])


# -- the trainer: the same log-probs, on every path --------------------------------------------------------------------

def _samples(model_dir, logprobs_of, params, exact=False):
    engine = _engine(model_dir, logprobs_of, exact_logprobs=exact)
    prompts = [PROMPT, [7, 13, 2], PROMPT, [3, 13, 9, 14, 2, 2], [7, 13, 2], PROMPT]
    answers = _generate(engine, prompts, {"max_new_tokens": 9, "ignore_eos": True, **params})
    engine.close()
    samples = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        sample = Sample(prompt_ids=list(prompt), group_index=i // 3, status=SampleStatus.COMPLETED, reward=float(i % 2))
        sample.record_sampling(0, params)
        sample.append(answer["output_ids"], [t[0] for t in answer["meta_info"]["output_token_logprobs"]],
                      from_policy=True)
        samples.append(sample)
    return samples


PATHS = {
    "whole": {},
    "chunked": {"logprob_chunk_tokens": 7},
    "tree": {"share_prefixes": "true"},
    "exact": {"exact_logprobs": True},
}
PARAMS = {"sampling": {"temperature": 0.7, "top_p": 0.8}, "truncated": {"temperature": 1.3, "top_p": 0.8, "top_k": 4},
          "model": {"temperature": 0.6}}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("logprobs_of", PARAMS)
def test_the_trainer_computes_the_engine_s_log_probs_on_every_path(model_dir, path, logprobs_of):
    if path == "chunked" and logprobs_of == "truncated":
        pytest.skip("refused at start: the chunked path never holds a token's whole distribution")
    params = PARAMS[logprobs_of]
    samples = _samples(model_dir, logprobs_of, params, exact=path == "exact")
    batch = TrainBatch.from_samples(samples, 0, logprobs_of, None)
    backend = TorchBackend(micro_batch_size=4, **PATHS[path])
    backend.setup(str(model_dir), seed=0)
    trainer = backend.compute_logprobs(batch)
    mask = batch.loss_mask > 0
    gap = (trainer - batch.rollout_logprobs).abs()[mask]
    if path == "exact":
        assert float(gap.max()) == 0.0  # rollout.true_on_policy: bit for bit, at any temperature
    else:
        assert float(gap.max()) < 2e-5, float(gap.max())
    # not the model's own distribution (what a trainer without the temperature computes), except under `model`
    model = TorchBackend(micro_batch_size=4)
    model.setup(str(model_dir), seed=0)
    own = model.compute_logprobs(TrainBatch.from_samples(samples, 0, "model"))
    apart = float((own - batch.rollout_logprobs).abs()[mask].max())
    assert apart < 2e-5 if logprobs_of == "model" else apart > 0.05


def test_each_token_is_taken_at_its_own_temperature(model_dir):
    """A trajectory whose turns were sampled at different temperatures (an agent's choice per request): each
    generated token's log-prob at the temperature it was drawn with; the reference model's too."""
    engine = _engine(model_dir)
    sample = Sample(prompt_ids=list(PROMPT), status=SampleStatus.COMPLETED, reward=1.0)
    for params in ({"temperature": 0.5}, {"temperature": 1.5}, {"temperature": 0.5}):
        params = {**params, "max_new_tokens": 4, "ignore_eos": True}
        [answer] = _generate(engine, [sample.prompt_ids + sample.response_ids], params)
        sample.record_sampling(len(sample.response_ids), params)
        sample.append(answer["output_ids"], [t[0] for t in answer["meta_info"]["output_token_logprobs"]],
                      from_policy=True)
        sample.append([5, 13], None, from_policy=False)  # an observation between turns
    engine.close()
    assert [tuple(entry)[:2] for entry in sample.sampled_with] == [(0, 0.5), (6, 1.5), (12, 0.5)]
    batch = TrainBatch.from_samples([sample], 0, "sampling")
    backend = TorchBackend(micro_batch_size=4)
    backend.setup(str(model_dir), seed=0, ref_model_path=str(model_dir))
    mask = batch.loss_mask > 0
    for computed in (backend.compute_logprobs(batch), backend.ref_logprobs(batch)):
        assert float((computed - batch.rollout_logprobs).abs()[mask].max()) < 2e-5


def test_a_sample_that_recorded_nothing_is_taken_at_the_run_s_sampling(model_dir):
    """A plugin's rollout function that does not record its sampling parameters: the run's ``rollout.sampling``."""
    [sample] = _samples(model_dir, "sampling", {"temperature": 0.7})[:1]
    sample.sampled_with = []
    batch = TrainBatch.from_samples([sample], 0, "sampling", {"temperature": 0.7, "max_new_tokens": 9})
    assert torch.allclose(batch.sampling.temperature[0, len(PROMPT) - 1:], torch.tensor(0.7))
    assert TrainBatch.from_samples([sample], 0, "sampling", {"temperature": 1.0}).sampling is None


def test_truncation_keeps_the_sampled_token_and_its_gradient_flows(model_dir):
    """The trainer's nucleus is of its own logits: a token the engine sampled that it would leave out stays in
    (finite log-prob), and the gradient reaches the logits through temperature and truncation."""
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]], requires_grad=True)
    kept = distribution_logits(logits, torch.tensor([0.5]), torch.tensor([0.5]), torch.tensor([-1]),
                               keep=torch.tensor([3]))
    assert torch.isinf(kept[0, 1]) and torch.isinf(kept[0, 2]) and torch.isfinite(kept[0, 3])
    kept.log_softmax(-1)[0, 3].backward()
    assert logits.grad[0, 1] == 0 and logits.grad[0, 3] != 0


# -- the run: start-up refusals, and what a run records ------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["rollout.logprobs_of=truncated", "backend.logprob_chunk_tokens=64"], "backend.logprob_chunk_tokens must be 0"),
    (["rollout.logprobs_of=truncated", "rollout.engine.name=sglang", "rollout.engine.num_engines=1"],
     "'sglang' reports the sampled tokens' log-probs under sampling or model"),
    (["rollout.logprobs_of=top_p"], "rollout.logprobs_of"),
    (["rollout.engine.logprobs_of=model"], "set by rollout.logprobs_of"),
])
def test_what_cannot_be_matched_is_refused_at_start(overrides, message, capsys):
    assert main(["config", "configs/quickstart.yaml", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_a_run_at_temperature_0_7_trains_on_the_engine_s_distribution(tmp_path, model_dir):
    """The quickstart sampled at 0.7: the trainer's log-probs are the engine's (the gap is float rounding, 0 with
    true on-policy), the saved rollouts keep each sample's temperature, and a replay trains on it too."""
    out = tmp_path / "run"
    assert main(["train", "configs/quickstart.yaml", "run.steps=3", "sft.steps=5", f"run.dir={out}",
                 "rollout.sampling.temperature=0.7", "rollout.sampling.top_p=0.9", "run.save_rollouts=true",
                 "run.eval_size=0"]) == 0
    import json

    from miles.loop.saved_rollouts import read_step

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/rollout_logprob_abs_diff"] < 1e-5 for r in rows if "train/rollout_logprob_abs_diff" in r)
    samples, _ = read_step(out / "rollouts" / "step_000000.npz")
    assert all(s.sampled_with == [SampledWith(0, 0.7, 0.9, -1)] for s in samples)
