"""The two-plane system on a real local Ray instance: engines as actors serving HTTP behind the router."""

import asyncio
import json
import os
import select
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

import miles
from miles.cluster import RayCluster
from miles.errors import ConfigError, RunError
from miles.run.runner import prepare, train


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "reward/mean" in line]


@pytest.mark.slow
def test_the_quickstart_on_ray_takes_the_steps_of_the_in_process_run(tmp_path):
    """The quickstart with its engine a Ray actor behind the router takes the steps of the same run in one
    process (which learns: tests/test_quickstart.py): the same rewards and losses, step by step (seen: equal to
    the bit); each step's update reaches the engine, and nothing fails."""
    common = ["run.progress=false", "run.eval_size=0", "sft.steps=20", "run.steps=8"]
    train(prepare("configs/quickstart.yaml", [f"run.dir={tmp_path / 'local'}", *common]))
    # The longest run.dir whose Ray folder (<run.dir>/ray) stays in it: Ray's sockets there are 107 bytes long.
    short = Path(tempfile.mkdtemp(prefix="mr", dir="/tmp"))
    ray_dir = short / ("r" * (RayCluster.MAX_TEMP_DIR - len(str(short)) - len("//ray")))
    try:
        train(prepare("configs/quickstart.yaml", [f"run.dir={ray_dir}", *common, "rollout.engine.num_engines=1"]))
        assert RayCluster.temp_dir_for(ray_dir) == ray_dir / "ray" and any((ray_dir / "ray").glob("session_*"))
        shutil.copytree(ray_dir, tmp_path / "ray", ignore=shutil.ignore_patterns("ray"))
    finally:
        shutil.rmtree(short, ignore_errors=True)
    local, rows = metrics_of(tmp_path / "local"), metrics_of(tmp_path / "ray")
    assert "rollout/engine_failures" in rows[0] and "rollout/engine_failures" not in local[0]  # the Ray plane ran
    assert [r["reward/mean"] for r in rows] == pytest.approx([r["reward/mean"] for r in local], abs=2 / 128)
    assert [r["train/loss"] for r in rows] == pytest.approx([r["train/loss"] for r in local], abs=1e-6)
    assert [r["weight_version"] for r in rows] == list(range(1, 9))  # each step's update reached the engine
    assert all(r["samples/failed"] == 0 and r["rollout/engine_failures"] == 0 for r in rows)


class EngineKiller:
    """A rollout function that SIGKILLs engine 0's process while step 2's requests are in flight, then
    (at the last step) waits until Ray has restarted it and the router has re-admitted it."""

    def __init__(self, last_step):
        self.last_step = last_step
        self.seen_steps = set()
        self.report = {}

    @miles.hookimpl
    def miles_register_rollout_fns(self, register):
        from miles.rollout.single_turn import single_turn

        async def killing_single_turn(sample, ctx):
            step = sample.group_index // 4
            router = ctx.engine
            if sample.index == 0 and sample.group_index % 4 == 0 and step not in self.seen_steps:
                self.seen_steps.add(step)
                if step == 2:
                    await router.post(router.engines[0], "/pause_generation", {})  # hold its requests in flight
                    asyncio.get_running_loop().call_later(0.3, self.kill, router)
                if step == self.last_step:
                    # Ray's restart and the catch-up take what a loaded 2-core machine gives them: the bound is
                    # only there to fail a run whose engine never comes back instead of hanging the suite
                    deadline = time.monotonic() + 900
                    while any(e.quarantined for e in router.engines) and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)
                    self.report["versions_before_last_step"] = [e.weight_version for e in router.engines]
            return await single_turn(sample, ctx)

        register("killing_single_turn", killing_single_turn)

    def kill(self, router):
        actor = router.engines[0].meta["actor"]
        import ray

        self.report["killed_pid"] = ray.get(actor.pid.remote())
        self.report["niceness"] = os.getpriority(os.PRIO_PROCESS, self.report["killed_pid"])
        os.kill(self.report["killed_pid"], signal.SIGKILL)

    @miles.hookimpl
    def miles_rollout_end(self, step, groups):
        self.report.setdefault("samples", []).append(sum(len(g.samples) for g in groups))


@pytest.mark.slow
def test_engine_killed_mid_rollout_is_restarted_and_nothing_is_lost(tmp_path):
    steps = 6
    killer = EngineKiller(last_step=steps - 1)
    train(prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path}", "run.progress=false", "sft.steps=20", f"run.steps={steps}", "run.eval_size=0",
        "rollout.engine.num_engines=2", "rollout.prompts_per_step=4", "rollout.n_samples=4",
        "rollout.fn.name=killing_single_turn", "rollout.sampling.max_new_tokens=4",
        "cluster.router.health_interval_s=0.2",
        "cluster.num_cpus=3",  # two engines and the training worker, one logical CPU each
    ], extra_plugins=[("killer", killer)]))
    rows = metrics_of(tmp_path)
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["samples/total"] == 16 and r["samples/failed"] == 0 and r["train/samples"] == 16 for r in rows)
    assert sum(r["rollout/engine_failures"] for r in rows) == 1
    assert rows[2]["rollout/retries"] >= 1  # the held requests were retried on the other engine
    assert killer.report["killed_pid"] > 0
    assert killer.report["niceness"] == 0  # Ray's default, 15, starved the engines beside any busy process
    # Restarted by Ray, caught up to the current weights before it rejoined: both engines agree.
    assert killer.report["versions_before_last_step"] == [steps - 1, steps - 1]
    assert [r["weight_version"] for r in rows] == list(range(1, steps + 1))


def test_more_engines_than_the_machine_can_place_fail_fast(tmp_path):
    with pytest.raises(ConfigError, match=r"cluster.num_cpus=2 cannot place this run: 3 engine\(s\)"):
        train(prepare("configs/quickstart.yaml", [
            f"run.dir={tmp_path}", "run.progress=false", "sft.steps=0", "run.steps=1", "run.eval_size=0",
            "rollout.engine.num_engines=3", "cluster.num_cpus=2", "cluster.engine_startup_timeout_s=5"]))


@pytest.mark.slow
@pytest.mark.parametrize("sig, moment", [(signal.SIGINT, "start-up"), (signal.SIGTERM, "steps"),
                                         (signal.SIGKILL, "start-up"), (signal.SIGKILL, "steps")])
def test_interrupted_run_leaves_no_ray_processes(tmp_path, sig, moment):
    """The signal lands as soon as Ray runs for the run (engines and workers starting), or at a random moment
    after the first step (generation, the weight push, training or logging): the run exits 128 + signal (or is
    killed), and once its reaper is done no process uses Ray's temp folder (agents included, whose command lines
    do not name it) and the folder under /tmp is gone."""
    import random
    import subprocess
    import time

    from miles._ray_reaper import processes_using
    from miles.testing import MILES_WITH_CTRL_C

    run_dir = tmp_path / "run"
    temp_dir = str(RayCluster.temp_dir_for(run_dir))
    assert temp_dir.startswith("/tmp/miles-ray-")  # the run directory is too deep for Ray's sockets
    metrics = run_dir / "metrics.jsonl"
    reached = {"start-up": lambda: len(processes_using(temp_dir)) > 1,  # the reaper, and Ray's first process
               "steps": lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 1}[moment]
    delay_s = random.Random(f"{sig}{moment}").uniform(0, 2) if moment == "steps" else 0.0
    proc = subprocess.Popen([*MILES_WITH_CTRL_C, "train", "configs/quickstart.yaml", f"run.dir={run_dir}",
                             "run.progress=false", "rollout.engine.num_engines=1", "sft.steps=5"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(9000):  # 15 min at most: a loaded machine starts Ray, the engine and SFT slowly
            if reached():
                break
            assert proc.poll() is None, proc.communicate()[0][-2000:]
            time.sleep(0.1)
        else:
            pytest.fail(f"the run did not reach {moment}")
        time.sleep(delay_s)
        reaper = [pid for pid in processes_using(temp_dir)
                  if b"_ray_reaper" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(reaper) == 1 and len(processes_using(temp_dir)) > 1  # Ray is running for this run
        reaper_done = os.pidfd_open(reaper[0])
        proc.send_signal(sig)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    where = f"signal {sig} at {moment} + {delay_s:.2f} s"
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 128 + sig, f"{where}: {output[-2000:]}"  # 130 for SIGINT, 143 for SIGTERM
        assert ("miles: interrupted" if sig == signal.SIGINT else "miles: terminated (SIGTERM)") in output, where
        assert "Traceback" not in output, f"{where}: {output[-2000:]}"
    select.select([reaper_done], [], [], 120)  # readable once the reaper has exited
    os.close(reaper_done)
    assert processes_using(temp_dir) == [], where
    assert not Path(temp_dir).exists(), where


class SuicidalLoss:
    """A loss that kills the process it runs in (the training worker) at step 2."""

    @miles.hookimpl
    def miles_register_losses(self, register):
        from miles.train.losses import ppo_clip

        def dying_ppo_clip(inputs):
            if inputs.batch.samples[0].group_index >= 2 * 4:
                os.kill(os.getpid(), signal.SIGKILL)
            return ppo_clip(inputs)

        register("dying_ppo_clip", dying_ppo_clip)


@pytest.mark.slow
def test_training_worker_that_dies_fails_the_step_clearly(tmp_path):
    with pytest.raises(RunError, match="the training worker died during train_step"):
        train(prepare("configs/quickstart.yaml", [
            f"run.dir={tmp_path}", "run.progress=false", "sft.steps=0", "run.steps=5", "run.eval_size=0",
            "rollout.engine.num_engines=1", "rollout.prompts_per_step=4", "rollout.n_samples=4",
            "loss.name=dying_ppo_clip"], extra_plugins=[("suicidal", SuicidalLoss())]))
    rows = metrics_of(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]  # steps before the death are logged, nothing after
    assert not (tmp_path / "final_model").exists()


@pytest.mark.slow
def test_joins_an_existing_ray_cluster(tmp_path, miles_cli):
    """`ray start --head` on loopback, then `cluster.address=auto`: the same run, nothing else changed."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}  # as docs/ray.md advises
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    subprocess.run([*ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=3",
                    "--include-dashboard=false", "--disable-usage-stats"], env=env, check=True, capture_output=True)
    try:
        result = miles_cli("train", "configs/quickstart.yaml", f"run.dir={tmp_path}", "run.progress=false",
                           "rollout.engine.num_engines=1", "cluster.address=auto", "run.steps=5", "sft.steps=5",
                           "run.eval_size=0", env={"RAY_AUTH_MODE": "disabled"})
    finally:
        subprocess.run([*ray_cli, "stop"], env=env, capture_output=True)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(tmp_path)
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4, 5]
    assert not (tmp_path / "ray").exists()  # the cluster's own temp folder was used, none started here
