"""Mixture-of-experts models: a tiny Qwen3-MoE built from the config, routing recorded and replayed
(``miles.models.moe``), the engine's ``routed_experts`` in SGLang's form, samples that keep them through partial
rollouts and multi-turn trajectories, and R3 in the trainer: its routing equals the engine's, and the
rollout/train log-prob gap is smaller than without it."""

import asyncio

import numpy as np
import pytest
import torch

from miles.train.losses import ppo_clip
from miles.builtin.selectors import OverSampling
from miles.cli import main
from miles.engine.local import LocalEngine
from miles.models.hf import load_model, load_tokenizer
from miles.models.moe import compact, decode_routed_experts, encode_routed_experts, expand, moe_layout, routing
from miles.rollout.collect import GroupCollector
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import PromptSource
from miles.rollout.multi_turn import MultiTurn
from miles.rollout.single_turn import single_turn
from miles.testing import build_chat_model, build_tiny_model
from miles.train.torch_backend import TorchBackend
from miles.types import Sample, SampleStatus, TrainBatch


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "model", arch="qwen3_moe")


def _ids(seed=0, shape=(3, 12)):
    return torch.randint(3, 15, shape, generator=torch.Generator().manual_seed(seed))


def test_routing_is_recorded_replayed_and_restored(moe_dir):
    model = load_model(moe_dir)
    layout = moe_layout(model)
    assert (layout.num_layers, layout.top_k, layout.num_experts) == (2, 2, 8)
    ids = _ids()
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with routing(model) as record:
            assert torch.equal(model(input_ids=ids).logits, plain)  # recording changes nothing
        own = record.routed(3)
        assert own.shape == (3, 12, 4) and int(own.min()) >= 0
        forced = own.clone()
        forced[:, :6] = torch.tensor([5, 6, 6, 7])  # the first six positions of every row go elsewhere
        forced[:, 6:] = -1  # the rest route as usual
        with routing(model, replay=forced) as replayed:
            changed = model(input_ids=ids).logits
        got = replayed.routed(3)
        assert torch.equal(got[:, :6], forced[:, :6])
        assert not torch.allclose(changed, plain)
        with routing(model, replay=own):  # replaying its own choices gives the same result
            assert torch.allclose(model(input_ids=ids).logits, plain, atol=1e-6)
        assert torch.equal(model(input_ids=ids).logits, plain)  # the routers are themselves again
    with routing(model, replay=forced, keep_logits=True) as record:  # the router still learns under replay
        loss, _ = record_loss(model, ids, record)
        loss.backward()
    assert all(router.weight.grad is not None and router.weight.grad.abs().sum() > 0
               for router in layout.routers.values())
    with pytest.raises(ValueError, match="routes 2 layers x top-2 = 4"):
        with routing(model, replay=own[..., :3]):
            pass


def record_loss(model, ids, record):
    logits = model(input_ids=ids).logits
    aux, top = record.load_stats(torch.ones(ids.shape, dtype=torch.bool))
    assert 1 / 8 <= float(top) <= 1.0 and float(aux.detach()) >= 0.99  # 1.0 when perfectly balanced
    return logits.logsumexp(-1).mean() + aux, top


def test_the_engine_returns_each_tokens_experts_as_sglang_does(moe_dir, tiny_model_dir):
    engine = LocalEngine(seed=0)
    engine.load_model(str(moe_dir))
    prompt = [5, 6, 7, 8]
    params = {"max_new_tokens": 6, "ignore_eos": True}
    answer = asyncio.run(engine.generate(prompt, params, return_routed_experts=True))
    output = answer["output_ids"]
    fed = len(prompt) + len(output) - 1  # the prompt, then every output but the last
    routed = decode_routed_experts(answer["meta_info"]["routed_experts"], fed)
    assert routed.shape == (fed, 4) and routed.dtype == np.int32
    model = load_model(moe_dir)
    with torch.no_grad(), routing(model) as record:  # a plain forward over the same tokens routes the same way
        model(input_ids=torch.tensor([prompt + output[:-1]]))
    assert np.array_equal(record.routed(1)[0].numpy(), routed)
    again = asyncio.run(engine.generate(prompt, params, return_routed_experts=True))  # the prompt is held in the
    again = decode_routed_experts(again["meta_info"]["routed_experts"], fed)  # prefix cache now, but computed again
    assert np.array_equal(again[: len(prompt)], routed[: len(prompt)])
    assert "routed_experts" not in asyncio.run(engine.generate(prompt, params))["meta_info"]

    dense = LocalEngine(seed=0)
    dense.load_model(str(tiny_model_dir))
    with pytest.raises(ValueError, match="return_routed_experts: expected .*mixture-of-experts"):
        asyncio.run(dense.generate(prompt, params, return_routed_experts=True))


def test_samples_keep_earlier_ids_and_leave_observations_out():
    """Turn 1 feeds 3 + 4 - 1 tokens; after a 2-token observation, turn 2 feeds everything again: the
    positions turn 1 recorded keep its ids, the observation's get none, the rest come from turn 2."""
    sample = Sample(prompt_ids=[1, 2, 3])
    turn1 = np.arange(6 * 4, dtype=np.int32).reshape(6, 4) % 8
    sample.append([4, 5, 6, 7], [0.0] * 4, from_policy=True)
    sample.record_routing({"routed_experts": encode_routed_experts(turn1), "completion_tokens": 4}, 3)
    sample.append([8, 9], None, from_policy=False)
    turn2 = (turn1.max() + 1 - np.arange(11 * 4, dtype=np.int32).reshape(11, 4) % 8) % 8
    sample.append([10, 11, 12], [0.0] * 3, from_policy=True)
    sample.record_routing({"routed_experts": encode_routed_experts(turn2), "completion_tokens": 3}, 9)
    ids = expand(sample.routed_experts)
    assert sample.routed_experts.dtype == np.uint8 and ids.shape == (11, 4)
    assert np.array_equal(ids[:6], turn1)  # turn 1's, not turn 2's recomputation
    assert np.array_equal(ids[6], turn2[6])  # turn 1's last token was first fed in turn 2
    assert (ids[7:9] == -1).all()  # the observation
    assert np.array_equal(ids[9:], turn2[9:])

    other = Sample(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1], rollout_logprobs=[0.0, 0.0], reward=0.0)
    sample.reward = 1.0
    batch = TrainBatch.from_samples([sample, other], pad_token_id=0)
    assert batch.routed_experts.shape == (2, 12, 4) and batch.routed_experts.dtype == torch.int16
    assert torch.equal(batch.routed_experts[0, :11], torch.from_numpy(ids).short())
    assert (batch.routed_experts[0, 11:] == -1).all() and (batch.routed_experts[1] == -1).all()
    assert torch.equal(batch.select([0]).routed_experts, batch.routed_experts[:1])

    with pytest.raises(ValueError, match="do not split over the 5 tokens"):
        decode_routed_experts(encode_routed_experts(turn1), 5)
    with pytest.raises(ValueError, match="base64 of int32"):
        decode_routed_experts("not base64!", 1)
    assert compact(np.array([[300, -1]])).dtype == np.uint16 and expand(compact(np.array([[300, -1]])))[0, 1] == -1


def _rollouts(engine, tokenizer, prompts, n=4, max_new_tokens=6):
    ctx = RolloutContext(engine, tokenizer, {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
                         return_routed_experts=True)

    async def all_of():
        samples = [Sample(prompt_ids=tokenizer.encode(p), group_index=i, index=j) for i, p in enumerate(prompts)
                   for j in range(n)]
        return await asyncio.gather(*(single_turn(s, ctx) for s in samples))

    samples = asyncio.run(all_of())
    for s in samples:
        s.reward = float(s.index % 2)
    return samples


def _trainer_routing(model, batch, replay):
    """The trainer's expert ids over ``batch`` (the policy's forward), with or without the engine's."""
    with torch.no_grad(), routing(model, replay=batch.routed_experts if replay else None) as record:
        model(input_ids=batch.input_ids)
    return record.routed(len(batch))


def _mismatch(mine, engine_ids, attention_mask):
    """The share of (token, layer) pairs the engine recorded whose expert sets differ from ``mine``."""
    mine = mine.reshape(*mine.shape[:2], 2, 2).sort(-1).values
    theirs = engine_ids.long().reshape(mine.shape).sort(-1).values
    known = (theirs >= 0).all(-1) & attention_mask.bool()[..., None]
    return float(((mine != theirs).any(-1) & known).sum() / known.sum())


def test_r3_makes_the_trainers_routing_the_engines_and_shrinks_the_logprob_gap(moe_dir, capsys):
    """The engine serves in bfloat16 (as rollout engines do), the trainer computes in float32: near-ties route
    differently, and those tokens' log-probs drift. With R3 the trainer's expert choices are the engine's
    exactly, and the gap shrinks."""
    tokenizer = load_tokenizer(moe_dir)
    engine = LocalEngine(seed=0, dtype="bfloat16")
    engine.load_model(str(moe_dir))
    samples = _rollouts(engine, tokenizer, [f"{a}+{b}=" for a in range(4) for b in range(4)])
    batch = TrainBatch.from_samples(samples, pad_token_id=tokenizer.pad_token_id)
    batch.advantages = torch.ones_like(batch.loss_mask)
    model = load_model(moe_dir)
    assert _mismatch(_trainer_routing(model, batch, False), batch.routed_experts, batch.attention_mask) > 0
    assert _mismatch(_trainer_routing(model, batch, True), batch.routed_experts, batch.attention_mask) == 0.0

    figures = {}
    for replay in (False, True):
        backend = TorchBackend(routing_replay=replay)
        backend.setup(str(moe_dir), seed=0)
        logprobs = backend.compute_logprobs(batch)
        figures[replay] = float(((logprobs - batch.rollout_logprobs).abs() * batch.loss_mask).sum()
                                / batch.loss_mask.sum())
        metrics = backend.train_step(batch, ppo_clip)
        assert metrics["train/routing_mismatch_frac"] == (0.0 if replay else pytest.approx(
            _mismatch(_trainer_routing(model, batch, False), batch.routed_experts, batch.attention_mask)))
        assert metrics["train/rollout_logprob_abs_diff"] == pytest.approx(figures[replay], rel=1e-4)
        assert 1 / 8 <= metrics["moe/expert_load_max_frac"] <= 1 and metrics["moe/aux_loss"] > 0.9
    with capsys.disabled():
        print(f"\nrollout/train log-prob gap (mean |diff| per token), bf16 engine vs fp32 trainer: "
              f"without R3 {figures[False]:.2e}, with R3 {figures[True]:.2e}")
    assert figures[True] < figures[False]


def test_the_aux_loss_is_added_when_asked_for(moe_dir):
    tokenizer = load_tokenizer(moe_dir)
    samples = [Sample(prompt_ids=tokenizer.encode(f"{i}+1="), response_ids=tokenizer.encode(str(i + 1)),
                      loss_mask=[1], rollout_logprobs=[-1.0], reward=float(i % 2), group_index=i // 2)
               for i in range(6)]
    batch = TrainBatch.from_samples(samples, pad_token_id=tokenizer.pad_token_id)
    batch.advantages = torch.zeros_like(batch.loss_mask)  # the policy loss is 0: only the aux loss remains
    losses = {}
    for coef in (0.0, 0.5):
        backend = TorchBackend(router_aux_loss_coef=coef, max_grad_norm=0.0)
        backend.setup(str(moe_dir), seed=0)
        metrics = backend.train_step(batch, ppo_clip)
        losses[coef] = (metrics["train/loss"], metrics["moe/aux_loss"], metrics["train/grad_norm"])
    assert losses[0.0][0] == pytest.approx(0.0, abs=1e-7) and losses[0.0][2] == 0.0
    assert losses[0.5][0] == pytest.approx(0.5 * losses[0.5][1], rel=1e-5) and losses[0.5][2] > 0


def test_routing_survives_a_partial_rollout(moe_dir):
    """Samples stopped mid-generation keep their ids; continued under new weights, the new positions come from
    the continuation, and replaying the whole gives the trainer the engine's routing at every position."""
    tokenizer = load_tokenizer(moe_dir)
    engine = LocalEngine(background=True, seed=0)
    engine.load_model(str(moe_dir))
    try:
        data = PromptSource([{"prompt": f"{i}+{i}="} for i in range(8)], tokenizer, prompt_key="prompt",
                            label_key="label", chat_template="false", shuffle=False, seed=0)
        collector = GroupCollector([("over_sampling", OverSampling(factor=3.0))], prompts_per_step=2, n_samples=2,
                                   partial_rollout=True)
        ctx = RolloutContext(engine, tokenizer, {"temperature": 1.0, "max_new_tokens": 30},
                             return_routed_experts=True)

        def quick_then_long(sample, ctx):
            quick = sample.metadata["row"] < 2
            params = {**ctx.sampling_params, "max_new_tokens": 1 if quick else 30, "ignore_eos": not quick}
            return single_turn(sample, RolloutContext(ctx.engine, ctx.tokenizer, params, ctx.run,
                                                      return_routed_experts=True))

        def collect():
            return collector.collect(data, quick_then_long, ctx, lambda sample: 1.0, lambda samples: None)

        collect()
        partial = [s for g in collector.unfinished for s in g.samples]
        assert partial and all(s.status is SampleStatus.ABORTED for s in partial)
        before = {id(s): expand(s.routed_experts).copy() for s in partial if s.routed_experts is not None}
        engine.update_weights({k: v.clone() for k, v in engine.model.state_dict().items()}, weight_version=3)
        second = collect()
        continued = [s for g in second.groups for s in g.samples if id(s) in before]
        assert continued
        for s in continued:
            ids = expand(s.routed_experts)
            assert ids.shape[0] == len(s.prompt_ids) + len(s.response_ids) - 1 and (ids >= 0).all()
            assert np.array_equal(ids[: len(before[id(s)])], before[id(s)])
        batch = TrainBatch.from_samples(continued, pad_token_id=tokenizer.pad_token_id)
        model = load_model(moe_dir)
        assert _mismatch(_trainer_routing(model, batch, True), batch.routed_experts, batch.attention_mask) == 0.0
    finally:
        engine.close()


class _Echo:
    """Observes ``ok`` after each turn; done after two turns."""

    def __init__(self, ctx):
        self.turns, self.tools = 0, []

    async def reset(self, sample):
        return None

    async def step(self, action):
        from miles.agentic.types import StepResult

        self.turns += 1
        return StepResult(observation="ok", reward=1.0, done=self.turns >= 2)

    async def close(self):
        pass


def test_multi_turn_samples_carry_routing_for_policy_tokens_only(tmp_path):
    from miles.agentic.tool_calls import HermesParser

    model_dir = build_chat_model(tmp_path / "chat_moe", arch="qwen3_moe")
    engine = LocalEngine(seed=0)
    engine.load_model(str(model_dir))
    vocab = engine.model.config.vocab_size
    ctx = RolloutContext(engine=engine, tokenizer=engine.tokenizer, context_length=512, env=_Echo,
                         tool_parser=HermesParser(), return_routed_experts=True,
                         sampling_params={"max_new_tokens": 2, "stop_token_ids": list(range(vocab))})
    sample = Sample(prompt_ids=[0], prompt="hi")
    asyncio.run(MultiTurn(max_turns=3)(sample, ctx))
    assert sample.status is SampleStatus.COMPLETED and sample.turns == 2
    ids = expand(sample.routed_experts)
    assert ids.shape[0] == len(sample.prompt_ids) + len(sample.response_ids) - 1
    observation = [len(sample.prompt_ids) + i for i, m in enumerate(sample.loss_mask) if not m]
    assert observation and (ids[observation] == -1).all()
    assert (np.delete(ids, observation, axis=0) >= 0).all()  # the prompt and every policy token
    sample.reward = 1.0
    batch = TrainBatch.from_samples([sample], pad_token_id=0)
    assert _mismatch(_trainer_routing(load_model(model_dir), batch, True), batch.routed_experts,
                     batch.attention_mask) == 0.0


@pytest.mark.parametrize("check, overrides, message", [
    ([], ["backend.routing_replay=true"], "set rollout.return_routed_experts: true"),  # the config alone says it
    (["--check"], ["model.build.arch=qwen3", "rollout.return_routed_experts=true"], "has no mixture-of-experts layers"),
])
def test_routing_options_that_cannot_work_are_config_errors(capsys, tmp_path, check, overrides, message):
    code = main(["config", *check, "configs/quickstart.yaml", "model.build.arch=qwen3_moe", f"run.dir={tmp_path}/run",
                 *overrides])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_quickstart_trains_a_moe_model_with_r3(tmp_path):
    import json

    run_dir = tmp_path / "run"
    assert main(["train", "configs/quickstart.yaml", "model.build.arch=qwen3_moe", f"run.dir={run_dir}",
                 "rollout.return_routed_experts=true", "backend.routing_replay=true",
                 "backend.router_aux_loss_coef=0.01", "run.progress=false"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sum(rewards[-20:]) / 20 > sum(rewards[:20]) / 20 + 0.05
    steps = [r for r in rows if "train/loss" in r]
    assert all(r["train/routing_mismatch_frac"] == 0.0 for r in steps)
    assert max(r["train/rollout_logprob_abs_diff"] for r in steps) < 1e-4
    assert all(0.125 <= r["moe/expert_load_max_frac"] <= 1 and r["moe/aux_loss"] > 0.9 for r in steps)
