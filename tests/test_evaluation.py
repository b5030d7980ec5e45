"""The eval section: held-out datasets with n samples per prompt, mean@n and the unbiased pass@k, during
training and standalone (`miles eval`), single- and multi-turn."""

import itertools
import json
from collections import defaultdict
from statistics import fmean

import pytest

from miles import StepResult
from miles.cli import main
from miles.loop.evaluation import pass_at_k
from miles.models.hf import build_model_dir
from miles.run.runner import evaluate_model, prepare, train

QUICK = ["run.progress=false", "sft.steps=20", "run.eval_size=20"]


@pytest.mark.parametrize("n, c, k", [(n, c, k) for n in range(1, 7) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n, c, k):
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


SCORED: list[tuple[int, float]] = []


def odd_length_reward(sample):
    """1.0 for responses of odd length (some prompts get several, some none); records what it gave."""
    reward = float(len(sample.response_ids) % 2)
    SCORED.append((sample.group_index, reward))
    return reward


def test_metrics_during_training_are_those_of_the_scored_samples(tmp_path):
    """Every eval.every steps and at both ends, each dataset's mean@n and pass@k equal what the samples the
    reward scored give (grouped by prompt, pass@k by enumerating k-subsets)."""
    SCORED.clear()
    datasets = ("eval.datasets=[{name: sampled, n: 4, k: [1, 2, 4], max_prompts: 12},"
                " {name: greedy, max_prompts: 8, sampling: {temperature: 0}}]")
    summary = train(prepare("configs/quickstart.yaml", [
        *QUICK, f"run.dir={tmp_path}", "run.steps=3", "run.eval_size=0", "eval.every=2", datasets,
        "reward.name=test_evaluation:odd_length_reward"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/sampled/mean@4" in r]
    assert [r["step"] for r in evals] == [0, 1, 3]  # before the first step, after the second, after the last
    assert summary["eval_end"]["eval/sampled/pass@4"] == evals[-1]["eval/sampled/pass@4"]
    # The rewards of the last evaluation: the last 12 x 4 + 8 scored (sampled set first, then greedy).
    last = SCORED[-(12 * 4 + 8):]
    sampled, greedy = last[:48], last[48:]
    by_prompt = defaultdict(list)
    for group, reward in sampled:
        by_prompt[group].append(reward >= 1.0)
    assert len(by_prompt) == 12 and all(len(v) == 4 for v in by_prompt.values())
    end = summary["eval_end"]
    assert end["eval/sampled/mean@4"] == pytest.approx(fmean(r for _, r in sampled))
    for k in (1, 2, 4):
        expected = fmean(fmean(any(s) for s in itertools.combinations(v, k)) for v in by_prompt.values())
        assert end[f"eval/sampled/pass@{k}"] == pytest.approx(expected)
    assert end["eval/greedy/pass@1"] == pytest.approx(fmean(r for _, r in greedy))
    assert end["eval/sampled/prompts"] == 12 and end["eval/greedy/prompts"] == 8
    assert end["eval/sampled/response_length_mean"] > 0


def test_miles_eval_on_the_final_model_gives_the_runs_greedy_accuracy(tmp_path, capsys):
    """`miles eval CONFIG --model DIR` without an eval section: the held-out greedy accuracy that `miles train`
    reported for its final model."""
    summary = train(prepare("configs/quickstart.yaml", [*QUICK, f"run.dir={tmp_path / 'run'}", "run.steps=2"]))
    capsys.readouterr()
    code = main(["eval", "configs/quickstart.yaml", "--model", summary["final_model"], "run.eval_size=20", "--json"])
    assert code == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["eval/heldout/pass@1"] == summary["eval_end"]["eval/accuracy"]
    assert metrics["eval/heldout/mean@1"] == summary["eval_end"]["eval/reward_mean"]
    assert metrics["eval/heldout/prompts"] == 20


class TwoTurnEnv:
    """Answers the first turn with an observation and ends the trajectory after the second; counts its uses."""

    opened: list[str] = []

    def __init__(self, ctx):
        self.steps = 0

    async def reset(self, sample):
        TwoTurnEnv.opened.append(sample.prompt)

    async def step(self, action):
        self.steps += 1
        return StepResult(observation=None if self.steps > 1 else "1+1=", done=self.steps > 1)

    async def close(self):
        pass


TURNS: list[int] = []


def turns_reward(sample):
    TURNS.append(sample.turns)
    return 0.0


def test_multi_turn_rollouts_are_evaluated_through_their_env(tmp_path):
    """`miles eval` on configs/retool.yaml (multi_turn) with an env of the test's: every sample is a trajectory
    of that env, and the turns metric is that of the trajectories."""
    TwoTurnEnv.opened.clear(), TURNS.clear()
    config = prepare("configs/retool.yaml").config
    model = build_model_dir(config.model.build, config.model.tokenizer, tmp_path / "model", seed=0)
    metrics = evaluate_model(prepare("configs/retool.yaml", [
        "rollout.env.name=test_evaluation:TwoTurnEnv", "rollout.sandbox=null",
        "reward.name=test_evaluation:turns_reward",
        "eval.datasets=[{name: tools, n: 2, k: [1, 2], max_prompts: 4, sampling: {max_new_tokens: 12}}]"]), str(model))
    assert metrics["eval/tools/prompts"] == 4 and len(TwoTurnEnv.opened) == 8 and len(set(TwoTurnEnv.opened)) == 4
    assert metrics["eval/tools/turns/mean"] == fmean(TURNS) and max(TURNS) >= 1


@pytest.mark.parametrize("override, message", [
    ("eval.datasets=[{name: a, n: 2, k: [1, 3]}]",
     "eval.datasets[0].k: expected a list of whole numbers from 1 to n=2"),
    ("eval.datasets=[{name: a}, {name: a}]", "eval.datasets[1].name: 'a' names two datasets"),
    ("eval.datasets=[{name: a, nn: 2}]", "unknown config key 'eval.datasets[0].nn'"),
    ("eval.datasets=[{name: a, path: /nonexistent.jsonl}]",
     "eval.datasets[0] (a).path: data file '/nonexistent.jsonl' does not exist"),
])
def test_bad_eval_sections_exit_2_naming_the_key(tmp_path, capsys, override, message):
    code = main(["train", "configs/quickstart.yaml", f"run.dir={tmp_path / 'run'}", "run.progress=false", override])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
