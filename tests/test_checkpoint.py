"""Checkpoints: an interrupted and resumed run repeats the uninterrupted one; bad checkpoints are refused."""

import json
from pathlib import Path

import pytest
import torch

from miles import hookimpl
from miles.run.checkpoint import latest_checkpoint, save_checkpoint
from miles.errors import ConfigError
from miles.run.runner import prepare, train

CONFIG = "configs/quickstart.yaml"
ARGS = ["sft.steps=10", "run.steps=8", "run.save_every=3", "run.eval_size=8", "run.progress=false",
        "rollout.prompts_per_step=4", "backend.lr_schedule=cosine", "backend.warmup_steps=2",
        "regularization.kl_coef=0.01"]


class InterruptAt:
    """A plugin that stops the run (as Ctrl-C would) when a step ends."""

    def __init__(self, step: int) -> None:
        self.step = step

    @hookimpl
    def miles_train_step_end(self, step, metrics):
        if step == self.step:
            raise KeyboardInterrupt


def run(run_dir: Path, *extra: str, plugins=()) -> dict:
    return train(prepare(CONFIG, [*ARGS, f"run.dir={run_dir}", *extra], extra_plugins=plugins))


# What the engines' log-probs enter: a prompt whose prefix the cache held is computed from that K/V, in another shape
# than from scratch, and the float rounding of the two may differ in the last bits (on an AMD EPYC: 9.8e-8 against
# 1.1e-7 for the step after the resume; on an Intel Xeon they were equal). Compared within ENGINE_ROUNDING.
ENGINE_NUMERICS = ("train/rollout_logprob_abs_diff", "train/approx_kl")
ENGINE_ROUNDING = 1e-6


def rows(run_dir: Path) -> list[dict]:
    """Per-step metrics without wall-clock figures, nor the engines' prefix-cache hits: a resumed run's engines start
    empty, while the uninterrupted run's hold what its evaluation before the step prefilled."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.append({k: v for k, v in row.items() if not k.startswith("time/") and not k.endswith("_per_s")
                    and k != "rollout/prefix_hit_frac"})
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole")
    summary = run(run_dir)
    return run_dir, summary


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("interrupted")
    with pytest.raises(KeyboardInterrupt):
        run(run_dir, plugins=[("interrupt", InterruptAt(4))])
    logged = [row["step"] for row in rows(run_dir)]
    summary = run(run_dir, "run.resume=true", plugins=[("interrupt", InterruptAt(-1))])  # the same plugin stack
    return run_dir, summary, logged


@pytest.mark.slow
def test_an_interrupted_run_resumes_with_identical_metrics(uninterrupted, resumed):
    whole_dir, whole_summary = uninterrupted
    run_dir, summary, logged_before_resume = resumed
    assert logged_before_resume == [0, 1, 2, 3]  # step 4 was interrupted before it was logged
    assert [r["step"] for r in rows(run_dir)] == [*range(8), 8]  # each step once, then the final evaluation
    resumed_rows, whole_rows = rows(run_dir), rows(whole_dir)
    for got, want in zip(resumed_rows, whole_rows):
        for key in ENGINE_NUMERICS:
            if key in want:
                assert got.pop(key) == pytest.approx(want.pop(key), abs=ENGINE_ROUNDING), (want["step"], key)
    assert resumed_rows == whole_rows  # the rest bitwise: the same samples, the same updates, the same weights
    assert summary["reward_start"] == whole_summary["reward_start"]
    assert summary["eval_end"] == whole_summary["eval_end"] and summary["eval_start"] == whole_summary["eval_start"]
    for name in ("model.safetensors",):
        whole = (whole_dir / "final_model" / name).read_bytes()
        assert (run_dir / "final_model" / name).read_bytes() == whole


@pytest.mark.slow
def test_checkpoints_hold_the_state_and_the_newest_are_kept(uninterrupted):
    run_dir, _ = uninterrupted
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_000003", "step_000006"]  # keep_checkpoints=2 of steps 3 and 6
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt.step == 6 and ckpt.state["weight_version"] == 6 and len(ckpt.state["rewards"]) == 6
    assert ckpt.state["backend"] == "torch" and ckpt.state["plugins"][0]["version"]
    assert ckpt.loop_state()["data_position"] == 6 * 4
    trainer = torch.load(ckpt.path / "backend" / "trainer.pt", weights_only=False)
    assert trainer["scheduler"]["last_epoch"] == 6 and trainer["optimizer"]["state"]


@pytest.mark.slow
def test_a_checkpoint_of_another_model_or_plugin_stack_is_refused(uninterrupted):
    run_dir, _ = uninterrupted
    with pytest.raises(ConfigError, match=r"model hidden_size: 64 in the checkpoint, 32 now"):
        run(run_dir, "run.resume=true", "model.build.hidden_size=32", "model.build.head_dim=8")

    class Extra:
        @hookimpl
        def miles_register_rewards(self, register):
            register("always_one", lambda sample: 1.0)

    with pytest.raises(ConfigError, match=r"plugin extra: absent in the checkpoint"):
        run(run_dir, "run.resume=true", plugins=[("extra", Extra())])


class Failing:
    def save_checkpoint(self, path):
        (Path(path) / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")


def test_a_half_written_checkpoint_is_never_picked_up(tmp_path):
    class Good:
        def save_checkpoint(self, path):
            (Path(path) / "trainer.pt").write_bytes(b"ok")

    save_checkpoint(tmp_path, {"step": 3}, {}, Good(), keep=2)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, {"step": 6}, {}, Failing(), keep=2)
    (tmp_path / ".step_000009.crashed").mkdir()  # what a killed process leaves: a hidden temporary
    assert latest_checkpoint(tmp_path).step == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step_000009.crashed", "step_000003"]
