"""Data selection: dynamic sampling fills the batch, over-sampling, buffers, the overlong penalty."""

import json
import math

import pytest

from miles.builtin.selectors import Buffer, DynamicSampling, OverlongPenalty, OverSampling, drop_equal_rewards
from miles.rollout.collect import GroupCollector
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import PromptSource
from miles.run.runner import prepare, train
from miles.testing import make_sample
from miles.types import Group, SampleStatus


class CharTokenizer:
    chat_template = None

    def __call__(self, text, **kwargs):
        return {"input_ids": [ord(c) % 50 for c in text]}


async def answer_by_row(sample, ctx):
    """No engine: a response of ``row % 3 + 1`` tokens, so lengths vary by prompt."""
    n = sample.metadata["row"] % 3 + 1
    sample.append([7] * n, [-0.5] * n, from_policy=True)
    sample.status = SampleStatus.COMPLETED
    return sample


def reward_by_row(sample):
    """Rows 0, 2, 4 ... get all-equal rewards (no signal); odd rows alternate 0/1 within the group."""
    row = sample.metadata["row"]
    return 1.0 if row % 2 == 0 else float(sample.index % 2)


def collector(*selectors, prompts=4, n=4):
    rows = [{"prompt": f"p{i}"} for i in range(40)]
    data = PromptSource(rows, CharTokenizer(), prompt_key="prompt", label_key="label", chat_template="false",
                        shuffle=False, seed=0)
    named = [(getattr(s, "__name__", type(s).__name__), s) for s in selectors]
    return GroupCollector(named, prompts, n), data


def collect(c, data):
    return c.collect(data, answer_by_row, RolloutContext(engine=None, tokenizer=None), reward_by_row, lambda s: None)


def test_a_plain_filter_takes_one_round_and_may_leave_the_batch_short():
    c, data = collector(drop_equal_rewards)
    out = collect(c, data)
    assert len(out.groups) == 2 and len(out.samples) == 16  # rows 1 and 3 of rows 0-3
    assert out.metrics["selection/groups_removed"] == 2 and out.metrics["selection/rounds"] == 1


def test_dynamic_sampling_keeps_generating_until_the_batch_is_full():
    c, data = collector(DynamicSampling(max_extra_rounds=4))
    out = collect(c, data)
    assert len(out.groups) == 4  # the batch size is kept
    assert all(max(g.rewards) > min(g.rewards) for g in out.groups)
    assert [g.samples[0].metadata["row"] for g in out.groups] == [1, 3, 5, 7]
    # Round 1: rows 0-3 (2 kept); round 2: rows 4-5 (1 kept); round 3: row 6 (0); round 4: row 7.
    assert out.metrics["selection/rounds"] == 4 and len(out.samples) == 8 * 4
    assert len({s.group_index for s in out.samples}) == 8  # every generated group has its own index
    capped, data = collector(DynamicSampling(max_extra_rounds=1))
    assert len(collect(capped, data).groups) == 3  # the cap on extra rounds


def test_over_sampling_generates_spares_and_a_buffer_keeps_them_for_the_next_step():
    c, data = collector(OverSampling(factor=2.0), drop_equal_rewards, Buffer(policy="fifo", max_groups=8))
    first = collect(c, data)
    assert len(first.samples) == 8 * 4  # 8 prompts for a batch of 4
    assert [g.samples[0].metadata["row"] for g in first.groups] == [1, 3, 5, 7]
    assert first.metrics["selection/buffered"] == 0
    c2, data2 = collector(OverSampling(factor=3.0), drop_equal_rewards, Buffer(policy="fifo", max_groups=8))
    out = collect(c2, data2)  # 12 prompts: rows 1, 3 ... 11 kept, 4 used, 2 buffered
    assert [g.samples[0].metadata["row"] for g in out.groups] == [1, 3, 5, 7]
    assert out.metrics["selection/buffered"] == 2
    nxt = collect(c2, data2)
    assert [g.samples[0].metadata["row"] for g in nxt.groups][:2] == [9, 11]  # oldest first
    assert nxt.metrics["selection/groups_from_buffer"] == 2


def test_recent_buffer_serves_the_newest_and_drops_the_oldest():
    c, data = collector(OverSampling(factor=3.0), drop_equal_rewards, Buffer(policy="recent", max_groups=1))
    out = collect(c, data)
    assert out.metrics["selection/buffered"] == 1 and out.metrics["selection/surplus_dropped"] == 1
    assert [g.samples[0].metadata["row"] for g in collect(c, data).groups][0] == 11  # row 9 was dropped


def test_without_a_buffer_surplus_groups_are_dropped_and_counted():
    c, data = collector(OverSampling(factor=3.0), drop_equal_rewards)
    out = collect(c, data)
    assert len(out.groups) == 4 and out.metrics["selection/surplus_dropped"] == 2


def test_overlong_penalty_hand_computed():
    samples = [make_sample(response_ids=[1] * n, reward=1.0) for n in (3, 5, 6, 9)]
    penalty = OverlongPenalty(max_len=8, buffer_len=4)  # penalised from 4 tokens up, fully at 8
    penalty([Group(0, samples)])
    assert [s.reward for s in samples] == pytest.approx([1.0, 0.75, 0.5, 0.0])
    assert penalty.metrics() == {"selection/overlong_penalised_frac": 0.75}
    with pytest.raises(ValueError, match="buffer_len <= max_len"):
        OverlongPenalty(max_len=2, buffer_len=4)


@pytest.mark.slow
def test_dynamic_sampling_in_a_run_keeps_the_batch_full(tmp_path):
    train(prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path}", "run.steps=20", "run.progress=false", "run.eval_size=0", "rollout.prompts_per_step=8",
        "selection=[{name: dynamic_sampling, max_extra_rounds: 8}]"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["selection/groups_kept"] == 8 and r["train/samples"] == 64 for r in rows)
    assert all(r["train/nonzero_adv_frac"] == 1.0 for r in rows)  # no group without signal is trained on
    assert (any(r["selection/rounds"] > 1 for r in rows)
            and sum(r["selection/dynamic_sampling_removed"] for r in rows) > 0)
    assert all(r["samples/total"] == 8 * (8 + r["selection/groups_removed"]) for r in rows if r["selection/rounds"] > 0)


def test_curriculum_draws_prompts_by_recent_pass_rate():
    from miles.builtin.selectors import Curriculum

    curriculum = Curriculum(target=0.5, width=0.25, min_weight=0.05, window=4)
    c, data = collector(curriculum, prompts=8)
    # Rows 0, 2, 4 ... are always solved (pass rate 1), odd rows half the time (0.5, the target).
    for _ in range(6):
        collect(c, data)
    assert curriculum.pass_rate(0) == 1.0 and curriculum.pass_rate(1) == 0.5
    assert curriculum.weight(1) == 1.0
    assert curriculum.weight(0) == pytest.approx(max(0.05, math.exp(-0.25 / (2 * 0.0625))))
    drawn = [p.index for p in curriculum.choose_prompts(data, 2000)]
    odd = sum(i % 2 for i in drawn) / len(drawn)
    unseen = [i for i in drawn if i not in curriculum.history]
    assert odd > 0.7  # half-solved prompts are drawn far more than always-solved ones
    assert unseen  # prompts not yet seen count as at the target: they are drawn too
    state = curriculum.state_dict()
    again = Curriculum(window=4)
    again.load_state_dict(state)
    assert [p.index for p in again.choose_prompts(data, 20)] == [p.index for p in curriculum.choose_prompts(data, 20)]
