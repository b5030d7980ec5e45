"""Speculative sampling in the embedded engine (rollout.engine.speculative): the tokens follow the target's
distribution exactly, greedy decoding gives plain decoding's tokens, and the log-probs are the target's; with each
kind of draft (a separate model, the MTP head the target's checkpoint ships)."""

import asyncio
import contextlib
import copy
import itertools
import json
import logging
import math
import urllib.request

import pytest
import torch

from miles.engine.local import LocalEngine
from miles.engine.speculative import SpeculativeConfig, accept, draft_distribution
from miles.models.hf import exact_logprobs, load_model, load_tokenizer, save_pretrained
from miles.models.sampling import distribution_logits
from miles.testing import build_tiny_model, generate_all, local_engine

PROMPT = [4, 13, 5, 14]
PROMPTS = [PROMPT, [7, 13, 2], [3, 13, 9, 14, 2, 2], [5], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9]]


def _peaked(root, seed, **build):
    """A tiny model with peaked next-token distributions (its final norm scaled by 4) that does not just repeat its
    last token (its blocks' outputs scaled by 20, so that they outweigh the token's own embedding)."""
    path = build_tiny_model(root / "built", seed=seed, max_position_embeddings=64, **build)
    model = load_model(path)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(20.0)
            layer.self_attn.o_proj.weight.mul_(20.0)
    save_pretrained(model, load_tokenizer(path), root / "model")
    return root / "model"


def _learn_head(target_dir):
    """Teach an MTP head built at random the target (DraftLearner, as rollout.engine.speculative.train does each
    step: 384 of its samples at temperature 0.3, ten passes, the target as the policy) and write it into the target's
    checkpoint in DeepSeek-V3's layout (beside the model's file, as those checkpoints ship it). Returns how often
    its proposals were kept before and after, and its losses."""
    from safetensors.torch import save_file

    from miles.loop.draft import DraftLearner
    from miles.models.mtp import published_tensors
    from miles.rollout.plane import RolloutPlane

    spec = {"draft": "mtp", "num_tokens": 3, "when": "always", "force": True, "train": True}
    engine = _engine(target_dir, spec)
    learner = DraftLearner(SpeculativeConfig.parse(spec), str(target_dir), seed=1, lr=1e-2, window=1)
    learner.push(RolloutPlane(local_engines=[engine]))
    start, answers = _acceptance(engine, PROMPTS * 64, {"max_new_tokens": 12, "ignore_eos": True,
                                                        "temperature": 0.3})

    class Policy:  # what the learner reads of a backend
        def export_weights(self):
            return {n: t.clone() for n, t in engine.model.state_dict().items()}

    losses = [learner.learn(_groups(PROMPTS * 64, answers), Policy())["rollout/spec_draft_loss"] for _ in range(10)]
    learner.push(RolloutPlane(local_engines=[engine]))
    end, _ = _acceptance(engine, PROMPTS * 64, {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0.3})
    engine.close()
    config = json.loads((target_dir / "config.json").read_text())
    save_file(published_tensors(learner.model, config["num_hidden_layers"]), str(target_dir / "mtp.safetensors"))
    (target_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return start, end, losses


def _acceptance(engine, prompts, params, **kwargs):
    """The share of the proposals the engine kept while it answered ``prompts``, and the answers."""
    before = engine.stats()
    answers = _generate(engine, prompts, params, **kwargs)
    after = engine.stats()
    kept, proposed = (after[k] - before[k] for k in ("spec_accepted", "spec_proposed"))
    return kept / proposed, answers


def _groups(prompts, answers, policy_tokens=None):
    """One sample a group, as a rollout gives them; a token past ``policy_tokens`` is a tool's (loss mask 0)."""
    from miles.types import Group, Sample, SampleStatus

    groups = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        sample = Sample(prompt_ids=list(prompt), group_index=i, status=SampleStatus.COMPLETED, reward=0.0)
        sample.append(answer["output_ids"][:policy_tokens], None, from_policy=True)
        if policy_tokens is not None:
            sample.append(answer["output_ids"][policy_tokens:], None, from_policy=False)
        groups.append(Group(index=i, samples=[sample]))
    return groups


HEAD = {}  # the target's MTP head as it was taught: acceptance before, after, and its losses


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A peaked target whose checkpoint ships an MTP head it taught (in DeepSeek-V3's layout)."""
    target = _peaked(tmp_path_factory.mktemp("target"), seed=0)
    HEAD["start"], HEAD["end"], HEAD["losses"] = _learn_head(target)
    return target


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """The target's first layer alone (the same seed): it proposes what the target would, some of the time."""
    return _peaked(tmp_path_factory.mktemp("draft"), seed=0, num_layers=1)


@pytest.fixture(params=["model", "mtp"])
def draft(request, draft_dir):
    """Each kind of draft: a separate model (``{path: ...}``), the MTP head the target's checkpoint ships."""
    return {"path": str(draft_dir)} if request.param == "model" else "mtp"


def _spec(draft, **kwargs):
    draft = draft if isinstance(draft, (str, dict)) else {"path": str(draft)}
    return {"draft": draft, "num_tokens": 3, "when": "always", "force": True, **kwargs}


def _engine(model_dir, speculative=None, **kwargs):
    return local_engine(model_dir, speculative=speculative, **kwargs)


_generate = generate_all


# -- the rule itself ---------------------------------------------------------------------------------------------------


def test_accept_keeps_a_proposal_with_probability_p_over_q_and_draws_the_rest_from_the_residual():
    """One position, two tokens: p = (0.3, 0.7), q = (0.9, 0.1). Token 0 is proposed with 0.9 and kept with
    0.3/0.9; token 1 always; what follows a refusal is drawn from max(0, p - q) = (0, 0.6): token 1. The first
    token is then distributed as p."""
    generator = torch.Generator().manual_seed(0)
    draws = 40000
    p = torch.tensor([[0.3, 0.7], [0.5, 0.5]]).expand(draws, 2, 2)
    q = torch.tensor([[0.9, 0.1]]).expand(draws, 1, 2)
    proposals = torch.multinomial(q[:, 0], 1, generator=generator)
    kept, after = accept(p, q, proposals, generator)
    first = torch.where(kept == 1, proposals[:, 0], after)
    assert abs(float((first == 0).float().mean()) - 0.3) < 5 * math.sqrt(0.21 / draws)
    zeros = proposals[:, 0] == 0
    assert abs(float(kept[zeros].float().mean()) - 1 / 3) < 5 * math.sqrt(2 / 9 / int(zeros.sum()))
    assert bool((kept[~zeros] == 1).all())
    assert bool((after[kept == 0] == 1).all())  # the residual's only token


def test_a_greedy_row_keeps_exactly_the_proposals_that_are_the_targets_argmax():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])
    zero = torch.zeros(1, 3)
    p = draft_distribution(logits, zero, torch.ones(1, 3), torch.full((1, 3), -1))
    q = draft_distribution(torch.tensor([[[0.0, 9.0, 0.0], [0.0, 9.0, 0.0]]]), torch.zeros(1, 2), torch.ones(1, 2),
                           torch.full((1, 2), -1))
    kept, after = accept(p, q, torch.tensor([[1, 1]]), None)
    assert kept.tolist() == [1] and after.tolist() == [0]  # 1 is the argmax, then 1 is not: the target's 0


# -- the engine: exactly the target's distribution ---------------------------------------------------------------------

DRAWS = 4000


def _joint(model_dir, params, length):
    """The exact probability of each sequence of ``length`` tokens after PROMPT, under the distribution the engine
    draws from (``params``' temperature, top-p and top-k)."""
    model = load_model(model_dir).eval()
    vocab = model.config.vocab_size
    probs = {(): 1.0}
    for _ in range(length):
        heads = list(probs)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + list(h) for h in heads])).logits[:, -1].float()
        n = len(heads)
        drawn = distribution_logits(logits, torch.full((n,), float(params.get("temperature", 1.0))),
                                    torch.full((n,), float(params.get("top_p", 1.0))),
                                    torch.full((n,), params.get("top_k", -1), dtype=torch.long)).softmax(-1)
        probs = {h + (t,): probs[h] * float(drawn[i, t]) for i, h in enumerate(heads) for t in range(vocab)
                 if drawn[i, t] > 0}
    return probs


def _chi_square(counts, probs, draws):
    """Pearson's statistic over the cells expected at least 5 times (the rest pooled), and its degrees of freedom."""
    big = [c for c, p in probs.items() if p * draws >= 5]
    stat = sum((counts.get(c, 0) - probs[c] * draws) ** 2 / (probs[c] * draws) for c in big)
    rest_expected = draws * (1 - sum(probs[c] for c in big))
    rest = draws - sum(counts.get(c, 0) for c in big)
    if rest_expected >= 5:
        stat += (rest - rest_expected) ** 2 / rest_expected
        return stat, len(big)
    return stat, len(big) - 1


def _critical(df, z=3.72):
    """The chi-square quantile at p = 1e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9},
                                    {"temperature": 1.3, "top_k": 3}])
def test_speculative_tokens_follow_the_targets_distribution(target_dir, draft_dir, draft, params):
    """4000 samples of 3 tokens with 2 proposals a step (each position: kept proposals, residual draws and the
    target's own draw after all are kept). The pairs (tokens 1-2) and the third token pass a chi-square test
    against the target's exact distribution at p = 1e-4, and (a separate draft) fail it against the draft's: the
    test tells them apart."""
    engine = _engine(target_dir, _spec(draft, num_tokens=2), max_batch_size=DRAWS)
    answers = _generate(engine, [PROMPT] * DRAWS, {"max_new_tokens": 3, "ignore_eos": True, **params})
    stats = engine.stats()
    engine.close()
    assert 0.05 < stats["spec_accepted"] / stats["spec_proposed"] < 0.95  # both paths taken, hundreds of times
    seqs = [tuple(a["output_ids"]) for a in answers]
    assert all(len(s) == 3 for s in seqs)
    exact, drafts = _joint(target_dir, params, 3), _joint(draft_dir, params, 3)

    def marginals(joint):
        pairs, thirds = {}, {}
        for seq, p in joint.items():
            pairs[seq[:2]] = pairs.get(seq[:2], 0.0) + p
            thirds[seq[2:]] = thirds.get(seq[2:], 0.0) + p
        return pairs, thirds

    observed = marginals({s: seqs.count(s) for s in set(seqs)})
    for expected, wrong, seen in zip(marginals(exact), marginals(drafts), observed):
        stat, df = _chi_square(seen, expected, DRAWS)
        assert stat < _critical(df), (stat, df, params)
        wrong_stat, wrong_df = _chi_square(seen, wrong, DRAWS)
        assert wrong_stat > _critical(wrong_df) if wrong_df >= 1 and draft != "mtp" else True


def test_greedy_gives_plain_decodings_tokens_and_log_probs(target_dir, draft):
    """Prompts of several lengths, a batch of 2 rows (the others queue and join as rows finish: the draft's cache
    is built again), stop tokens and max_new_tokens that end rows inside a step, the prefix cache on."""
    results = []
    for speculative in (None, _spec(draft)):
        engine = _engine(target_dir, speculative, max_batch_size=2)
        answers = []
        for params in ({"max_new_tokens": 17, "temperature": 0.0, "ignore_eos": True},
                       {"max_new_tokens": 9, "temperature": 0.0, "stop_token_ids": [5, 9]}):
            answers += _generate(engine, PROMPTS + PROMPTS[:2], params)
        answers += asyncio.run(_with_top([4, 13], engine))  # 62 tokens: the masked columns are packed away
        results.append((answers, engine.stats()))
        engine.close()
    (plain, _), (spec, stats) = results
    assert stats["spec_row_forwards"] > 0 and stats["spec_accepted"] < stats["spec_proposed"]
    assert stats["spec_tokens"] > stats["spec_row_forwards"]  # more than one token per target forward
    assert len(plain[-1]["output_ids"]) == 62  # the context (64) less the prompt
    for a, b in zip(plain, spec):
        assert a["output_ids"] == b["output_ids"]
        for key in ("output_top_logprobs", "output_token_entropy"):
            assert len(a["meta_info"].get(key, [])) == len(b["meta_info"].get(key, []))
            for x, y in zip(a["meta_info"].get(key, []), b["meta_info"].get(key, [])):
                assert x == pytest.approx(y, abs=1e-5) if key.endswith("entropy") else \
                    [t for _, t, _ in x] == [t for _, t, _ in y]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        for (la, ta, _), (lb, tb, _) in zip(a["meta_info"]["output_token_logprobs"],
                                            b["meta_info"]["output_token_logprobs"]):
            assert ta == tb and abs(la - lb) <= 1e-6


async def _with_top(prompt, engine):
    return [await engine.generate(prompt, {"max_new_tokens": 80, "temperature": 0.0, "ignore_eos": True},
                                  top_logprobs_num=3, return_entropy=True)]


@pytest.mark.parametrize("draft", [{"build": {"num_layers": 1, "hidden_size": 32, "head_dim": 8}}, "mtp"])
def test_routed_experts_are_the_targets_for_the_tokens_it_took(tmp_path, draft):
    """A mixture-of-experts target: the experts reported for every token fed are those a plain forward over the
    prompt and the outputs routes to (the refused proposals' routing left out; an MTP head's own experts, a block of
    the target's architecture, are not the target's)."""
    import numpy as np

    from miles.models.moe import decode_routed_experts, routing

    moe_dir = build_tiny_model(tmp_path / "moe", arch="qwen3_moe", max_position_embeddings=64)
    engine = _engine(moe_dir, {"draft": draft, "num_tokens": 3, "when": "always", "force": True})
    prompt = [5, 6, 7, 8]
    answer = asyncio.run(engine.generate(prompt, {"max_new_tokens": 12, "ignore_eos": True},
                                         return_routed_experts=True))
    assert engine.stats()["spec_steps"] > 0
    output = answer["output_ids"]
    fed = len(prompt) + len(output) - 1
    routed = decode_routed_experts(answer["meta_info"]["routed_experts"], fed)
    with torch.no_grad(), routing(engine.model) as record:
        engine.model(input_ids=torch.tensor([prompt + output[:-1]]))
    assert np.array_equal(record.routed(1)[0].numpy(), routed)
    engine.close()


@pytest.mark.parametrize("logprobs_of, params", [("sampling", {"temperature": 0.7, "top_p": 0.9}),
                                                 ("truncated", {"temperature": 1.3, "top_k": 4}),
                                                 ("model", {"temperature": 0.8})])
def test_sampled_log_probs_are_the_targets(target_dir, draft, logprobs_of, params):
    """Each reported log-prob is the target's under ``logprobs_of``, computed again over the whole sequence; with
    ``exact_logprobs`` (rollout.true_on_policy) bit for bit that computation."""
    for exact in (False, True):
        engine = _engine(target_dir, _spec(draft), logprobs_of=logprobs_of, exact_logprobs=exact)
        answers = _generate(engine, PROMPTS, {"max_new_tokens": 12, "ignore_eos": True, **params})
        model, columns = engine.model, {}
        for prompt, answer in zip(PROMPTS, answers):
            ids = answer["output_ids"]
            n = len(prompt) - 1
            if logprobs_of != "model":
                columns = {"temperature": torch.tensor([1.0] * n + [params["temperature"]] * len(ids))}
            if logprobs_of == "truncated":
                columns["top_p"] = torch.tensor([1.0] * (n + len(ids)))
                columns["top_k"] = torch.tensor([-1] * n + [params.get("top_k", -1)] * len(ids))
            expected = exact_logprobs(model, prompt + ids, length=64, pad_token_id=0, **columns)[n:].tolist()
            got = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
            tolerance = 0.0 if exact else 1e-5
            assert max(abs(a - b) for a, b in zip(got, expected)) <= tolerance, (exact, logprobs_of)
        assert engine.stats()["spec_row_forwards"] > 0
        engine.close()


def test_a_draft_that_agrees_gives_k_plus_one_tokens_per_target_forward(target_dir):
    """The speed-up's mechanism, counted (not timed): the target as its own draft, greedy, keeps every proposal, so
    each target forward of a row gives k + 1 tokens (the last step of a row may stop short at max_new_tokens)."""
    k = 4
    engine = _engine(target_dir, {"draft": {"path": str(target_dir)}, "num_tokens": k, "when": "always",
                                  "force": True})
    answers = _generate(engine, PROMPTS, {"max_new_tokens": 50, "temperature": 0.0, "ignore_eos": True})
    stats = engine.stats()
    engine.close()
    assert all(len(a["output_ids"]) == 50 for a in answers)
    assert stats["spec_accepted"] == stats["spec_proposed"]
    # 49 tokens after the first (sampled at prefill): 9 full steps of 5 and one of 4, per row
    assert stats["spec_row_forwards"] == len(PROMPTS) * 10
    assert stats["spec_tokens"] / stats["spec_row_forwards"] >= k


def test_an_abort_and_a_weight_update_between_speculative_steps(target_dir, draft, monkeypatch):
    """Between two speculative steps (the third and the fourth): a weight update lands, and the tokens after it are
    sampled by the new weights (each token's version says which); an abort then ends one row with what it has."""
    import miles.engine.batcher as batcher_module

    engine = _engine(target_dir, _spec(draft))
    new = {n: t * 1.01 if t.is_floating_point() else t for n, t in engine.model.state_dict().items()}
    steps = []
    original = batcher_module.ContinuousBatcher._iteration

    def iteration(self):
        original(self)
        steps.append(len(self._rows))
        if len(steps) == 3:
            engine.update_weights(new, weight_version=5)  # outside the step lock, as a push between steps
        if len(steps) == 5:
            self.abort("second")

    monkeypatch.setattr(batcher_module.ContinuousBatcher, "_iteration", iteration)

    async def go():
        params = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
        return await asyncio.gather(engine.generate(PROMPTS[0], params, rid="first"),
                                    engine.generate(PROMPTS[1], params, rid="second"))

    first, second = asyncio.run(go())
    engine.close()
    assert second["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(second["output_ids"]) < 40
    assert len(second["meta_info"]["output_token_logprobs"]) == len(second["output_ids"])
    versions = first["meta_info"]["output_token_weight_versions"]
    assert len(first["output_ids"]) == 40 and versions == sorted(versions) and {0, 5} == set(versions)
    changed = versions.index(5)
    plain = _engine(target_dir)  # the tokens after the update: the new weights' greedy continuation
    plain.update_weights(new, weight_version=5)
    [after] = _generate(plain, [PROMPTS[0] + first["output_ids"][:changed]],
                        {"max_new_tokens": 40 - changed, "temperature": 0.0, "ignore_eos": True})
    plain.close()
    assert after["output_ids"] == first["output_ids"][changed:]


def test_a_vision_language_target_speculates_with_a_text_draft(vlm_model_dir, tmp_path):
    """A Qwen2.5-VL target and a text model with its tokenizer as the draft: with images in the prompts, greedy
    answers and log-probs are plain decoding's (the target sees the images; the draft proposes from the text); a
    built draft is refused (it would be a vision-language model too)."""
    from miles.testing.fixtures import CHAT_ALPHABET, VISION_TOKENIZER
    from miles.testing.vision import VISION_PROMPT, draw_dots, png_bytes

    draft = _peaked(tmp_path, seed=0, alphabet=CHAT_ALPHABET, tokenizer=VISION_TOKENIZER)
    image = tmp_path / "dots.png"
    image.write_bytes(png_bytes(draw_dots(3, "red")))
    tokenizer = load_tokenizer(vlm_model_dir)
    prompts = [tokenizer.encode(VISION_PROMPT), tokenizer.encode("no image here: ")]
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    answers = []
    for speculative in (None, _spec(draft)):
        engine = _engine(vlm_model_dir, speculative)

        async def go():
            return await asyncio.gather(engine.generate(prompts[0], params, image_data=str(image)),
                                        engine.generate(prompts[1], params))

        answers.append(asyncio.run(go()))
        if speculative is not None:
            stats = engine.stats()
            assert stats["spec_accepted"] < stats["spec_proposed"], stats  # refused proposals: residual draws
        engine.close()
    for plain, spec in zip(*answers):
        assert plain["output_ids"] == spec["output_ids"]
        assert max(abs(a[0] - b[0]) for a, b in zip(plain["meta_info"]["output_token_logprobs"],
                                                    spec["meta_info"]["output_token_logprobs"])) <= 1e-5
    for built in ({"build": {"num_layers": 1}}, "mtp"):
        with pytest.raises(ValueError, match="a vision-language target takes a text draft model from a directory"):
            _engine(vlm_model_dir, {"draft": built, "force": True})


# -- when it speculates --------------------------------------------------------------------------------------------


def test_tail_speculates_only_while_few_rows_decode(target_dir, draft_dir):
    engine = _engine(target_dir, _spec(draft_dir, when="tail", tail_rows=2))
    lengths = [3, 5, 8, 30, 40]
    answers = _generate(engine, [[4, 13, 5]] * len(lengths),
                        {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 40})
    stats = engine.stats()
    engine.close()
    assert all(len(a["output_ids"]) == 40 for a in answers)
    assert stats["spec_steps"] == 0  # five rows all along: never the tail
    engine = _engine(target_dir, _spec(draft_dir, when="tail", tail_rows=2))

    async def staggered():
        return await asyncio.gather(*(engine.generate([4, 13, 5], {"temperature": 0.0, "ignore_eos": True,
                                                                   "max_new_tokens": n}) for n in lengths))

    answers = asyncio.run(staggered())
    stats = engine.stats()
    engine.close()
    assert [len(a["output_ids"]) for a in answers] == lengths
    assert 0 < stats["spec_steps"] < stats["decode_steps"]
    assert stats["spec_row_forwards"] <= 2 * stats["spec_steps"]


def test_a_draft_that_cannot_pay_is_switched_off_and_the_engine_says_so(target_dir, draft_dir, caplog):
    with caplog.at_level(logging.WARNING):
        engine = _engine(target_dir, {"draft": {"path": str(draft_dir)}, "num_tokens": 3})
    assert "speculative decoding is off" in caplog.text and "cannot pay" in caplog.text
    _generate(engine, PROMPTS[:1], {"max_new_tokens": 5})
    assert engine.stats()["spec_steps"] == 0
    engine.close()


# -- bad drafts and settings -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, message", [
    ("mtp", "expected a mapping"),
    ({"draft": "mpt"}, r"expected \{path: DIR\}.* or mtp \(a multi-token-prediction head"),
    ({"draft": {"repo": "x"}}, r"expected \{path: DIR\}"),
    ({"draft": {"build": {"hidden_size": 0}}}, r"build.hidden_size: expected an integer >= 1"),
    ({"draft": {"build": {"vocab_size": 5}}}, "unknown field.*vocab_size"),
    ({"draft": {"path": "/d"}, "num_tokens": 0}, r"num_tokens: expected an integer in \[1, 16\]"),
    ({"draft": {"path": "/d"}, "num_tokens": True}, r"num_tokens: expected an integer in \[1, 16\]"),
    ({"draft": {"path": "/d"}, "when": "sometimes"}, "when: expected one of tail, always"),
    ({"draft": {"path": "/d"}, "tail_rows": -1}, "tail_rows: expected an integer >= 1"),
    ({"draft": {"path": "/d"}, "train": "yes"}, "train: expected true or false"),
    ({"draft": {"path": "/d"}, "lr": 0}, r"lr: expected a learning rate in \(0, 1\)"),
    ({"draft": {"path": "/d"}, "draft_tokens": 3}, "unknown key.*draft_tokens"),
])
def test_bad_settings_are_refused_naming_the_field(spec, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(spec)
    with pytest.raises(ValueError, match=message):
        LocalEngine(speculative=spec)


def test_a_draft_with_another_tokenizer_is_refused_at_start(target_dir, tmp_path):
    with pytest.raises(ValueError, match="speculative.draft.path .* is not an HF model directory"):
        _engine(target_dir, _spec(tmp_path / "nowhere"))
    other = build_tiny_model(tmp_path / "other", alphabet="abcdefghijkl", max_position_embeddings=64)
    with pytest.raises(ValueError, match="its tokenizer is not the target's"):
        _engine(target_dir, _spec(other))
    wider = build_tiny_model(tmp_path / "wider", alphabet="0123456789+=xyz", max_position_embeddings=64)
    with pytest.raises(ValueError, match="its vocabulary has .* tokens, the target's"):
        _engine(target_dir, _spec(wider))


def test_a_bad_draft_fails_the_run_before_anything_is_written(tmp_path, capsys):
    """The run's checks build the engine and check its draft before SFT: exit 2 naming the draft, no run directory."""
    import re

    from miles.cli import main

    for override, message in (("{draft: {path: /nowhere}}", "speculative.draft.path '/nowhere' is not an HF model"),
                              ("{draft: mtp, num_tokens: 17}", r"num_tokens: expected an integer in \[1, 16\]"),
                              ("{draft: {build: {num_layers: 1}}, when: later}", "when: expected one of")):
        code = main(["train", "configs/quickstart.yaml", "run.progress=false", f"run.dir={tmp_path / 'run'}",
                     f"rollout.engine.speculative={override}"])
        err = capsys.readouterr().err
        assert code == 2 and re.search(message, err), err
        assert "sft:" not in err and not (tmp_path / "run").exists()


# -- the draft's weights ---------------------------------------------------------------------------------------------


def test_draft_weights_load_with_the_policys_and_bad_ones_apply_nothing(target_dir, draft):
    engine = _engine(target_dir, _spec(draft))
    policy = {n: t.clone() for n, t in engine.model.state_dict().items()}
    draft = {f"draft.{n}": t + 0.5 for n, t in engine.draft.state_dict().items() if t.is_floating_point()}
    version = engine.update_weights({**policy, **draft}, weight_version=7)
    assert version == 7
    assert all(torch.equal(engine.draft.state_dict()[n[6:]], t) for n, t in draft.items())
    before = {n: t.clone() for n, t in engine.draft.state_dict().items()}
    assert engine.update_weights({"draft." + n: t * 2 for n, t in before.items()}) == 7  # alone: same version
    broken = {**policy, **{n: t.clone() for n, t in draft.items()}}
    broken.pop(next(iter(policy)))  # the policy's part lacks a tensor: the draft's must not load either
    with pytest.raises(ValueError, match="1 missing"):
        engine.update_weights(broken)
    assert all(torch.equal(engine.draft.state_dict()[n], before[n] * 2) for n in before)
    with pytest.raises(ValueError, match="the draft's: 1 missing"):
        engine.update_weights({"draft." + n: t for n, t in itertools.islice(before.items(), 1, None)})
    [answer] = _generate(engine, [PROMPT], {"max_new_tokens": 6, "temperature": 0.0})
    assert len(answer["output_ids"]) == 6
    engine.close()
    plain = _engine(target_dir)
    with pytest.raises(ValueError, match="has no draft"):
        plain.update_weights({"draft.x": torch.zeros(1)})
    plain.close()


# -- a draft that keeps up ---------------------------------------------------------------------------------------------


def test_a_draft_that_learns_the_policys_samples_is_kept_more_often(target_dir, tmp_path):
    """A draft built at random learns 768 of the target's samples (DraftLearner, as rollout.engine.speculative.train
    does each step) and is pushed to the engine: its proposals are kept more often, the loss fell, and a tool's
    tokens (loss mask 0) are not learnt. Learning the policy's distributions (its exported weights) teaches more;
    a backend that exports adapters only leaves the sampled tokens' cross-entropy. (Ten passes over the same
    rollouts: the learners keep a window of one step.)"""
    from miles.loop.draft import DraftLearner
    from miles.rollout.plane import RolloutPlane

    spec = {"draft": {"build": {"num_layers": 1}}, "num_tokens": 3, "when": "always", "force": True, "train": True}
    engine = _engine(target_dir, spec)
    plane = RolloutPlane(local_engines=[engine])
    learner = DraftLearner(SpeculativeConfig.parse(spec), str(target_dir), seed=1, lr=1e-2, window=1)
    learner.push(plane)
    assert all(torch.equal(engine.draft.state_dict()[n[6:]], t) for n, t in learner.weights().items())
    params = {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0.3}

    def rate():
        return _acceptance(engine, PROMPTS * 128, params)

    start, answers = rate()
    groups = _groups(PROMPTS * 128, answers, policy_tokens=8)  # the tokens after 8 are a tool's: never learnt
    losses = [learner.learn(groups)["rollout/spec_draft_loss"] for _ in range(10)]
    assert losses[-1] < losses[0] - 0.25
    learner.push(plane)
    end, _ = rate()
    assert end > start + 0.04, (start, end)  # 0.33 -> 0.38 with a one-layer draft of a two-layer target

    class Policy:  # what the learner reads of a backend
        def export_weights(self):
            return {n: t.clone() for n, t in engine.model.state_dict().items()}

    distilled = DraftLearner(SpeculativeConfig.parse(spec), str(target_dir), seed=1, lr=1e-2, window=1)
    kl = [distilled.learn(groups, Policy())["rollout/spec_draft_loss"] for _ in range(10)]
    assert kl[-1] < kl[0] / 2  # the KL to the policy's own distribution, at the samples' temperature (0.3)
    distilled.push(plane)
    assert rate()[0] > end + 0.04  # the policy's distributions teach more than its samples

    class Adapters:
        def export_weights(self):
            return {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)}

    fallback = DraftLearner(SpeculativeConfig.parse(spec), str(target_dir), seed=1, lr=1e-2, window=1)
    assert fallback.learn(groups, Adapters())["rollout/spec_draft_loss"] == pytest.approx(losses[0], rel=1e-4)
    engine.close()


def test_an_mtp_head_learns_the_policy_on_its_hidden_states(target_dir):
    """The target's MTP head was built at random and taught by DraftLearner (``draft: mtp``, the target_dir
    fixture): the KL from the policy's distribution fell, and the engine kept its proposals far more often once
    the head was pushed (0.19 -> 0.75 here: a head that reads the target's hidden states learns more than a
    separate one-layer draft, 0.33 -> 0.38 from the samples alone)."""
    losses = HEAD["losses"]
    assert losses[-1] < losses[0] / 4, losses
    assert HEAD["start"] < 0.35 and HEAD["end"] > HEAD["start"] + 0.3, HEAD


@pytest.mark.parametrize("layout, stored", [("deepseek_v3", "float"), ("qwen3_next", "float"),
                                           ("deepseek_v3", "fp8_block")])
def test_an_mtp_head_a_checkpoint_ships_is_the_draft_in_each_published_layout(target_dir, tmp_path, layout, stored):
    """The taught head written in each published layout (DeepSeek-V3's also with its copies of the embedding and
    output layer), in float or in block FP8 with a ``weight_scale_inv`` per 128x128 block as DeepSeek-V3 ships it:
    the engine's draft and the DraftLearner's start from it (each FP8 layer dequantized), the model itself loads
    as it does without it, and greedy answers are plain decoding's. A head with a tensor missing is refused at
    start, naming it; a checkpoint without a head gets one built at random, and the engine says so."""
    import shutil

    from safetensors.torch import load_file, save_file

    from miles.loop.draft import DraftLearner
    from miles.models.hf import load_model_config
    from miles.models.mtp import checkpoint_head, published_tensors
    from miles.precision.linear import quantize_weights, target_modules
    from miles.precision.schemes import Fp8Block

    taught = checkpoint_head(target_dir, load_model_config(target_dir))
    out = shutil.copytree(target_dir, tmp_path / "model")
    (out / "mtp.safetensors").unlink()
    config = json.loads((out / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    layers = config["num_hidden_layers"]
    head = published_tensors(taught, layers, layout)
    model = load_model(target_dir)
    expected = {n: t.clone() for n, t in taught.state_dict().items()}
    if layout == "deepseek_v3":
        config["num_nextn_predict_layers"] = 1
        head[f"model.layers.{layers}.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
        head[f"model.layers.{layers}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    if stored == "fp8_block":
        weights = {**load_file(str(out / "model.safetensors")), **head}
        quantized = target_modules(model) + [n.removesuffix(".weight") for n in head if n.endswith("proj.weight")]
        save_file(quantize_weights(weights, Fp8Block(), quantized), str(out / "model.safetensors"))
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
        scheme = Fp8Block()
        expected = {n: scheme.dequantize(scheme.quantize(t)) if n.endswith("proj.weight") else t
                    for n, t in expected.items()}
    else:
        save_file(head, str(out / "mtp.safetensors"))
    (out / "config.json").write_text(json.dumps(config))

    engine = _engine(out, _spec("mtp"))
    assert engine.draft.state_dict().keys() == expected.keys()
    assert all(torch.equal(engine.draft.state_dict()[n], t) for n, t in expected.items())
    learner = DraftLearner(SpeculativeConfig.parse(_spec("mtp")), str(out), seed=3)
    assert all(torch.equal(learner.model.state_dict()[n], t) for n, t in expected.items())
    float_model = model.state_dict()
    loaded = load_model(out).state_dict()
    assert loaded.keys() == float_model.keys()
    if stored == "float":
        assert all(torch.equal(loaded[n], t) for n, t in float_model.items())
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    spec_answers = _generate(engine, PROMPTS, params)
    assert engine.stats()["spec_accepted"] > 0
    engine.close()
    plain = _engine(out)
    assert [a["output_ids"] for a in _generate(plain, PROMPTS, params)] == [a["output_ids"] for a in spec_answers]
    plain.close()

    if stored == "float":
        missing = next(n for n in head if n.endswith("o_proj.weight"))
        save_file({n: t for n, t in head.items() if n != missing}, str(out / "mtp.safetensors"))
        with pytest.raises(ValueError, match=r"its MTP head misses block\.layers\.0\.self_attn\.o_proj\.weight"):
            _engine(out, _spec("mtp"))
        (out / "mtp.safetensors").unlink()
        with caplog_at_info() as messages:
            engine = _engine(out, _spec("mtp"))
        engine.close()
        assert any("ships no MTP head; one is built at random" in m for m in messages)


@contextlib.contextmanager
def caplog_at_info():
    """The messages logged (at INFO and above) while the block runs."""
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler, root = Keep(level=logging.INFO), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_rows_that_join_and_leave_a_speculating_batch_are_all_answered(target_dir, draft):
    """Many short requests through a batch of 3 (rows end at their first token or a few later, new ones join,
    the draft's cache is built again and again): every request is answered in full, none fails."""
    engine = _engine(target_dir, _spec(draft), max_batch_size=3)
    answers = _generate(engine, PROMPTS * 8, {"max_new_tokens": 6, "temperature": 1.0, "stop_token_ids": [5, 9]})
    stats = engine.stats()
    engine.close()
    assert stats["spec_steps"] > 10
    reasons = [a["meta_info"]["finish_reason"]["type"] for a in answers]
    assert set(reasons) <= {"stop", "length"} and "stop" in reasons, reasons


def test_the_mtp_heads_cache_kept_step_by_step_is_the_one_built_at_once(target_dir, monkeypatch):
    """After each verifying forward, the head's columns are computed again from the target's hidden states; they
    equal the columns a head builds from scratch over the same tokens (a run that builds the cache again before
    every step): the same proposals and distributions at every step, and the same tokens."""
    import miles.engine.draft as drafts
    from miles.engine import speculative_step

    propose, decode = drafts.MTPDraft.propose, speculative_step.SpeculativeStep._speculative_decode
    runs = []
    for rebuild in (False, True):
        seen = []

        def proposing(self, *args, **kwargs):
            proposals, q = propose(self, *args, **kwargs)
            seen.append((proposals.clone(), q.clone()))
            return proposals, q

        def decoding(self):
            if rebuild:
                self.draft.reset()  # built again, at once, from the rows' tokens
            return decode(self)

        monkeypatch.setattr(drafts.MTPDraft, "propose", proposing)
        monkeypatch.setattr(speculative_step.SpeculativeStep, "_speculative_decode", decoding)
        engine = _engine(target_dir, _spec("mtp"), max_batch_size=2)
        answers = _generate(engine, PROMPTS, {"max_new_tokens": 17, "temperature": 0.0, "ignore_eos": True})
        engine.close()
        monkeypatch.undo()
        runs.append((seen, [a["output_ids"] for a in answers]))
    (steps, tokens), (rebuilt, rebuilt_tokens) = runs
    assert tokens == rebuilt_tokens and len(steps) == len(rebuilt) > 10
    for (proposals, q), (again, q_again) in zip(steps, rebuilt):
        assert torch.equal(proposals, again)
        assert torch.allclose(q, q_again, atol=1e-5)


def test_a_draft_learns_the_rollouts_of_the_last_train_window_steps(target_dir):
    """``train_window``: each step the draft learns, towards the policy of now, that step's rollouts after those of
    the steps before it in the window (oldest first): with a window of 2, learning A then B is learning A then A and
    B together, and the step before the window is no longer learnt. The window is in the checkpoint: a loaded draft
    goes on as the saved one. (That a window keeps the draft closer to a moving policy is
    benchmarks/speculative_training.py's figure.)"""
    from miles.loop.draft import DraftLearner
    from miles.types import Group, Sample, SampleStatus

    gen = torch.Generator().manual_seed(0)

    def step_groups():  # 32 samples: two batches of 16
        groups = []
        for i in range(32):
            sample = Sample(prompt_ids=torch.randint(1, 14, (4,), generator=gen).tolist(), group_index=i,
                            status=SampleStatus.COMPLETED, reward=0.0)
            sample.append(torch.randint(1, 14, (8,), generator=gen).tolist(), None, from_policy=True)
            groups.append(Group(index=i, samples=[sample]))
        return groups

    class Policy:  # what the learner reads of a backend: the target's weights
        def export_weights(self):
            return load_model(target_dir).state_dict()

    spec = {"draft": {"build": {"num_layers": 1}}, "num_tokens": 2, "train": True}

    def learner(window):
        config = SpeculativeConfig.parse({**spec, "train_window": window})
        return DraftLearner(config, str(target_dir), seed=1, lr=1e-3, window=config.train_window)

    a, b, c = step_groups(), step_groups(), step_groups()
    windowed, single = learner(2), learner(1)
    assert windowed.learn(a, Policy()) == single.learn(a, Policy())
    assert windowed.learn(b, Policy()) == single.learn(a + b, Policy())
    assert windowed.learn(c, Policy()) == single.learn(b + c, Policy())  # a has left the window
    assert all(torch.equal(t, single.model.state_dict()[k]) for k, t in windowed.model.state_dict().items())

    loaded = learner(2)
    loaded.load_state_dict(copy.deepcopy(windowed.state_dict()))  # as a checkpoint holds it: not the live tensors
    later = step_groups()
    assert loaded.learn(later, Policy()) == windowed.learn(later, Policy())
    with pytest.raises(ValueError, match="train_window: expected an integer >= 1, got 0"):
        SpeculativeConfig.parse({**spec, "train_window": 0})


@pytest.mark.parametrize("draft, broken", [
    ({"build": {"num_layers": 1}}, "2 with NaN or inf values: model.embed_tokens"),  # tied to the output layer
    ("mtp", "1 with NaN or inf values: block.layers.0.self_attn.q_proj")])
def test_a_served_engine_speculates_and_takes_the_drafts_pushes_over_http(target_dir, tmp_path, draft, broken):
    """``miles engine serve`` (the miles_server launcher) with a draft: greedy answers are plain decoding's, its
    /server_info counts the speculative steps, and a DraftLearner's push reaches the draft through the router
    (/update_weights_from_tensor) without changing the served version."""
    from miles.engine.launchers import MilesServerLauncher
    from miles.engine.router import Router
    from miles.loop.draft import DraftLearner
    from miles.rollout.plane import RolloutPlane
    from miles.testing import free_port

    spec = {"draft": draft, "num_tokens": 3, "when": "always", "force": True, "train": True}
    launcher = MilesServerLauncher(log_dir=str(tmp_path), speculative=spec)
    url = launcher.start(str(target_dir), host="127.0.0.1", port=free_port(), admin_token="", threads=1,
                         timeout_s=120)
    plane = RolloutPlane(router=Router([url], health_interval_s=0.2))
    try:
        params = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}
        plain = _engine(target_dir)
        expected = _generate(plain, PROMPTS, params)
        plain.close()

        async def served():
            return await asyncio.gather(*(plane.router.generate(p, params, True) for p in PROMPTS))

        assert [a["output_ids"] for a in plane.run(served())] == [a["output_ids"] for a in expected]
        assert plane.prefill_counts()[2] > 0  # spec_row_forwards, as the plane reads them
        learner = DraftLearner(SpeculativeConfig.parse(spec), str(target_dir), seed=9)
        with torch.no_grad():
            for p in learner.model.parameters():
                p.add_(0.01)
        learner.push(plane)
        checksum = json.loads(urllib.request.urlopen(url + "/server_info", timeout=30).read())
        assert checksum["weight_version"] == 0
        assert [a["output_ids"] for a in plane.run(served())] == [a["output_ids"] for a in expected]
        with torch.no_grad():
            next(learner.model.parameters()).fill_(float("nan"))
        # refused by the draft's own check: the push reached the draft
        with pytest.raises(ValueError, match=f"the draft's: {broken}"):
            learner.push(plane)
    finally:
        plane.close()
        launcher.stop()


def test_speculation_decodes_one_row_faster_than_plain_decoding(tmp_path):
    """The speed-up's regression check (benchmarks/speculative.py measures it): a target of 8 layers whose last 7
    add nothing (their output projections are zero: the draft's function, the target's cost) and its first layer
    as the draft, greedy, 4 proposals, one row. In three back-to-back pairs, the best pair's speed-up must exceed
    1.2x (about 2x here); a load burst slows one side of one pair, a regression every pair."""
    import time

    import torch

    build = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=1024,
                 max_position_embeddings=256)
    target_dir = build_tiny_model(tmp_path / "target", num_layers=8, **build)
    model = load_model(target_dir)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    save_pretrained(model, load_tokenizer(target_dir), tmp_path / "target_model")
    model.model.layers = model.model.layers[:1]
    model.config.layer_types, model.config.num_hidden_layers = model.config.layer_types[:1], 1
    save_pretrained(model, load_tokenizer(target_dir), tmp_path / "draft_model")
    params = {"max_new_tokens": 120, "temperature": 0.0, "ignore_eos": True}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engines = [_engine(tmp_path / "target_model"),
                   _engine(tmp_path / "target_model", {"draft": {"path": str(tmp_path / "draft_model")},
                                                       "num_tokens": 4, "when": "always", "force": True})]

        def timed(engine):
            start = time.perf_counter()
            [answer] = _generate(engine, [PROMPT], params)
            return time.perf_counter() - start, answer["output_ids"]

        for engine in engines:
            timed(engine)  # warm-up
        pairs = []
        for repeat in range(3):
            order = engines if repeat % 2 == 0 else engines[::-1]
            results = {id(e): timed(e) for e in order}
            (plain_s, plain_ids), (spec_s, spec_ids) = results[id(engines[0])], results[id(engines[1])]
            assert plain_ids == spec_ids
            pairs.append(plain_s / spec_s)
    finally:
        torch.set_num_threads(threads)
        for engine in engines:
            engine.close()
    print(f"speculative speed-up of one row, three pairs: {pairs}")
    assert max(pairs) > 1.2, pairs


def test_a_resumed_run_continues_with_the_draft_it_had_learnt(tmp_path):
    """The draft's weights and optimizer state are in the checkpoint: a run interrupted after step 3 and resumed
    logs the same acceptance and draft loss at every step as the run that was not interrupted."""
    from miles import hookimpl
    from miles.run.runner import prepare, train

    class InterruptAt:
        def __init__(self, step):
            self.step = step

        @hookimpl
        def miles_train_step_end(self, step, metrics):
            if step == self.step:
                raise KeyboardInterrupt

    args = ["sft.steps=10", "run.steps=6", "run.save_every=2", "run.eval_size=0", "run.progress=false",
            "rollout.prompts_per_step=4"]

    def metrics(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r.get("rollout/spec_accept_rate"), r.get("rollout/spec_draft_loss")) for r in rows]

    train(prepare("configs/quickstart_speculative.yaml", [*args, f"run.dir={tmp_path / 'whole'}"]))
    with pytest.raises(KeyboardInterrupt):
        train(prepare("configs/quickstart_speculative.yaml", [*args, f"run.dir={tmp_path / 'cut'}"],
                      extra_plugins=[("interrupt", InterruptAt(3))]))
    train(prepare("configs/quickstart_speculative.yaml", [*args, f"run.dir={tmp_path / 'cut'}", "run.resume=true"],
                  extra_plugins=[("interrupt", InterruptAt(-1))]))  # the same plugin stack, never stopping
    whole = metrics(tmp_path / "whole")
    assert all(loss is not None for _, _, loss in whole) and len(whole) == 6
    assert metrics(tmp_path / "cut") == whole
