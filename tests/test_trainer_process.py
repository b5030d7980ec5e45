"""The trainer in a process of its own (backend.separate_process, miles/train/process_backend.py): where it runs by
default, that it trains exactly what the in-process trainer trains, and that it never outlives the run nor hides a
failure: a trainer that dies at any call (start-up, a forward, a train step, a weight export, a checkpoint) stops
the run with that call named and the last checkpoint untouched; a SIGKILLed driver takes it along; Ctrl-C ends
both."""

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
import torch
from safetensors.torch import load_file

import miles
from miles.errors import ConfigError, DataError, RunError
from miles.run.runner import prepare, train
from miles.train.process_backend import ProcessBackend, TrainerProcess
from miles.train.torch_backend import TorchBackend

QUICK = ["sft.steps=20", "run.eval_size=0", "rollout.prompts_per_step=4", "rollout.n_samples=4", "run.progress=false"]
TRAINS_IN = re.compile(r"the trainer runs in process (\d+)")


def trainers() -> list[int]:
    """The trainers of this process: the children of its multiprocessing fork server (which forks them)."""
    return [pid for server in children(FORKSERVER) for pid in children(FORKSERVER, server)]


FORKSERVER = "multiprocessing.forkserver"


class DiesAt(TorchBackend):
    """The torch backend, SIGKILLed in the middle of its ``die_at``-th call of ``die_in`` (counted from 1)."""

    def __init__(self, die_in: str = "", die_at: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.die_in, self.die_at, self.calls = die_in, die_at, {}

    def _call(self, method, *args, **kwargs):
        self.calls[method] = self.calls.get(method, 0) + 1
        if method == self.die_in and self.calls[method] == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return getattr(super(), method)(*args, **kwargs)

    def setup(self, *args, **kwargs):
        return self._call("setup", *args, **kwargs)

    def train_step(self, *args, **kwargs):
        return self._call("train_step", *args, **kwargs)

    def export_weights(self, *args, **kwargs):
        return self._call("export_weights", *args, **kwargs)

    def save_checkpoint(self, *args, **kwargs):
        return self._call("save_checkpoint", *args, **kwargs)


class Raises(TorchBackend):
    def train_step(self, batch, loss_fn):
        raise ValueError("the loss is not finite (from the test)")


class Backends:
    @miles.hookimpl
    def miles_register_backends(self, register):
        register("dies_at", DiesAt)
        register("raises", Raises)


class RayLike(TorchBackend):
    uses_ray, ray_resources, ray_cpus = True, {}, 1.0


class RayBackends:
    @miles.hookimpl
    def miles_register_backends(self, register):
        register("ray_like", RayLike)


def quickstart(run_dir: Path, *overrides: str, plugins=()):
    return prepare("configs/quickstart.yaml", [f"run.dir={run_dir}", *QUICK, *overrides], extra_plugins=plugins)


@pytest.mark.parametrize("override, message", [
    ("backend.separate_process=maybe", "backend.separate_process: expected auto, true or false, got 'maybe'"),
    ("backend.separate_process=2", "backend.separate_process: expected auto, true or false, got 2"),
])
def test_bad_settings_name_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        quickstart(tmp_path, override)


def test_true_refuses_a_backend_with_ray_workers_of_its_own(tmp_path):
    with pytest.raises(ConfigError, match="backend.separate_process: true trains in a child process of this one, but "
                                          "backend 'ray_like' trains in Ray workers of its own already"):
        quickstart(tmp_path, "backend.name=ray_like", "backend.separate_process=true",
                   plugins=[("ray_backends", RayBackends())])


@pytest.mark.parametrize("schedule", ["async", "one_step_off"])
def test_a_streaming_schedule_trains_in_a_child_process_beside_the_engine(tmp_path, capsys, schedule):
    """The default on 2 cores or more: the trainer moves out, the engine stays (no HTTP between it and the
    rollouts); the child is gone when the run ends."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("auto keeps the trainer in process on one core")
    train(quickstart(tmp_path, "run.steps=3", f"run.schedule={schedule}"))
    err = capsys.readouterr().err
    pid = int(TRAINS_IN.search(err).group(1))
    assert "serves from process" not in err and "cannot overlap" not in err
    assert not alive(pid) and trainers() == []
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["train/samples"] == 16 for r in rows)
    assert (tmp_path / "final_model" / "model.safetensors").exists()


class SaysItsEnvironment(TorchBackend):
    def setup(self, *args, **kwargs):
        raise LookupError(os.environ.get("MILES_TEST_LATE", "not set"))


def test_trainers_are_forked_by_a_server_that_imported_torch_once_and_get_the_environment_of_now(monkeypatch):
    """A spawned trainer imported torch and transformers again, seconds each time: the fork server imports them once
    per driver, and each trainer is forked from it. A variable set after the server started reaches the next
    trainer (the server's environment is the one of its start)."""
    first = TrainerProcess(1)
    trainer = first.started().pid
    servers = [server for server in children(FORKSERVER) if trainer in children("", server)]
    assert len(servers) == 1 and trainer not in children("")  # the server forked it, not this process
    assert "libtorch" in Path(f"/proc/{servers[0]}/maps").read_text()  # imported before any trainer asked for it
    assert trainers() == [first.proc.pid]
    first.stop()
    monkeypatch.setenv("MILES_TEST_LATE", "set after the server started")
    backend = ProcessBackend(SaysItsEnvironment(), threads=1)
    try:
        with pytest.raises(LookupError, match="set after the server started"):
            backend.setup("no model", seed=0)
    finally:
        backend.shutdown()
    assert trainers() == []


def test_sync_trains_in_process_unless_asked(tmp_path, capsys):
    train(quickstart(tmp_path / "a", "run.steps=1"))
    assert "the trainer runs in process" not in capsys.readouterr().err
    train(quickstart(tmp_path / "b", "run.steps=1", "sft.steps=0", "backend.separate_process=true"))
    assert TRAINS_IN.search(capsys.readouterr().err)


def test_the_child_trains_exactly_what_the_in_process_trainer_trains(tmp_path):
    """Sync is deterministic: the same run with the trainer here and in a child logs the same losses, rewards and
    gradient norms and ends with the same weights, bit for bit (everything crosses the pipe exactly)."""
    runs = {}
    for separate in ("false", "true"):
        run_dir = tmp_path / separate
        train(quickstart(run_dir, "run.steps=4", "sft.steps=0", f"backend.separate_process={separate}",
                         "run.save_every=2"))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[separate] = ([{k: r[k] for k in ("reward/mean", "train/loss", "train/grad_norm", "train/kl")}
                           for r in rows], load_file(run_dir / "final_model" / "model.safetensors"))
    (rows_here, weights_here), (rows_child, weights_child) = runs["false"], runs["true"]
    assert rows_here == rows_child
    assert weights_here.keys() == weights_child.keys()
    assert all(torch.equal(weights_here[k], weights_child[k]) for k in weights_here)


def test_a_run_that_fails_its_checks_leaves_no_trainer_behind(tmp_path):
    """The trainer's process starts before the run's checks (its start-up overlaps them); a check that fails ends
    it, and the run directory is not made."""
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n{"question": "2+2="}\n')
    p = quickstart(tmp_path / "run", "run.steps=2", "run.schedule=async", "backend.separate_process=true",
                   f"data.train_path={tmp_path / 'data.jsonl'}", "data.generator=null")
    with pytest.raises(DataError, match="line 2 has no 'prompt'"):
        train(p)
    assert trainers() == [] and not (tmp_path / "run").exists()


def test_a_failure_in_the_child_reaches_the_run_with_its_type_and_message(tmp_path):
    """The child's traceback travels with the exception (a note, shown where its traceback is)."""
    p = quickstart(tmp_path, "run.steps=2", "sft.steps=0", "backend.name=raises", "backend.separate_process=true",
                   plugins=[("backends", Backends())])
    with pytest.raises(ValueError, match=r"the loss is not finite \(from the test\)") as raised:
        train(p)
    notes = "\n".join(raised.value.__notes__)
    assert "the training process failed in train_step" in notes and "Traceback" in notes
    assert trainers() == []


@pytest.mark.parametrize("method, at", [
    ("setup", 1),  # start-up
    ("train_step", 1),  # the first step
    ("train_step", 3),  # after a checkpoint (save_every 2)
    ("export_weights", 2),  # a weight push
    ("save_checkpoint", 1),  # writing the checkpoint
])
def test_a_trainer_killed_in_any_call_stops_the_run_naming_it(tmp_path, method, at):
    p = quickstart(tmp_path, "run.steps=4", "sft.steps=0", "run.save_every=2", "run.schedule=async",
                   "backend.name=dies_at", f"backend.die_in={method}", f"backend.die_at={at}",
                   "backend.separate_process=true", plugins=[("backends", Backends())])
    with pytest.raises(RunError, match=rf"the training process died during {method} \(exit code -9\); the last "
                                       rf"checkpoint is untouched"):
        train(p)
    assert trainers() == []
    checkpoints = sorted(path.name for path in (tmp_path / "checkpoints").glob("step_*"))
    if (method, at) != ("train_step", 3):
        assert checkpoints == []
        return
    # the step-2 checkpoint was written before, and is whole: the run resumes from it and finishes
    assert checkpoints == ["step_000002"]
    train(quickstart(tmp_path, "run.steps=4", "sft.steps=0", "run.save_every=2", "run.schedule=async",
                     "backend.name=dies_at", "backend.separate_process=true", "run.resume=true",
                     plugins=[("backends", Backends())]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]


def run_in_a_process(tmp_path: Path, *overrides: str, out: Path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "miles", "train", "configs/quickstart.yaml", f"run.dir={tmp_path / 'run'}", *QUICK,
         "run.steps=100000", "backend.separate_process=true", "run.schedule=async", *overrides],
        stdout=out.open("w"), stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def wait_for_steps(proc, log: Path, metrics: Path, steps: int) -> int:
    deadline = time.monotonic() + 300
    while not ((found := TRAINS_IN.search(log.read_text()))
               and len(metrics.read_text().splitlines() if metrics.exists() else []) >= steps):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    return int(found.group(1))


@pytest.mark.parametrize("after_steps", [0, 1, 3])
def test_the_trainer_dies_with_a_sigkilled_driver(tmp_path, after_steps):
    log = tmp_path / "out.log"
    proc = run_in_a_process(tmp_path, out=log)
    pid = wait_for_steps(proc, log, tmp_path / "run" / "metrics.jsonl", after_steps)
    assert alive(pid)
    proc.kill()
    proc.wait()
    assert wait_gone(pid), f"the trainer's process {pid} outlived the driver"


def test_ctrl_c_ends_the_driver_and_the_trainer(tmp_path):
    """SIGINT to the whole process group, as a terminal sends it: the child ignores it, the driver stops the run
    and shuts the child down."""
    log = tmp_path / "out.log"
    proc = run_in_a_process(tmp_path, out=log)
    pid = wait_for_steps(proc, log, tmp_path / "run" / "metrics.jsonl", 2)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) != 0
    assert "interrupted" in log.read_text()
    assert wait_gone(pid), f"the trainer's process {pid} outlived the interrupted run"
