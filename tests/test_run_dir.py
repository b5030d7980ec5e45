"""run.dir is taken literally from the command line, and one run at a time holds it."""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from miles.cli import main
from miles.config import load_config, parse_overrides
from miles.config.schema import structured_defaults
from miles.errors import ConfigError
from miles.run.lock import LOCK_NAME

CONFIG = "configs/quickstart.yaml"
TINY = ["run.progress=false", "sft.steps=0", "run.steps=1", "run.eval_size=0", "rollout.prompts_per_step=2",
        "rollout.n_samples=2"]
ROOT = Path(__file__).resolve().parents[1]

# Every character YAML gives a meaning to, in a plain scalar or at its start, and the spaces around them.
YAML_SPECIAL = "#:{}[],&*!|>'\"%@`-?~=\\\n\r\t "


def snapshot(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file()}


def fuzzed_values(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = YAML_SPECIAL + "ab/.3é３"
    values = [f"/x/victim {c}2" for c in YAML_SPECIAL] + [f"{c}x" for c in YAML_SPECIAL] + ["null", "~", "true", "1e3"]
    values += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(count)]
    return [v for v in values if not (len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"")]  # quoting is its own case


def test_a_string_key_takes_the_override_literally():
    schema = structured_defaults()
    for value in fuzzed_values(seed=0, count=300):
        parsed = parse_overrides([f"run.dir={value}", f"data.eval_path={value}", f"model.path={value}"], schema)
        assert parsed.run.dir == value
        if value.strip() not in ("null", "~"):  # an optional key: null unsets it
            assert parsed.data.eval_path == value and parsed.model.path == value
        else:
            assert parsed.data.eval_path is None
    for value in fuzzed_values(seed=1, count=20):  # and through the merge onto the file and the schema
        assert load_config(CONFIG, [f"run.dir={value}"]).run.dir == value


def test_quotes_around_a_string_value_are_yaml_quotes():
    config = load_config(CONFIG, ["run.dir='/x/a #b'", 'data.eval_path="null"', "model.path='  spaced '"])
    assert (config.run.dir, config.data.eval_path, config.model.path) == ("/x/a #b", "null", "  spaced ")


def test_yaml_booleans_for_a_string_key_keep_yaml_spelling(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"chat_template": True}}))
    assert load_config(path).data.chat_template == "true"
    assert load_config(CONFIG, ["data.chat_template=false"]).data.chat_template == "false"


@pytest.mark.parametrize(("override", "message"), [
    ("run.steps=5 #x", "override run.steps='5 #x' has a '#' after a space, which YAML reads as a comment "
                       "(dropping '#x')"),
    ("run.steps=#5", "(dropping '#5')"),
    ("run.plugins.allow=[a, b] # c", "(dropping '# c')"),
    ("reward.args.answer=yes #no", "(dropping '#no')"),
    ("run.steps=5\n6", "has a line break, which YAML folds into a space"),
    ("rollout.sampling.temperature=0.5\r", "has a line break"),
    ("run.steps=[1, 2 #c]", "is not a valid YAML value"),
])
def test_an_override_yaml_would_change_is_refused_naming_it(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, [override])
    assert message in str(err.value)


def test_yaml_values_that_keep_every_character_still_parse():
    config = load_config(CONFIG, ["run.plugins.allow=[a, 'b #c']", "run.steps=5", "run.seed='7'",
                                  "rollout.sampling.temperature=1e-1", "reward.args.tag=a#b"])
    assert list(config.run.plugins.allow) == ["a", "b #c"]
    assert (config.run.steps, config.rollout.sampling.temperature, config.reward.args.tag) == (5, 0.1, "a#b")


def test_a_run_dir_with_a_hash_is_a_new_run_not_the_one_before_it(tmp_path, capsys):
    victim = tmp_path / "victim"
    assert main(["train", CONFIG, *TINY, f"run.dir={victim}"]) == 0
    before = snapshot(victim)
    assert main(["train", CONFIG, *TINY, f"run.dir={victim} #2", "run.overwrite=true"]) == 0
    assert snapshot(victim) == before
    assert (tmp_path / "victim #2" / "metrics.jsonl").is_file()
    assert not (victim / LOCK_NAME).exists() and not (tmp_path / "victim #2" / LOCK_NAME).exists()


def miles_train(*overrides: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "miles", "train", CONFIG, *TINY, *overrides], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def generator_held_on_a_fifo(seed: int, fifo: str) -> dict:
    """A data generator (import path ``tests.test_run_dir:generator_held_on_a_fifo``) that waits on a FIFO no one
    writes: a run using it holds its run.dir, between its lock and its first write, until it is killed."""
    with open(fifo) as f:
        f.read()
    raise AssertionError("nothing writes this FIFO")


def generator_gated_on_a_fifo(seed: int, fifo: str) -> dict:
    """The quickstart's data generator, once the test writes ``go`` into a FIFO (import path
    ``tests.test_run_dir:generator_gated_on_a_fifo``): a run using it holds its run.dir until then."""
    from miles.builtin.data import addition

    with open(fifo) as f:
        assert f.read() == "go"
    return addition(seed)


def wait_for_holder(lock: Path, process: subprocess.Popen) -> None:
    """Until ``process`` has written its pid into the lock file (it holds the lock from then on)."""
    while process.poll() is None:
        try:
            if json.loads(lock.read_text() or "{}").get("pid") == process.pid:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"the holder exited first: {process.communicate()}")


def test_a_second_run_on_a_held_run_dir_is_refused_and_a_killed_holder_leaves_it_free(tmp_path, capsys):
    """Two real ``miles train`` processes. The first holds run.dir while its data generator waits on a FIFO nobody
    writes (after the lock, before anything is written); the second is refused at once; the first is SIGKILLed
    holding the lock, and the next run takes the directory (and removes the killed run's staging folder)."""
    run_dir, fifo = tmp_path / "run", tmp_path / "gate"
    os.mkfifo(fifo)
    holder = miles_train(f"run.dir={run_dir}", "data.generator.name=tests.test_run_dir:generator_held_on_a_fifo",
                         f"data.generator.fifo={fifo}")
    try:
        wait_for_holder(run_dir / LOCK_NAME, holder)
        before = snapshot(run_dir)
        for extra in ([], ["run.overwrite=true"], ["run.resume=true"]):
            code = main(["train", CONFIG, *TINY, f"run.dir={run_dir}", *extra])
            err = capsys.readouterr().err
            assert code == 2, err
            assert f"run.dir '{run_dir}' is in use by another run (pid {holder.pid} on " in err
            assert snapshot(run_dir) == before
        second = miles_train(f"run.dir={run_dir}")  # a process of its own: POSIX locks are per process
        out, err = second.communicate(timeout=120)
        assert second.returncode == 2 and f"(pid {holder.pid} on " in err, err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
    assert (run_dir / LOCK_NAME).exists()  # left by the killed holder, and no longer locked
    staging = list(Path(tempfile.gettempdir()).glob(f"miles-staging-{holder.pid}-*"))
    assert len(staging) == 1  # the folder it was setting up in: no one else removes it
    assert main(["train", CONFIG, *TINY, f"run.dir={run_dir}"]) == 0
    assert (run_dir / "metrics.jsonl").is_file() and not (run_dir / LOCK_NAME).exists()
    assert not staging[0].exists()  # removed by the next run's start


def test_two_runs_started_at_once_on_one_new_run_dir_one_trains_the_other_is_refused(tmp_path):
    """Both start at the same moment on a directory that does not exist yet. The winner of the lock waits in its
    data generator until the loser has exited, so the loser always meets a held lock, whoever wins."""
    run_dir, fifo = tmp_path / "new" / "run", tmp_path / "gate"
    os.mkfifo(fifo)
    gated = ["data.generator.name=tests.test_run_dir:generator_gated_on_a_fifo", f"data.generator.fifo={fifo}"]
    runs = [miles_train(f"run.dir={run_dir}", *gated) for _ in range(2)]
    try:
        while all(r.poll() is None for r in runs):
            time.sleep(0.05)
        loser = next(r for r in runs if r.poll() is not None)
        winner = next(r for r in runs if r is not loser)
        err = loser.communicate()[1]
        assert loser.returncode == 2 and f"is in use by another run (pid {winner.pid} on " in err, err
        fifo.write_text("go")
        out, err = winner.communicate(timeout=300)
        assert winner.returncode == 0, err
    finally:
        for r in runs:
            r.kill() if r.poll() is None else None
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0]
    assert json.loads((run_dir / "run.json").read_text())["config"]["run"]["dir"] == str(run_dir)
    assert not (run_dir / LOCK_NAME).exists()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_read_only_run_dir_is_a_config_error_naming_it(tmp_path):
    """A read-only mount (bubblewrap binds it so, even for root): a new run under it, and a resume in it."""
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text("")
    script = (f"{sys.executable} -m miles train {CONFIG} {' '.join(TINY)} run.dir={tmp_path}/new/run; echo rc=$?; "
              f"{sys.executable} -m miles train {CONFIG} {' '.join(TINY)} run.dir={tmp_path}/old run.resume=true; "
              "echo rc=$?")
    done = subprocess.run(["bwrap", "--dev-bind", "/", "/", "--ro-bind", str(tmp_path), str(tmp_path), "sh", "-c",
                           script], cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["rc=2", "rc=2"], done.stderr
    for name, where in (("new/run", "new"), ("old", f"old/{LOCK_NAME}")):
        assert (f"miles: error: run.dir '{tmp_path}/{name}' cannot hold a run: Read-only file system "
                f"({tmp_path}/{where}); choose a directory this user can write to") in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_disk_that_fills_during_a_checkpoint_stops_the_run_with_one_line_and_resume_goes_on(tmp_path):
    """run.dir on a 4.6 MB tmpfs (bubblewrap mounts it), with a 2 MB file taking room: the built model (0.5 MB)
    and the step-2 checkpoint (1.6 MB) fit, the step-4 checkpoint does not. Once the file is gone, the run
    resumes from step 2."""
    disk = tmp_path / "disk"
    disk.mkdir()
    train = (f"{sys.executable} -m miles train {CONFIG} {' '.join(TINY)} run.steps=4 run.save_every=2 "
             f"run.dir={disk}/run")
    script = (f"head -c 2000000 /dev/zero > {disk}/filler; {train}; echo rc=$?; rm {disk}/filler; "
              f"{train} run.resume=true; echo rc=$?; cat {disk}/run/metrics.jsonl")
    done = subprocess.run(["bwrap", "--dev-bind", "/", "/", "--size", str(4_600_000), "--tmpfs", str(disk),
                           "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    codes = [line for line in done.stdout.splitlines() if line.startswith("rc=")]
    assert codes == ["rc=1", "rc=0"], done.stderr
    assert (f"miles: error: checkpoint step_000004 could not be written under '{disk}/run/checkpoints': no space "
            "left on the device") in done.stderr
    assert "the checkpoints before it are intact: free space there, then continue with run.resume=true" in done.stderr
    assert "Traceback" not in done.stderr
    assert "run.resume: continuing from" in done.stderr and "(2 steps done)" in done.stderr
    steps = [json.loads(line)["step"] for line in done.stdout.splitlines() if line.startswith("{")]
    assert steps == [0, 1, 2, 3]  # steps 2 and 3 redone once, after the resume
