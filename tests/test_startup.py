"""Start-up: every check runs before anything under run.dir changes, and `miles config` makes the same checks."""

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from miles.testing import MILES_WITH_CTRL_C

from miles.run.checkpoint import newest_intact_checkpoint
from miles.cli import main
from miles.run.progress import PlainProgress

CONFIG = "configs/quickstart.yaml"
SMALL = ["run.progress=false", "sft.steps=2", "run.steps=4", "run.save_every=2", "run.eval_size=4",
         "rollout.prompts_per_step=4", "rollout.n_samples=2"]


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``root`` with its content hash and modification time."""
    return {str(f.relative_to(root)): (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns)
            for f in sorted(root.rglob("*")) if f.is_file()}


def cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("base") / "run"
    assert main(["train", CONFIG, *SMALL, f"run.dir={run_dir}"]) == 0
    return run_dir


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def victim(base_run, tmp_path):
    """A copy of a finished run, and a check that a failed start left it exactly as it was."""
    import shutil

    run_dir = tmp_path / "victim"
    shutil.copytree(base_run, run_dir)
    before = snapshot(run_dir)
    yield run_dir
    assert snapshot(run_dir) == before


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], "already holds a run. Continue it with run.resume=true, or start a new one in another directory"),
    (["run.resume=true", "data.generator=null", "data.train_path=nope.jsonl"], "data file 'nope.jsonl' does not exist"),
    (["run.resume=true", "model.build.hidden_size=32"], "model hidden_size: 64 in the checkpoint, 32 now"),
    (["run.resume=true", "backend.lr=-1"], "lr must be positive, got -1"),
    (["run.resume=true", "run.overwrite=true"], "run.resume and run.overwrite are both true"),
    (["run.overwrite=true", "rollout.engine.num_engines=2", "cluster.num_cpus=2"],
     "cluster.num_cpus=2 cannot place this run: 2 engine(s) x cluster.cpus_per_engine=1.0 + 1 for training"),
    (["run.overwrite=true", "rollout.sampling.max_new_tokens=30"],
     "leave no room for rollout.sampling.max_new_tokens=30 in the model's context of 32 tokens"),
])
def test_a_failed_start_never_changes_the_run_directory(capsys, victim, overrides, expected):
    for command in (["config", "--check"], ["train"]):  # the two commands make the same checks
        code, err = cli(capsys, *command, CONFIG, *SMALL, f"run.dir={victim}", *overrides)
        assert code == 2, err
        assert expected in err
        assert "Traceback" not in err


def test_run_dir_naming_a_file_is_a_config_error(capsys, tmp_path):
    path = tmp_path / "a_file"
    path.write_text("keep me")
    code, err = cli(capsys, "train", CONFIG, *SMALL, f"run.dir={path}")
    assert code == 2 and f"run.dir '{path}' is a file" in err
    assert path.read_text() == "keep me"


def test_overwrite_replaces_what_an_earlier_run_left(capsys, base_run, tmp_path):
    import shutil

    run_dir = tmp_path / "again"
    shutil.copytree(base_run, run_dir)
    (run_dir / "stale.txt").write_text("from before")
    assert main(["train", CONFIG, *SMALL, "run.steps=2", f"run.dir={run_dir}", "run.overwrite=true"]) == 0
    assert not (run_dir / "stale.txt").exists()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_miles_config_runs_the_checks_that_need_no_training(capsys, tmp_path):
    code, err = cli(capsys, "config", CONFIG, f"run.dir={tmp_path / 'new'}", "backend.lr=-1")
    assert code == 2 and "backend 'torch' rejected its arguments: lr must be positive, got -1" in err
    code, err = cli(capsys, "config", CONFIG, f"run.dir={tmp_path / 'new'}", "backend.name=fsdp2", "sft.lr=0.5",
                    "backend.micro_batch_size=0")
    assert code == 2 and "micro_batch_size must be >= 1, got 0" in err
    assert not (tmp_path / "new").exists()
    code, _ = cli(capsys, "config", CONFIG, f"run.dir={tmp_path / 'new'}")
    assert code == 0 and not (tmp_path / "new").exists()  # nothing is written, not even the run directory


@pytest.mark.parametrize(("content", "expected"), [
    (b"", "has no rows (it is empty); expected one JSON object per line"),
    (b'{"prompt": "1+1=", "label": "2"}\n\n{"prompt": oops}\n', "line 3: not valid JSON"),
    (b'{"prompt": "1+1=", "label": "2"}\n["a list"]\n', "line 2: expected a JSON object"),
    (b"\x89PNG\r\n\x1a\n" + bytes(range(256)), "line 1: not UTF-8 text (is it a binary file?)"),
])
def test_bad_data_files_name_the_file_and_the_line(capsys, tmp_path, content, expected):
    path = tmp_path / "train.jsonl"
    path.write_bytes(content)
    code, err = cli(capsys, "train", CONFIG, *SMALL, f"run.dir={tmp_path / 'run'}", "data.generator=null",
                    f"data.train_path={path}")
    assert code == 2, err
    assert f"data file '{path}'" in err and expected in err
    assert not (tmp_path / "run").exists()


def test_overlong_prompts_are_refused_or_dropped_and_counted(capsys, tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(5) for b in range(5)]
    rows.insert(3, {"prompt": "1+" * 15 + "1=", "label": "16"})  # 32 characters: no room left in a 32-token context
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    args = ["train", CONFIG, *SMALL, "data.generator=null", f"data.train_path={path}"]
    code, err = cli(capsys, *args, f"run.dir={tmp_path / 'refused'}")
    assert code == 2
    assert "1 of 26 prompt(s) leave no room" in err and "the longest, line 4, has 32 tokens; at most 28 fit" in err
    assert main([*args, f"run.dir={tmp_path / 'dropped'}", "data.overlong_prompts=drop"]) == 0
    assert "dropped 1 prompt(s)" in capsys.readouterr().err
    assert json.loads((tmp_path / "dropped" / "summary.json").read_text())["data/dropped_prompts"] == 1


@pytest.mark.parametrize(("text", "expected"), [
    ("", "is empty; expected a mapping of sections"),
    ("run:\n  steps: 3\nsft:\n  steps: 0\nrun:\n  seed: 1\n", "key 'run' appears twice in one mapping (lines 1 and 5)"),
    ("rollout:\n  sampling: {max_new_tokens: 3, max_new_tokens: 4}\n", "key 'max_new_tokens' appears twice"),
])
def test_config_file_problems_are_named(capsys, tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    code, err = cli(capsys, "config", str(path))
    assert code == 2 and expected in err


def test_a_directory_as_config_file(capsys, tmp_path):
    code, err = cli(capsys, "config", str(tmp_path))
    assert code == 2 and "is a directory; expected a YAML file" in err


def damage_file(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def test_resume_skips_a_damaged_checkpoint_and_names_it(capsys, base_run, tmp_path):
    import shutil

    run_dir = tmp_path / "damaged"
    shutil.copytree(base_run, run_dir)
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    weights = next((newest / "backend").rglob("*.safetensors"))
    damage_file(weights)
    assert main(["train", CONFIG, *SMALL, f"run.dir={run_dir}", "run.resume=true"]) == 0
    err = capsys.readouterr().err
    assert f"run.resume: skipping damaged checkpoint {newest.name}: {weights}" in err
    assert "continuing from" in err and "step_000002 (2 steps done)" in err


@pytest.mark.parametrize("which", ["loop.pt", "state.json", "trainer.pt"])
def test_resume_with_no_intact_checkpoint_is_refused_naming_every_file(capsys, base_run, tmp_path, which):
    import shutil

    run_dir = tmp_path / "damaged"
    shutil.copytree(base_run, run_dir)
    broken = []
    for checkpoint in sorted((run_dir / "checkpoints").iterdir()):
        path = next(checkpoint.rglob(which))
        damage_file(path)
        broken.append(path)
    before = snapshot(run_dir)
    code, err = cli(capsys, "train", CONFIG, *SMALL, f"run.dir={run_dir}", "run.resume=true")
    assert code == 2 and "run.resume: no intact checkpoint under" in err
    assert all(str(path) in err for path in broken)
    assert snapshot(run_dir) == before
    assert newest_intact_checkpoint(run_dir / "checkpoints")[0] is None


def test_progress_in_a_log_file_is_a_few_plain_lines(tmp_path):
    log = open(tmp_path / "log.txt", "w")
    with PlainProgress(total=200, desc="grpo", file=log) as bar:
        for step in range(200):
            bar.set_postfix(reward=f"{step / 200:.3f}")
            bar.update()
    log.close()
    lines = (tmp_path / "log.txt").read_text().splitlines()
    assert lines[0] == "grpo: 20/200 (reward=0.095)" and lines[-1] == "grpo: 200/200 (reward=0.995)"
    assert len(lines) == 10 and "\r" not in (tmp_path / "log.txt").read_text()


def test_a_run_logged_to_a_file_has_no_carriage_returns(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(tmp_path / "log.txt", "w") as log:
        code = subprocess.run([sys.executable, "-m", "miles", "train", CONFIG, *SMALL, "run.progress=true",
                               f"run.dir={run_dir}"], stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    text = (tmp_path / "log.txt").read_text()
    assert code == 0, text
    assert "\r" not in text and "grpo: 4/4 (reward=" in text and "sft: 2/2 (loss=" in text


def test_sigterm_exits_143_and_sigint_130(tmp_path):
    """A run held by a reward that waits for a file (from its first call, or once the run's step-2 checkpoint
    exists): stopped, it unwinds, exits 143 or 130, names its last checkpoint (or that it has none) and the command
    that continues it; that command finishes the run."""
    gate = tmp_path / "release"
    plugin = tmp_path / "gated_reward.py"
    plugin.write_text(
        "import os, time\n"
        "from pathlib import Path\n"
        f"HELD = Path({str(tmp_path / 'held')!r})\n"
        "def gated(sample):\n"
        "    if os.environ.get('HOLD_AFTER') and not Path(os.environ['HOLD_AFTER']).exists():\n"
        "        return 1.0\n"
        "    HELD.touch()\n"
        f"    while not Path({str(gate)!r}).exists():\n"
        "        time.sleep(0.05)\n"
        "    return 1.0\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tmp_path)}
    for sig in (signal.SIGTERM, signal.SIGINT):
        (tmp_path / "held").unlink(missing_ok=True)
        gate.unlink(missing_ok=True)
        run_dir = tmp_path / sig.name
        hold_after = {"HOLD_AFTER": str(run_dir / "checkpoints" / "step_000002")} if sig == signal.SIGTERM else {}
        command = ["train", CONFIG, *SMALL, "reward.name=gated_reward:gated", f"run.dir={run_dir}"]
        proc = subprocess.Popen([*MILES_WITH_CTRL_C, *command], env={**env, **hold_after}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            while not (tmp_path / "held").exists():  # the run is inside its first reward call
                assert proc.poll() is None, proc.communicate()[0]
                time.sleep(0.05)
            proc.send_signal(sig)
            gate.touch()  # free the reward's thread whether or not it runs in one of its own
            output = proc.communicate(timeout=120)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 128 + sig, output
        assert ("miles: terminated (SIGTERM)" if sig == signal.SIGTERM else "miles: interrupted") in output
        assert "Traceback" not in output
        resume = shlex.join(["miles", *command, "run.resume=true"])
        if sig == signal.SIGINT:  # held in step 0: nothing saved yet
            assert (f"miles: no checkpoint of this run in {run_dir} (it saves one every 2 steps (run.save_every)); "
                    f"this starts it over from step 0 there:\n  {resume}\n") in output, output
            continue
        assert (f"miles: the last checkpoint is {run_dir / 'checkpoints' / 'step_000002'} (2 RL steps done); continue "
                f"from it with:\n  {resume}\n") in output, output
        # the printed command, as a user pastes it (miles on PATH: the venv's), finishes the run from step 2
        rest = shlex.split(resume)[1:]
        done = subprocess.run([sys.executable, "-m", "miles", *rest], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if "reward/mean" in line]
        assert logged == [0, 1, 2, 3], logged
