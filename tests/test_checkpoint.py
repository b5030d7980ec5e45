"""Checkpoints: an interrupted and resumed run repeats the uninterrupted one; bad checkpoints are refused; a write
that never completed (killed, interrupted, a full disk) leaves nothing behind once the run resumes."""

import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoint_gate import MOMENTS
from processes import wait_gone

from miles import hookimpl
from miles.run.checkpoint import latest_checkpoint, remove_partial_checkpoints, save_checkpoint
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


def test_only_the_folders_of_unfinished_checkpoint_writes_are_removed(tmp_path):
    """``.step_<k>.<8 characters>`` folders are ours; anything else of a like name is left as it is."""
    class Good:
        def save_checkpoint(self, path):
            (Path(path) / "trainer.pt").write_bytes(b"ok")

    save_checkpoint(tmp_path, {"step": 3}, {}, Good(), keep=2)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not ours")
    ours = [".step_000009.a1_z9xq0", ".step_000012.qwertyui"]
    for name in ours:
        (tmp_path / name / "backend").mkdir(parents=True)
        (tmp_path / name / "backend" / "trainer.pt").write_bytes(b"half")
    others = [".step_000009.crashed", ".step_x.abcdefgh", "notes.step_000001.abcdefgh", ".step_000010.abcdefghi",
              ".step_000011.ABCDEFGH"]
    for name in others:
        (tmp_path / name).mkdir()
    (tmp_path / ".step_000013.abcdefgh").write_text("a file, not a checkpoint's folder")
    (tmp_path / ".step_000014.abcdefgh").symlink_to(outside)
    assert remove_partial_checkpoints(tmp_path) == ours
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*others, ".step_000013.abcdefgh", ".step_000014.abcdefgh", "step_000003"])
    assert (outside / "keep.txt").read_text() == "not ours"
    assert remove_partial_checkpoints(tmp_path / "absent") == []


# A real `miles train`, held inside a checkpoint write by tests/checkpoint_gate.py.
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SMALL = ["run.progress=false", "sft.steps=0", "run.eval_size=0", "rollout.prompts_per_step=2", "rollout.n_samples=2",
         "run.steps=6", "run.save_every=2", "run.keep_checkpoints=2", "backend.name=checkpoint_gate:GatedBackend"]
TRAINS_IN = re.compile(r"the trainer runs in process (\d+)")


def miles_train(run_dir: Path, *extra: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "miles", "train", CONFIG, f"run.dir={run_dir}", *SMALL, *extra],
                            cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def held(proc: subprocess.Popen, gate: Path, log: Path) -> Path:
    """The checkpoint's hidden folder, once the run is held inside its write."""
    deadline = time.monotonic() + 900  # a deadline for a stuck run, not a measure of anything
    while not (gate / "held").exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    folder = Path((gate / "held").read_text()).parent
    assert folder.parent.name == "checkpoints" and folder.name.startswith(".step_"), folder
    return folder


def steps_logged(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("schedule, trial", [("sync", 0), ("async", 0), ("sync", 1), ("async", 1)])
def test_a_run_killed_while_writing_a_checkpoint_leaves_nothing_after_the_resume(tmp_path, schedule, trial):
    """SIGKILL at a random checkpoint (of steps 2, 4, 6) and a random moment of its write (before or after the
    backend wrote its files; under async the backend writes from its own process). The resume removes the hidden
    folder, says so once, and ends with exactly run.keep_checkpoints checkpoints, each step logged once."""
    call, moment = random.randint(1, 3), random.choice(MOMENTS)
    where = f"killed in checkpoint {call} at its {moment}"
    run_dir, gate, log = tmp_path / "run", tmp_path / "gate", tmp_path / "killed.log"
    gate.mkdir()
    how = [f"run.schedule={schedule}", f"backend.separate_process={str(schedule == 'async').lower()}"]
    proc = miles_train(run_dir, *how, f"backend.gate_dir={gate}", f"backend.hold_call={call}",
                       f"backend.hold_at={moment}", log=log)
    try:
        folder = held(proc, gate, log)
    finally:
        proc.kill()
        proc.wait()
    if schedule == "async":  # the trainer's process, killed with the driver: nothing writes the folder any more
        assert wait_gone(int(TRAINS_IN.search(log.read_text()).group(1))), where
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [folder.name] + [
        f"step_{2 * k:06d}" for k in range(max(1, call - 2), call)], where

    resumed = miles_train(run_dir, *how, "run.resume=true", log=tmp_path / "resumed.log")
    assert resumed.wait(timeout=900) == 0, (where, (tmp_path / "resumed.log").read_text())
    out = (tmp_path / "resumed.log").read_text()
    assert out.count(folder.name) == 1 and (f"run.resume: removed 1 half-written checkpoint folder(s) that a run "
                                            f"killed while writing left in {checkpoints}: {folder.name}") in out, where
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000004", "step_000006"], where
    assert steps_logged(run_dir) == list(range(6)), where


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["async", "one_step_off"])
def test_a_streaming_run_interrupted_in_a_checkpoint_keeps_keep_checkpoints_after_the_resume(tmp_path, schedule):
    """Ctrl-C while the trainer's process writes the step-4 checkpoint: the driver gives the write up and removes
    its folder, while the trainer (which ignores Ctrl-C) goes on and writes into it again. Both the interrupted
    run's end and the resume leave no such folder: after the resume, exactly run.keep_checkpoints checkpoints."""
    run_dir, gate, log = tmp_path / "run", tmp_path / "gate", tmp_path / "interrupted.log"
    gate.mkdir()
    proc = miles_train(run_dir, f"run.schedule={schedule}", "backend.separate_process=true",
                       f"backend.gate_dir={gate}", "backend.hold_call=2", "backend.hold_at=start",
                       "backend.until=given_up", log=log)
    try:
        held(proc, gate, log)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=900) == 128 + signal.SIGINT, log.read_text()
    finally:
        proc.kill()
        proc.wait()
    assert (gate / "wrote").exists()  # the trainer wrote the checkpoint's files after the driver removed the folder
    assert wait_gone(int(TRAINS_IN.search(log.read_text()).group(1)))
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002"], log.read_text()
    assert "Traceback" not in log.read_text()

    resumed = miles_train(run_dir, f"run.schedule={schedule}", "backend.separate_process=true", "run.resume=true",
                          log=tmp_path / "resumed.log")
    assert resumed.wait(timeout=900) == 0, (tmp_path / "resumed.log").read_text()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000004", "step_000006"]
    assert steps_logged(run_dir) == list(range(6))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_full_disk_during_a_checkpoint_names_the_file_and_keeps_the_last_checkpoint(tmp_path, schedule):
    """run.dir on a real 4.6 MB tmpfs (bubblewrap mounts it), a 2 MB file taking room: the step-2 checkpoint fits,
    the step-4 one does not (ENOSPC). One line (exit 1, no traceback, also none from the trainer's process under
    async) names the file being written and the bytes; step_000002 stays the newest, and nothing else is left."""
    disk = tmp_path / "disk"
    disk.mkdir()
    train = shlex.join([sys.executable, "-m", "miles", "train", CONFIG, f"run.dir={disk}/run", *SMALL[:5],
                        "run.steps=4", "run.save_every=2", f"run.schedule={schedule}"])
    checkpoints = disk / "run" / "checkpoints"
    script = (f"head -c 2000000 /dev/zero > {disk}/filler && {train}; echo rc=$?; ls -a {checkpoints}; "
              f"echo ---; cat {checkpoints}/step_000002/state.json")  # the tmpfs goes with bubblewrap
    done = subprocess.run(["bwrap", "--dev-bind", "/", "/", "--size", str(4_600_000), "--tmpfs", str(disk),
                           "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    if done.returncode != 0 and done.stderr.startswith("bwrap:"):
        pytest.skip(f"bubblewrap cannot mount a tmpfs here: {done.stderr.strip()}")
    assert "rc=1" in done.stdout.split(), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    ckpts = re.escape(str(checkpoints))
    found = re.search(rf"miles: error: checkpoint step_000004 could not be written under '{ckpts}': no space "
                      rf"left on the device while writing {ckpts}/step_000004/(\S+) \((\d+) bytes free there; "
                      rf"a checkpoint needs about (\d+) bytes: step_000002 takes that\); the checkpoints before it "
                      rf"are intact: free space there, then continue with run.resume=true",
                      done.stderr)
    assert found, done.stderr
    failed, free, needed = found.group(1), int(found.group(2)), int(found.group(3))
    listing, state = done.stdout.split("---\n")
    assert listing.split()[-3:] == [".", "..", "step_000002"]  # the last checkpoint stays the newest, nothing else
    # the file (or the folder of one) that step 2's checkpoint holds too, and the free space would not hold step 4
    assert any(name == failed or failed.endswith("/") and name.startswith(failed)
               for name in json.loads(state)["files"]), failed
    assert json.loads(state)["step"] == 2 and 0 <= free < needed
