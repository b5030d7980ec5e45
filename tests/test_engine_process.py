"""The embedded engine in a process of its own under a streaming schedule (rollout.engine.separate_process,
miles/engine/process.py) when the trainer keeps the run's process (backend.separate_process=false): where it
runs, what a run says when it cannot overlap, and that the server never outlives the run: at its end, when the
trainer is SIGKILLed, and when the server itself dies mid-run (it is started again and caught up)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import alive, children, wait_gone

import miles
from miles.errors import ConfigError
from miles.run.runner import prepare, train

# backend.separate_process=false: the trainer keeps this process, so that auto serves the engine from a child
QUICK = ["sft.steps=20", "run.eval_size=0", "rollout.prompts_per_step=4", "rollout.n_samples=4", "run.progress=false",
         "backend.separate_process=false"]
SERVED_FROM = re.compile(r"the engine serves from process (\d+)")


@pytest.mark.parametrize("override, message", [
    ("rollout.engine.separate_process=maybe", "rollout.engine.separate_process: expected auto, true or false, "
                                              "got 'maybe'"),
    ("rollout.engine.separate_process=1", "rollout.engine.separate_process: expected auto, true or false, got 1"),
])
def test_bad_settings_name_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        prepare("configs/quickstart.yaml", [f"run.dir={tmp_path}", override])


def test_true_needs_the_builtin_engine_in_process(tmp_path):
    with pytest.raises(ConfigError, match="separate_process: true serves the builtin engine 'local' from a process of "
                                          "its own .with num_engines 0.; got engine 'local' with num_engines 1"):
        prepare("configs/quickstart.yaml", [f"run.dir={tmp_path}", "rollout.engine.separate_process=true",
                                            "rollout.engine.num_engines=1"])


class Watcher:
    """At the end of step ``at``, checks the engine's process and may kill it (SIGKILL)."""

    def __init__(self, at: int = 0, kill: bool = False) -> None:
        self.at, self.kill = at, kill
        self.seen: list[tuple[int, str]] = []  # (pid, command line) of the engine's process while the run ran
        self.pid: int | None = None

    @miles.hookimpl
    def miles_train_step_end(self, step, metrics):
        if step != self.at or self.pid is None:
            return
        self.seen.append((self.pid, Path(f"/proc/{self.pid}/cmdline").read_text().replace("\0", " ")))
        if self.kill:
            os.kill(self.pid, signal.SIGKILL)


def train_watching(p, watcher: Watcher) -> list[int]:
    """Train; the engine's process, named on stderr while the plane starts, goes to ``watcher.pid``. Returns every
    pid so named (a restarted server is not: it is logged)."""
    original, pids = sys.stderr.write, []

    def spy(text):
        if found := SERVED_FROM.search(text):
            watcher.pid = int(found.group(1))
            pids.append(watcher.pid)
        return original(text)

    sys.stderr.write = spy
    try:
        train(p)
    finally:
        sys.stderr.write = original
    return pids


@pytest.mark.parametrize("schedule", ["async", "one_step_off"])
def test_a_streaming_schedule_serves_the_engine_from_a_child_process_that_ends_with_the_run(tmp_path, capsys,
                                                                                            schedule):
    watcher = Watcher()
    p = prepare("configs/quickstart.yaml", [f"run.dir={tmp_path}", *QUICK, "run.steps=3", f"run.schedule={schedule}"],
                extra_plugins=[("watcher", watcher)])
    train_watching(p, watcher)
    assert watcher.pid is not None, capsys.readouterr().err
    (pid, cmdline), = watcher.seen
    assert "engine serve" in cmdline and "--engine-args" in cmdline
    assert not alive(pid) and engine_servers() == []  # stopped at the run's end
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["rollout/engines_in_service"] == 1 for r in rows)


def test_a_sync_run_keeps_the_engine_in_process_unless_asked(tmp_path, capsys):
    train(prepare("configs/quickstart.yaml", [f"run.dir={tmp_path / 'a'}", *QUICK, "run.steps=1"]))
    assert "serves from process" not in capsys.readouterr().err
    train(prepare("configs/quickstart.yaml", [f"run.dir={tmp_path / 'b'}", *QUICK, "run.steps=1", "sft.steps=0",
                                              "rollout.engine.separate_process=true"]))
    assert SERVED_FROM.search(capsys.readouterr().err)


def test_an_engine_process_killed_mid_run_is_started_again_and_caught_up(tmp_path, capsys):
    """SIGKILL at the end of step 1: the router finds it gone, starts a new one (a new pid), pushes it the current
    weights, and the run finishes every step with each sample counted once."""
    watcher = Watcher(at=1, kill=True)
    p = prepare("configs/quickstart.yaml", [f"run.dir={tmp_path}", *QUICK, "run.steps=4", "run.schedule=async",
                                            "cluster.router.health_interval_s=0.05", "cluster.router.max_failures=1"],
                extra_plugins=[("watcher", watcher)])
    pids = train_watching(p, watcher)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert sum(r["rollout/readmissions"] for r in rows) == 1 and sum(r["rollout/engine_failures"] for r in rows) == 1
    # what was in flight was retried on the new process: every sample generated once, none failed, all trained
    assert all(r["samples/failed"] == 0 and r["train/samples"] == 16 for r in rows)
    # each sample counted once: those of the 16 trained groups, of the groups the stream had finished past the last
    # batch (buffered: the stream runs ahead of the trainer), and of any found too old to train
    finished = 4 * 4 + rows[-1]["async/buffer_groups"] + sum(r["async/stale_dropped"] for r in rows)
    assert sum(r["samples/total"] for r in rows) == 4 * finished
    assert pids == [watcher.seen[0][0]] and not alive(pids[0])
    assert engine_servers() == [], "the engine's second process outlived the run"


def engine_servers() -> list[int]:
    """Children of this process serving an engine."""
    return children("engine\0serve")


def run_quickstart_in_a_process(tmp_path: Path, *overrides: str, affinity: set[int] | None = None,
                                out: Path | None = None):
    """``miles train`` on the quickstart in a process of its own (on the cores ``affinity``), its output in a pipe
    or the file ``out``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", "import os, sys; from miles.cli import main; "
                               f"{'os.sched_setaffinity(0, ' + repr(affinity) + '); ' if affinity else ''}"
                               "sys.exit(main(sys.argv[1:]))",
         "train", "configs/quickstart.yaml", f"run.dir={tmp_path / 'run'}", *QUICK, *overrides],
        stdout=subprocess.PIPE if out is None else out.open("w"), stderr=subprocess.STDOUT, text=True, env=env)


def test_on_one_core_the_run_says_why_it_will_not_overlap(tmp_path):
    proc = run_quickstart_in_a_process(tmp_path, "run.steps=1", "run.schedule=async", affinity={0})
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    assert ("run.schedule=async: the rollout cannot overlap training: the engine generates in this process (this "
            "machine gives the run 1 core)") in out
    assert "serves from process" not in out


@pytest.mark.parametrize("seed", range(3))
def test_the_engine_process_dies_with_a_sigkilled_trainer(tmp_path, seed):
    """SIGKILL the trainer at a seeded moment: as soon as its engine serves (start-up), or after 1 or 3 steps of a
    run too long to end first."""
    after_steps = [0, 1, 3][seed]
    log = tmp_path / "out.log"
    proc = run_quickstart_in_a_process(tmp_path, "run.steps=100000", "run.schedule=async", out=log)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not ((found := SERVED_FROM.search(log.read_text()))
               and len(metrics.read_text().splitlines() if metrics.exists() else []) >= after_steps):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    pid = int(found.group(1))
    assert alive(pid)
    proc.kill()
    proc.wait()
    assert wait_gone(pid), f"the engine's process {pid} outlived the trainer"
