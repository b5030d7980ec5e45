"""run.schedule async on a real local Ray instance: an engine killed while the stream runs, and a trainer that
fails while the stream runs (see tests/test_ray_plane.py for the same faults under run.schedule sync)."""

import asyncio
import json
import os
import random
import signal

import pytest

import miles
from miles.run.runner import prepare, train


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "reward/mean" in line]


def ray_processes_of(run_dir):
    """Every process that uses this run's Ray temp folder (Ray's daemons and agents, the actors)."""
    from miles._ray_reaper import processes_using
    from miles.cluster import RayCluster

    return processes_using(str(RayCluster.temp_dir_for(run_dir)))


def assert_accounted(rows):
    """Every admitted group is trained, removed, stale, in flight or buffered, on every step."""
    trained = removed = stale = 0
    for m in rows:
        trained += m["selection/groups_kept"]
        removed += m["selection/groups_removed"]
        stale += m["async/stale_dropped"] + m["async/stale_retried"]
        assert m["async/groups_admitted"] == (trained + removed + stale + m["async/in_flight_groups"]
                                              + m["async/buffer_groups"]), m


class StreamEngineKiller:
    """A rollout function that, at a seeded random moment of the stream (after a random number of requests of a
    random step in [1, 3]), holds engine 0's requests with /pause_generation and SIGKILLs its process 0-0.3 s
    later; it also records what each step trains."""

    def __init__(self, seed, prompts_per_step, n_samples):
        rng = random.Random(seed)
        per_step = prompts_per_step * n_samples
        self.kill_after = rng.randint(1, 3) * per_step + rng.randrange(per_step)  # requests before the kill
        self.delay = rng.random() * 0.3
        self.requests = 0
        self.report = {}
        self.trained = []

    @miles.hookimpl
    def miles_register_rollout_fns(self, register):
        from miles.rollout.single_turn import single_turn

        async def killing_single_turn(sample, ctx):
            router = getattr(ctx.engine, "engine", ctx.engine)  # the stream's gate wraps the router
            self.requests += 1
            if self.requests == self.kill_after:
                await router.post(router.engines[0], "/pause_generation", {})  # hold its requests in flight
                asyncio.get_running_loop().call_later(self.delay, self.kill, router)
            return await single_turn(sample, ctx)

        register("killing_single_turn", killing_single_turn)

    def kill(self, router):
        import ray

        self.report["killed_pid"] = ray.get(router.engines[0].meta["actor"].pid.remote())
        os.kill(self.report["killed_pid"], signal.SIGKILL)

    @miles.hookimpl
    def miles_rollout_end(self, step, groups):
        self.trained.append([g.index for g in groups])


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_engine_killed_mid_stream_loses_nothing(tmp_path, seed):
    steps, prompts, n = 6, 4, 4
    killer = StreamEngineKiller(seed, prompts, n)
    train(prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path}", "run.progress=false", "sft.steps=20", f"run.steps={steps}", "run.eval_size=0",
        "run.schedule=async", "rollout.engine.num_engines=2", f"rollout.prompts_per_step={prompts}",
        f"rollout.n_samples={n}", "rollout.fn.name=killing_single_turn", "rollout.sampling.max_new_tokens=4",
        "cluster.router.health_interval_s=0.2", "cluster.num_cpus=3",
    ], extra_plugins=[("killer", killer)]))
    rows = metrics_of(tmp_path)
    where = f"seed={seed} kill_after={killer.kill_after} delay={killer.delay:.2f}"
    assert killer.report.get("killed_pid", 0) > 0, where
    assert [r["step"] for r in rows] == list(range(steps)), where
    assert all(r["samples/failed"] == 0 and r["train/samples"] == prompts * n for r in rows), where
    indices = [i for step in killer.trained for i in step]
    assert len(killer.trained) == steps and len(indices) == len(set(indices)) == steps * prompts, where
    assert_accounted(rows)
    assert sum(r["rollout/engine_failures"] for r in rows) == 1, where
    assert [r["weight_version"] for r in rows] == list(range(1, steps + 1)), where


class FailingLoss:
    """A loss that raises once the driver has started step 2 (a marker file: the loss may run in the driver or
    in a Ray actor)."""

    def __init__(self, marker):
        self.marker = str(marker)

    @miles.hookimpl
    def miles_register_losses(self, register):
        from miles.train.losses import ppo_clip

        marker = self.marker

        def failing_ppo_clip(inputs):
            if os.path.exists(marker):
                raise RuntimeError("the loss failed on purpose at step 2")
            return ppo_clip(inputs)

        register("failing_ppo_clip", failing_ppo_clip)

    @miles.hookimpl
    def miles_rollout_end(self, step, groups):
        if step == 2:
            open(self.marker, "w").close()


@pytest.mark.slow
def test_trainer_failure_stops_the_stream_cleanly(tmp_path):
    from miles.run.checkpoint import damage, latest_checkpoint

    run_dir = tmp_path / "run"
    with pytest.raises(Exception, match="the loss failed on purpose at step 2"):
        train(prepare("configs/quickstart.yaml", [
            f"run.dir={run_dir}", "run.progress=false", "sft.steps=0", "run.steps=5", "run.eval_size=0",
            "run.schedule=async", "rollout.engine.num_engines=1", "rollout.prompts_per_step=4", "rollout.n_samples=4",
            "run.save_every=1", "loss.name=failing_ppo_clip"],
            extra_plugins=[("failing", FailingLoss(tmp_path / "step2"))]))
    assert [r["step"] for r in metrics_of(run_dir)] == [0, 1]  # steps before the failure are logged, nothing after
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None and ckpt.step == 2  # written after step 1, the last step that finished
    assert damage(ckpt) is None
    assert ckpt.loop_state()["data_position"] >= 0
    assert not (run_dir / "final_model").exists()
    assert ray_processes_of(run_dir) == []  # the run's end waited for its reaper
