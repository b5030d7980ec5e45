"""Debug modes: saved rollouts and ``miles replay``, ``run.rollout_only``, ``cluster.local_mode``."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import miles
from miles.train.losses import ppo_clip
from miles.rewards import exact_match
from miles.cli import main
from miles.run.replay import replay
from miles.rollout.single_turn import single_turn
from miles.loop.saved_rollouts import read_step
from miles.run.runner import prepare, train

QUICK = ["run.progress=false", "run.eval_size=0", "sft.steps=2", "rollout.prompts_per_step=8", "rollout.n_samples=4"]
STEPS = 3


def train_metrics(path):
    """Every step's train/* metrics but the throughput (wall-clock)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in row.items() if k.startswith("train/") and k != "train/tokens_per_s"}
            for row in rows if "time/step_s" in row]


def tree_digest(root, skip=()):
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file() and f.relative_to(root).parts[0] not in skip}


class TrainedSamples:
    """Records, token for token, what each step trained on (the trainable samples of the kept groups)."""

    def __init__(self):
        self.steps = []

    @miles.hookimpl
    def miles_rollout_end(self, step, groups):
        self.steps.append([(s.group_index, list(s.prompt_ids), list(s.response_ids), list(s.loss_mask),
                            list(s.rollout_logprobs), s.reward, s.label, s.status.value)
                           for g in groups for s in g.trainable_samples])


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A short sync quickstart run (in-process engine: deterministic) that saved its rollouts."""
    run_dir = tmp_path_factory.mktemp("debug") / "run"
    recorder = TrainedSamples()
    train(prepare("configs/quickstart.yaml", [f"run.dir={run_dir}", f"run.steps={STEPS}", *QUICK,
                                              "run.save_rollouts=true", "regularization.kl_coef=0.01"],
                  extra_plugins=[("trained_samples", recorder)]))
    return run_dir, recorder.steps


def test_saved_rollouts_are_the_trained_samples_token_for_token(saved_run):
    run_dir, trained = saved_run
    files = sorted((run_dir / "rollouts").glob("step_*.npz"))
    assert [f.name for f in files] == [f"step_{s:06d}.npz" for s in range(STEPS)]
    assert json.loads((run_dir / "rollouts" / "meta.json").read_text())["start_model"] == "sft_model"
    for step, path in enumerate(files):
        samples, rng = read_step(path)
        assert len(samples) == len(trained[step]) == 32
        assert [(s.group_index, s.prompt_ids, s.response_ids, s.loss_mask, s.rollout_logprobs, s.reward, s.label,
                 s.status.value) for s in samples] == trained[step]
        assert {"rng_torch", "rng_python"} <= set(rng)
        with np.load(path) as data:  # compact: int32 tokens, float32 log-probs
            assert data["response_ids"].dtype == np.int32 and data["rollout_logprobs"].dtype == np.float32


def test_step_files_keep_every_field_exactly(tmp_path):
    from miles.models.moe import compact
    from miles.loop.saved_rollouts import groups_of, write_step
    from miles.types import Sample, SampleStatus

    moe = compact(np.array([[0, 3], [1, -1], [300, 2]]))  # uint16, -1 kept
    samples = [
        Sample(prompt_ids=[5, 6], group_index=7, index=0, prompt=[{"role": "user", "content": "hi"}], label={"a": 1},
               response_ids=[1, 2, 3], loss_mask=[1, 0, 1], rollout_logprobs=[-0.1, 0.0, -1 / 3],  # not float32
               response_text="abc", reward={"score": 0.5, "format": 1.0}, status=SampleStatus.TRUNCATED,
               reason="max_new_tokens reached", weight_versions=[2, 3], off_policy_tokens=1, turns=2,
               metadata={"row": 4, "array": np.arange(2)}, routed_experts=moe),
        Sample(prompt_ids=[9], group_index=8, index=1, response_ids=[4], loss_mask=[1], rollout_logprobs=[-0.5],
               reward=1.0, status=SampleStatus.COMPLETED),
    ]
    write_step(tmp_path, 12, samples)
    back, _ = read_step(tmp_path / "step_000012.npz")
    samples[0].metadata["array"] = [0, 1]  # JSON keeps what it can
    for original, loaded in zip(samples, back):
        assert {k: v for k, v in vars(loaded).items() if k != "routed_experts"} == \
               {k: v for k, v in vars(original).items() if k != "routed_experts"}
    assert back[0].routed_experts.dtype == np.uint16 and np.array_equal(back[0].routed_experts, moe)
    assert back[1].routed_experts is None
    assert [(g.index, len(g.samples)) for g in groups_of(back)] == [(7, 1), (8, 1)]
    write_step(tmp_path, 13, [])  # a step that kept nothing to train
    assert read_step(tmp_path / "step_000013.npz")[0] == []


def test_replay_reproduces_every_training_metric_exactly(saved_run, tmp_path, capsys):
    run_dir, _ = saved_run
    before = tree_digest(run_dir)
    assert main(["replay", str(run_dir), "--out", str(tmp_path / "replay")]) == 0, capsys.readouterr().err
    original, replayed = train_metrics(run_dir / "metrics.jsonl"), train_metrics(tmp_path / "replay" / "metrics.jsonl")
    assert len(original) == len(replayed) == STEPS
    assert {"train/loss", "train/grad_norm", "train/kl", "train/nonzero_adv_frac", "train/entropy",
            "train/rollout_logprob_abs_diff", "train/samples"} <= set(original[0])
    assert replayed == original  # every train/* metric of every step, exactly
    assert tree_digest(run_dir) == before  # the run's own files are untouched
    assert json.loads((tmp_path / "replay" / "replay.json").read_text())["steps"] == STEPS

    # Overrides change what is trained: the replay trains, it does not copy.
    replay(run_dir, ["regularization.entropy_coef=0.5", "run.progress=false"], out=tmp_path / "changed", steps=1)
    [changed] = train_metrics(tmp_path / "changed" / "metrics.jsonl")
    assert changed["train/entropy"] == original[0]["train/entropy"]  # the same start model and samples
    assert changed["train/loss"] != original[0]["train/loss"]  # with an entropy bonus in the loss


def test_replay_errors_name_the_file_or_the_missing_setting(saved_run, tmp_path, capsys):
    run_dir, _ = saved_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("replay"))
    damaged = copy / "rollouts" / "step_000001.npz"
    damaged.write_bytes(damaged.read_bytes()[:300])
    assert main(["replay", str(copy), "run.progress=false"]) == 2
    err = capsys.readouterr().err
    assert f"saved rollouts {damaged}: cannot be read" in err and "Traceback" not in err

    damaged.unlink()
    assert main(["replay", str(copy), "--overwrite"]) == 2
    assert f"saved rollouts {damaged}: no such file" in capsys.readouterr().err

    shutil.rmtree(copy / "rollouts")
    assert main(["replay", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "has no saved rollouts" in err and "run.save_rollouts=true" in err

    assert main(["replay", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_replay_help_says_what_it_needs(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["replay", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "RUN_DIR" in text and "run.save_rollouts" in text and "--out" in text


def test_rollout_only_generates_and_scores_without_training(tmp_path):
    run_dir = tmp_path / "run"
    summary = train(prepare("configs/quickstart.yaml", [f"run.dir={run_dir}", "run.steps=2", *QUICK,
                                                        "run.rollout_only=true", "run.save_rollouts=true"]))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["weight_version"] for row in rows] == [0, 0]  # nothing pushed
    assert all("train/loss" not in row and row["train/samples"] == 32 and row["samples/total"] == 32 for row in rows)
    assert all(0 <= row["reward/mean"] <= 1 for row in rows)
    assert not (run_dir / "final_model").exists() and summary["final_model"] == str(run_dir / "sft_model")
    assert len(list((run_dir / "rollouts").glob("step_*.npz"))) == 2
    # ... and they train later, without an engine
    replay(run_dir, ["run.progress=false"])
    assert [row["train/samples"] for row in train_metrics(run_dir / "replay" / "metrics.jsonl")] == [32, 32]


@pytest.mark.parametrize("overrides, expected", [
    (["run.rollout_only=true", "run.save_every=1"], "run.save_every: run.rollout_only trains nothing"),
    (["cluster.local_mode=true", "run.schedule=async"], "run.schedule: cluster.local_mode runs rollouts on the main"),
    (["cluster.local_mode=true", "cluster.address=auto"], "cluster.address: cluster.local_mode runs every plane"),
    (["cluster.local_mode=true", "rollout.engine.num_engines=1", "rollout.engine.release_memory_during_train=true"],
     "rollout.engine.release_memory_during_train: cluster.local_mode"),
])
def test_debug_modes_refuse_what_they_cannot_do(capsys, tmp_path, overrides, expected):
    assert main(["config", "configs/quickstart.yaml", f"run.dir={tmp_path}", *overrides]) == 2
    assert expected in capsys.readouterr().err


class WhereThingsRun:
    """A rollout function, reward and loss that record the process and thread they run in."""

    def __init__(self):
        self.seen = {"rollout": set(), "reward": set(), "loss": set()}

    def here(self, stage):
        self.seen[stage].add((os.getpid(), threading.get_ident()))

    @miles.hookimpl
    def miles_register_rollout_fns(self, register):
        async def probe_rollout(sample, ctx):
            self.here("rollout")
            return await single_turn(sample, ctx)

        register("probe_rollout", probe_rollout)

    @miles.hookimpl
    def miles_register_rewards(self, register):
        def probe_reward(sample):
            self.here("reward")
            return exact_match(sample)

        register("probe_reward", probe_reward)

    @miles.hookimpl
    def miles_register_losses(self, register):
        def probe_loss(inputs):
            self.here("loss")
            return ppo_clip(inputs)

        register("probe_loss", probe_loss)


@pytest.mark.parametrize("local_mode", [True, False])
def test_local_mode_runs_rollouts_rewards_and_losses_on_the_main_thread(tmp_path, capsys, local_mode):
    probe = WhereThingsRun()
    # Without local_mode the comparison run keeps its in-process engine (no Ray in this test): the reward's time
    # limit still puts it on a watchdog thread, which local_mode removes.
    engines = "rollout.engine.num_engines=1" if local_mode else "rollout.engine.num_engines=0"
    train(prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path}", "run.steps=1", *QUICK, f"cluster.local_mode={str(local_mode).lower()}", engines,
        "rollout.fn.name=probe_rollout", "reward.name=probe_reward", "loss.name=probe_loss"],
        extra_plugins=[("where_things_run", probe)]))
    main_thread = {(os.getpid(), threading.main_thread().ident)}
    err = capsys.readouterr().err
    if local_mode:
        assert probe.seen == {"rollout": main_thread, "reward": main_thread, "loss": main_thread}
        assert "one in-process engine instead of rollout.engine.num_engines=1" in err
    else:
        assert probe.seen["reward"] and probe.seen["reward"] != main_thread


def test_breakpoint_in_a_reward_stops_in_pdb_with_local_mode(tmp_path):
    (tmp_path / "bp_reward.py").write_text(textwrap.dedent("""
        from miles.rewards import exact_match

        stopped = False

        def reward(sample):
            global stopped
            if not stopped:
                stopped = True
                breakpoint()
            return exact_match(sample)
    """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONBREAKPOINT"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    result = subprocess.run(  # pdb reads its commands from stdin
        [sys.executable, "-m", "miles", "train", "configs/quickstart.yaml", f"run.dir={tmp_path / 'run'}",
         "run.steps=1", *QUICK, "cluster.local_mode=true", "rollout.engine.num_engines=1",
         "reward.name=bp_reward:reward"],
        input="p 1+1\nc\n", capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"},
        cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(Pdb) 2\n" in result.stdout, result.stdout[-2000:]
    assert "Miles run finished" in result.stdout
