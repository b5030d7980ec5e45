"""Engines SIGKILLed at random moments of a real run on Ray: every step completes, no sample is lost or
trained twice, and every kill is counted exactly once in ``rollout/engine_failures``.

The kills are drawn from a seeded plan (``MILES_CHAOS_SEED`` changes it). Each episode kills one
engine, while both serve, at the start of a step, while its requests are held in flight, or during
the weight push; some also kill it again during its catch-up or right after its re-admission. The
next episode waits until every kill has been noticed and both engines serve again, so at least one
engine is alive at any time.
"""

import asyncio
import json
import os
import random
import signal
import threading
import time

import pytest

import miles
from miles.errors import RunError
from miles.run.runner import prepare, train

STEPS = 20
PROMPTS, SAMPLES = 4, 4
OVERRIDES = [
    "run.progress=false", "sft.steps=0", f"run.steps={STEPS}", "run.eval_size=0",
    "rollout.engine.num_engines=2", "cluster.num_cpus=3", f"rollout.prompts_per_step={PROMPTS}",
    f"rollout.n_samples={SAMPLES}", "rollout.sampling.max_new_tokens=4", "cluster.router.health_interval_s=0.2",
]


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "reward/mean" in line]


def wait_dead(pid):
    """Until the process is gone (or a zombie): nothing it does can answer after this."""
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except (FileNotFoundError, ProcessLookupError):  # gone, also between the open and the read
            return
        time.sleep(0.01)


async def until(condition, what):
    for _ in range(6000):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"chaos: gave up waiting for {what}")


class Chaos:
    PRIMARY = ("step_start", "generate", "push")
    FOLLOW_UP = ("catch_up", "after_readmit")

    def __init__(self, seed, episodes=4):  # each primary moment once, one more at random; the follow-ups on two
        rng = random.Random(seed)
        steps = sorted(rng.sample(range(1, STEPS - 3), episodes))
        primaries = [*self.PRIMARY, *(rng.choice(self.PRIMARY) for _ in range(episodes - len(self.PRIMARY)))]
        follow_ups = [*self.FOLLOW_UP, *([None] * (episodes - len(self.FOLLOW_UP)))]
        rng.shuffle(primaries)
        rng.shuffle(follow_ups)
        self.plan = {step: (rng.randrange(2), moment, follow_up)
                     for step, moment, follow_up in zip(steps, primaries, follow_ups)}
        self.kills: list[tuple[int, str, int]] = []  # (step, moment, engine)
        self.trained: list[tuple[int, int]] = []  # (group, index) of every trained sample
        self.gates: dict[int, asyncio.Event] = {}
        self.step = -1
        self.push_kill: int | None = None  # engine to kill during this step's push
        self.follow_up: tuple[int, str] | None = None
        self.lock = threading.Lock()

    def kill(self, router, index, moment, pid):
        os.kill(pid, signal.SIGKILL)
        wait_dead(pid)
        with self.lock:
            self.kills.append((self.step, moment, index))

    async def kill_async(self, router, index, moment):
        self.kill(router, index, moment, await router.engines[index].meta["actor"].pid.remote())

    # -- generation: the step's first sample plans the step, the others wait for it -----------------

    @miles.hookimpl
    def miles_register_rollout_fns(self, register):
        from miles.rollout.single_turn import single_turn

        async def chaos_single_turn(sample, ctx):
            step = sample.group_index // PROMPTS
            gate = self.gates.setdefault(step, asyncio.Event())
            if sample.group_index % PROMPTS == 0 and sample.index == 0:
                await self.start_step(step, ctx.engine)
                gate.set()
            await gate.wait()
            return await single_turn(sample, ctx)

        register("chaos_single_turn", chaos_single_turn)

    async def start_step(self, step, router):
        self.step = step
        # Every kill so far noticed, and both engines back: only then the next kill.
        settled = lambda: (router.stats["engine_failures"] >= len(self.kills)  # noqa: E731
                           and not any(e.quarantined for e in router.engines))
        await until(settled, f"every kill noticed and both engines in service at step {step}")
        if step not in self.plan:
            return
        index, moment, follow_up = self.plan[step]
        self.follow_up = (index, follow_up) if follow_up else None
        if moment == "step_start":
            await self.kill_async(router, index, moment)
        elif moment == "generate":  # its requests stay in flight until it dies
            target = router.engines[index]
            await router.post(target, "/pause_generation", {})

            async def kill_when_busy():
                await until(lambda: target.outstanding > 0, "a request in flight on the paused engine")
                await self.kill_async(router, index, moment)

            asyncio.ensure_future(kill_when_busy())
        else:
            self.push_kill = index

    # -- the weight push and catch-up ------------------------------------------------------------------

    @miles.hookimpl
    def miles_register_weight_transports(self, register):
        register("chaos_tensor", lambda: ChaosTransport(self))

    @miles.hookimpl
    def miles_rollout_end(self, step, groups):
        self.trained += [(s.group_index, s.index) for g in groups for s in g.trainable_samples]


class ChaosTransport:
    """The tensor transport, with kills during the push, during a catch-up and right after one."""

    def __init__(self, chaos):
        from miles.weights.transports import TensorTransport

        self.chaos, self.inner = chaos, TensorTransport()

    def push(self, backend, plane, version):
        import ray

        index, self.chaos.push_kill = self.chaos.push_kill, None
        if index is None:
            return self.inner.push(backend, plane, version)
        pid = ray.get(plane.router.engines[index].meta["actor"].pid.remote())
        killer = threading.Thread(target=self.chaos.kill, args=(plane.router, index, "push", pid))
        killer.start()  # lands before, during or after the posts
        try:
            return self.inner.push(backend, plane, version)
        finally:
            killer.join()

    async def catch_up(self, plane, engine):
        router, chaos = plane.router, self.chaos
        index = router.engines.index(engine)
        follow_up = None
        if chaos.follow_up and chaos.follow_up[0] == index:
            follow_up, chaos.follow_up = chaos.follow_up[1], None
        if follow_up == "catch_up":
            await chaos.kill_async(router, index, "catch_up")
        await self.inner.catch_up(plane, engine)
        if follow_up == "after_readmit":
            await chaos.kill_async(router, index, "after_readmit")


@pytest.mark.slow
def test_engines_killed_at_random_moments_lose_nothing(tmp_path):
    seed = int(os.environ.get("MILES_CHAOS_SEED", "0"))
    chaos = Chaos(seed)
    train(prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path}", *OVERRIDES, "rollout.fn.name=chaos_single_turn", "rollout.weight_sync.name=chaos_tensor",
    ], extra_plugins=[("chaos", chaos)]))
    rows = metrics_of(tmp_path)
    print(f"seed {seed}: {len(chaos.kills)} kills (step, moment, engine): {chaos.kills}")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["samples/total"] == r["train/samples"] == PROMPTS * SAMPLES and r["samples/failed"] == 0 for r in rows)
    assert len(chaos.trained) == len(set(chaos.trained)) == STEPS * PROMPTS * SAMPLES  # each sample trained once
    assert {moment for _, moment, _ in chaos.kills} == {*Chaos.PRIMARY, *Chaos.FOLLOW_UP}
    assert sum(r["rollout/engine_failures"] for r in rows) == len(chaos.kills) >= 6
    assert [r["weight_version"] for r in rows] == list(range(1, STEPS + 1))


class Annihilation:
    """Kills both engines for good (no restart) at the start of step 2."""

    @miles.hookimpl
    def miles_register_rollout_fns(self, register):
        from miles.rollout.single_turn import single_turn

        async def doomed_single_turn(sample, ctx):
            if sample.group_index == 2 * PROMPTS and sample.index == 0:
                import ray

                for engine in ctx.engine.engines:
                    ray.kill(engine.meta["actor"], no_restart=True)
            return await single_turn(sample, ctx)

        register("doomed_single_turn", doomed_single_turn)


@pytest.mark.slow
@pytest.mark.parametrize("max_failed_frac", [0.5, 1.0])  # 1.0: the step's failed samples alone do not stop the run
def test_no_engine_left_fails_the_run_naming_the_engines(tmp_path, max_failed_frac):
    with pytest.raises(RunError, match="no engine left: all 2 failed and none can come back") as err:
        train(prepare("configs/quickstart.yaml", [
            f"run.dir={tmp_path}", *OVERRIDES, "run.steps=5", "rollout.fn.name=doomed_single_turn",
            f"run.max_failed_frac={max_failed_frac}",
        ], extra_plugins=[("doomed", Annihilation())]))
    assert str(err.value).startswith("no engine left")  # said as it is, not as the step's failed samples
    assert "engine 0 (http://127.0.0.1:" in str(err.value) and "engine 1 (http://127.0.0.1:" in str(err.value)
    assert [r["step"] for r in metrics_of(tmp_path)] == [0, 1]
