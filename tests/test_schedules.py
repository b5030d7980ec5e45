"""run.schedule one_step_off and async: the stream of groups beside the trainer (miles/loop/schedules.py), on
a real in-process engine with a worker thread, and on Ray engines in processes of their own."""

import asyncio
import json
import random
import threading
import time

import pytest

import miles
from miles.engine.local import LocalEngine
from miles.errors import ConfigError
from miles.run.runner import prepare, train
from miles.types import Sample

QUICK = ["sft.steps=20", "run.eval_size=0", "rollout.prompts_per_step=4", "rollout.n_samples=4", "run.progress=false"]


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "reward/mean" in line]


# The router's own figures: a streaming schedule serves its engine from a process of its own, through a router
ROUTER_KEYS = {"rollout/engine_failures", "rollout/engines_in_service", "rollout/readmissions", "rollout/retries",
               "rollout/engines_lost_with_node"}


def comparable(row):
    """What a run computes, without wall times, the stream's own figures and the router's."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "async/")) and "per_s" not in k
            and k != "selection/rounds" and k not in ROUTER_KEYS and v == v}


@pytest.mark.parametrize("override, message", [
    ("run.schedule=later", "run.schedule: expected sync, one_step_off or async, got 'later'"),
    ("rollout.async.stale=keep", "rollout.async.stale: expected drop or retry"),
    ("rollout.async.update=swap", "rollout.async.update: expected pause, abort or in_place"),
    ("rollout.async.max_staleness=-1", "rollout.async.max_staleness: expected a whole number >= 0"),
])
def test_bad_schedule_settings_name_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        prepare("configs/quickstart.yaml", [f"run.dir={tmp_path}", "run.schedule=async", override])


def test_settings_that_contradict_the_schedule_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="rollout.partial_rollout: with run.schedule async, samples are aborted"):
        prepare("configs/quickstart.yaml", ["run.schedule=async", "rollout.partial_rollout=true",
                                            "rollout.async.update=pause"])
    with pytest.raises(ConfigError,
                       match=r"max_concurrent_samples: expected 0 or at least one group \(rollout.n_samples=8\)"):
        prepare("configs/quickstart.yaml", ["run.schedule=async", "rollout.async.max_concurrent_samples=4"])
    with pytest.raises(ConfigError, match="one_step_off generates a whole step at once"):
        prepare("configs/quickstart.yaml", ["run.schedule=one_step_off", "rollout.async.max_concurrent_samples=16"])


def test_async_with_staleness_0_is_the_synchronous_run(tmp_path, capfd):
    """The quickstart as it is (16 prompts x 8 samples a step): with max_staleness 0 nothing may generate while
    the trainer trains, so the run is the sync schedule: every metric and the final weights, bit for bit."""
    runs = {}
    for schedule in ("sync", "async"):
        train(prepare("configs/quickstart.yaml", [f"run.dir={tmp_path / schedule}", "run.progress=false",
                                                  "run.steps=4", f"run.schedule={schedule}",
                                                  "rollout.async.max_staleness=0"]))
        runs[schedule] = [{k: v for k, v in r.items() if not k.startswith("time/") and "per_s" not in k}
                          for r in metrics_of(tmp_path / schedule)]
    assert len(runs["sync"]) == 4
    assert runs["async"] == runs["sync"]
    weights = [(tmp_path / s / "final_model" / "model.safetensors").read_bytes() for s in ("sync", "async")]
    assert weights[0] == weights[1]
    said = capfd.readouterr().err
    assert "max_staleness=0: no generation can overlap training, so the run is the sync schedule" in said
    # with a cap on the samples generating at once, the stream runs (capped), and says how stale its groups were
    train(prepare("configs/quickstart.yaml", [f"run.dir={tmp_path / 'capped'}", *QUICK, "run.steps=2",
                                              "run.schedule=async", "rollout.async.max_staleness=0",
                                              "rollout.async.max_concurrent_samples=8"]))
    assert [r["async/staleness_max"] for r in metrics_of(tmp_path / "capped")] == [0, 0]


class Tagged:
    """An engine whose requests carry the request id ``rid`` (None: the engine's own)."""

    def __init__(self, engine, rid):
        self.engine, self.rid = engine, rid

    async def generate(self, *args, **kwargs):
        return await self.engine.generate(*args, rid=self.rid, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def hold_after_two_tokens(monkeypatch, recorder):
    """The batcher pauses itself, in its own thread between two steps, as soon as a request of the second batch
    holds 2 tokens (no other thread races it), and tells ``recorder``."""
    from miles.engine.batcher import ContinuousBatcher

    iteration = ContinuousBatcher._iteration

    def then_hold(self):
        iteration(self)
        if not recorder.second_batch_held.is_set() and any(
                str(r.rid).startswith("second") and len(r.output_ids) >= 2 for r in self._rows):
            self.pause()
            recorder.second_batch_held.set()

    monkeypatch.setattr(ContinuousBatcher, "_iteration", then_hold)


class Recorder:
    """Records what each step trains; with ``seed``, rollouts and training take random times."""

    def __init__(self, seed=None, hold_second_batch=False):
        self.rng = random.Random(seed)
        self.seeded = seed is not None
        self.trained = []  # per step: [(group index, row, [start versions], [weight_versions], off-policy tokens)]
        self.metrics = []
        self.batch_rewards = []  # per step: the mean reward of the batch trained
        self.engine = None
        self.hold_second_batch = hold_second_batch
        self.second_batch_held = threading.Event()

    @miles.hookimpl
    def miles_register_rollout_fns(self, register):
        from miles.rollout.single_turn import single_turn

        async def jittery_single_turn(sample, ctx):
            self.engine = getattr(ctx.engine, "engine", ctx.engine)
            if self.seeded:
                await asyncio.sleep(self.rng.random() * 0.02)  # generation times vary
            return await single_turn(sample, ctx)

        async def long_single_turn(sample, ctx):  # 24 tokens, EOS ignored: always in flight for a while
            self.engine = getattr(ctx.engine, "engine", ctx.engine)
            params = {**ctx.sampling_params, "max_new_tokens": 24, "ignore_eos": True}
            from dataclasses import replace
            engine = Tagged(ctx.engine, f"second-{sample.group_index}-{sample.index}" if sample.group_index >= 4
                            else None)  # the second batch's requests, as the batcher sees them
            return await single_turn(sample, replace(ctx, sampling_params=params, engine=engine))

        register("jittery_single_turn", jittery_single_turn)
        register("long_single_turn", long_single_turn)

    @miles.hookimpl
    def miles_rollout_end(self, step, groups):
        rewards = [r for g in groups for r in g.rewards]
        self.batch_rewards.append(sum(rewards) / len(rewards) if rewards else None)
        self.trained.append([(g.index, g.samples[0].metadata["row"], [s.start_version for s in g.samples],
                              [list(s.weight_versions) for s in g.samples], [s.off_policy_tokens for s in g.samples])
                             for g in groups])
        if self.seeded:
            time.sleep(self.rng.random() * 0.03)  # so do training times
        if self.hold_second_batch and step == 0:
            # The next batch is generating: the engine pauses itself (hold_after_two_tokens) once some of its
            # requests hold 2 tokens, so that the weight update after this step lands in the middle of their
            # generation, whatever the timing. The update waits for that.
            assert self.second_batch_held.wait(60), "the second batch never started generating"

    @miles.hookimpl
    def miles_train_step_end(self, step, metrics):
        self.metrics.append(metrics)
        if self.hold_second_batch and step == 0:
            deadline = time.monotonic() + 60  # the push runs in a thread of its own: let it land first
            while self.engine.weight_version < 1:
                assert time.monotonic() < deadline, "the weights of step 0 never reached the engine"
                time.sleep(0.001)
            self.engine.resume()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_staleness_never_exceeds_the_bound_and_every_group_is_accounted_for(tmp_path, seed):
    rng = random.Random(seed)
    k, update, stale, schedule = (rng.choice([0, 1, 2]), rng.choice(["pause", "abort", "in_place"]),
                                  rng.choice(["drop", "retry"]), rng.choice(["async", "async", "one_step_off"]))
    if schedule == "one_step_off":
        k = 1
    # max_staleness 0 runs as sync unless the stream is capped: capped at a whole step, it is the stream at k=0
    cap = ["rollout.async.max_concurrent_samples=16"] if k == 0 else []
    recorder = Recorder(seed=seed)
    steps = 8
    train(prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path}", *QUICK, f"run.steps={steps}", f"run.schedule={schedule}",
        "rollout.fn.name=jittery_single_turn",
        f"rollout.async.max_staleness={k}", f"rollout.async.update={update}", f"rollout.async.stale={stale}",
        "rollout.sampling.max_new_tokens=6", *cap], extra_plugins=[("recorder", recorder)]))
    where = f"schedule={schedule} k={k} update={update} stale={stale}"
    assert len(recorder.trained) == steps
    indices = [g[0] for step in recorder.trained for g in step]
    assert len(indices) == len(set(indices)) == steps * 4, where  # each group trained once, every step a full batch
    for step, groups in enumerate(recorder.trained):  # the trainer holds version `step` (a fresh run)
        for _, _, starts, versions, _ in groups:
            assert all(step - start <= k for start in starts), (where, step, starts)
            if update == "pause":  # requests finish on the weights they started on
                assert all(len(set(v)) == 1 for v in versions), (where, versions)
    admitted_so_far = 0
    trained = removed = stale_count = 0
    for m in recorder.metrics:
        trained += m["selection/groups_kept"]
        removed += m["selection/groups_removed"]
        stale_count += m["async/stale_dropped"] + m["async/stale_retried"]
        assert m["async/groups_admitted"] >= admitted_so_far
        admitted_so_far = m["async/groups_admitted"]
        # nothing lost, nothing counted twice: every admitted group is trained, removed, stale, or still coming
        assert m["async/groups_admitted"] == (trained + removed + stale_count + m["async/in_flight_groups"]
                                              + m["async/buffer_groups"]), (where, m)
        assert m["async/staleness_max"] <= k
    # reward/mean is the trained batch's, on every step (also one where no sample finished since the last batch)
    assert [m["reward/mean"] for m in recorder.metrics] == pytest.approx(recorder.batch_rewards), where
    assert all(m["reward/finished_mean"] == m["reward/finished_mean"] or m["samples/total"] == 0
               for m in recorder.metrics), where


class LatePush:
    """Holds the push of step 0's weights until the trainer has taken step 1's batch: the moment one_step_off
    would admit step 2's prompts, whatever the timing."""

    def __init__(self):
        self.taken = threading.Event()

    @miles.hookimpl
    def miles_rollout_end(self, step, groups):
        if step == 1:
            self.taken.set()


@pytest.mark.parametrize("update", ["pause", "in_place"])
def test_one_step_off_waits_for_the_last_push_before_the_next_step(tmp_path, monkeypatch, update):
    """one_step_off admits a step's prompts when the trainer takes the last batch, but not before the engines hold
    the weights that trainer had: generated on older ones, they would be two versions old when trained (dropped)."""
    from miles.loop.schedules import StreamSchedule

    late, push = LatePush(), StreamSchedule._push

    def held_push(self, step, backend):
        if step == 0:
            assert late.taken.wait(120), "the trainer never took step 1's batch"
        push(self, step, backend)

    monkeypatch.setattr(StreamSchedule, "_push", held_push)
    train(prepare("configs/quickstart.yaml", [f"run.dir={tmp_path}", *QUICK, "run.steps=4", "run.schedule=one_step_off",
                                              f"rollout.async.update={update}", "backend.separate_process=false"],
                  extra_plugins=[("late", late)]))
    rows = metrics_of(tmp_path)
    assert [r["async/stale_dropped"] for r in rows] == [0, 0, 0, 0]
    # step 1's batch was generated on version 0 while the push was held; later batches are one version old or,
    # when a loaded machine let the push land before their generation began, current: never two
    staleness = [r["async/staleness_max"] for r in rows]
    assert staleness[:2] == [0, 1] and max(staleness) == 1
    assert all(r["train/samples"] == 16 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("update", ["abort", "in_place"])
def test_an_update_that_lands_mid_generation_keeps_each_token_s_version(tmp_path, monkeypatch, update):
    recorder = Recorder(hold_second_batch=True)
    hold_after_two_tokens(monkeypatch, recorder)
    train(prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path}", *QUICK, "run.steps=3", "run.schedule=one_step_off", "rollout.fn.name=long_single_turn",
        f"rollout.async.update={update}", "rollout.mask_off_policy=true",
        "rollout.engine.separate_process=false"],  # the recorder holds the engine itself: in this process
        extra_plugins=[("recorder", recorder)]))
    second = recorder.trained[1]  # generated while step 0 trained; the update to version 1 landed in it
    mixed = [(versions, off) for g in second for versions, off in zip(g[3], g[4]) if len(set(versions)) > 1]
    assert mixed, second
    for versions, off_policy in mixed:
        assert versions[0] == 0 and versions[-1] == 1  # started on version 0, finished on version 1
        assert 2 <= off_policy < 24  # the tokens version 0 sampled, before the update
    assert (recorder.metrics[1]["rollout/off_policy_token_frac"] > 0
            if "rollout/off_policy_token_frac" in recorder.metrics[1] else True)


def test_record_versions_marks_the_tokens_of_older_versions_off_policy():
    sample = Sample(prompt_ids=[1])
    sample.append([5, 6, 7], [-1.0] * 3, from_policy=True)
    sample.record_versions(0, {"weight_version": 3, "output_token_weight_versions": [2, 2, 3]})
    assert sample.weight_versions == [2, 3] and sample.off_policy_tokens == 2 and sample.start_version == 2
    sample.append([8, 9], None, from_policy=False)  # a tool's answer
    sample.append([10], [-1.0], from_policy=True)
    sample.record_versions(5, {"weight_version": 4})  # the next turn, on version 4: everything before is older
    assert sample.weight_versions == [2, 3, 4] and sample.off_policy_tokens == 5
    sample.mask_off_policy()
    assert sample.loss_mask == [0, 0, 0, 0, 0, 1]


def test_in_place_update_lands_between_two_decode_steps(tiny_model_dir):
    engine = LocalEngine(background=True, seed=0)
    engine.load_model(str(tiny_model_dir))
    try:
        async def run():
            task = asyncio.ensure_future(engine.generate([4, 13, 5, 14], {"max_new_tokens": 12, "ignore_eos": True}))
            while not any(len(r.output_ids) >= 3 for r in list(engine.batcher._rows)):
                await asyncio.sleep(0.001)
            engine.pause()  # a step under way finishes; none starts
            new = {k: v + 0.01 for k, v in engine.model.state_dict().items()}
            await asyncio.get_running_loop().run_in_executor(None, engine.update_weights, new, 1)  # between two steps
            held = len(engine.batcher._rows[0].output_ids)  # sampled by version 0
            engine.resume()
            return held, await task

        held, answer = asyncio.run(run())
    finally:
        engine.close()
    versions = answer["meta_info"]["output_token_weight_versions"]
    assert versions == [0] * held + [1] * (12 - held)
    assert answer["meta_info"]["weight_version"] == 1


@pytest.mark.slow
def test_async_run_resumes_from_its_checkpoint(tmp_path):
    """The prompts in flight and buffered when the checkpoint was written are saved as ``data_requeued`` and
    generated again first after the resume: nothing admitted before the checkpoint is lost."""
    from collections import Counter

    from miles.run.checkpoint import latest_checkpoint

    args = [f"run.dir={tmp_path}", *QUICK, "run.schedule=async", "rollout.async.max_staleness=1", "run.save_every=2"]
    train(prepare("configs/quickstart.yaml", [*args, "run.steps=4"], extra_plugins=[("recorder", Recorder())]))
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    assert ckpt is not None and ckpt.step == 4
    requeued = ckpt.loop_state()["data_requeued"]
    assert requeued, "the stream had nothing in flight or buffered at the checkpoint"
    assert len(requeued) <= 8  # (max_staleness + 1) x prompts_per_step: the stream's bound

    resumed = Recorder()
    train(prepare("configs/quickstart.yaml", [*args, "run.steps=10", "run.resume=true", "rollout.async.stale=retry"],
                  extra_plugins=[("recorder", resumed)]))
    assert [r["step"] for r in metrics_of(tmp_path)] == list(range(10))
    trained = [g for step in resumed.trained for g in step]
    assert len({g[0] for g in trained}) == len(trained) == 6 * 4  # steps 4 to 9, each group once
    # Every requeued prompt was generated again and trained (a stale one is retried, never lost), and the
    # first batch after the resume comes from them: they were admitted before anything new.
    rows = Counter(g[1] for g in trained)
    assert all(rows[row] >= n for row, n in Counter(p.index for p in requeued).items()), (rows, requeued)
    first, again = Counter(g[1] for g in resumed.trained[0]), Counter(p.index for p in requeued)
    assert (first <= again) if len(requeued) >= 4 else (again <= first), (first, again)


@pytest.mark.slow
def test_async_quickstart_learns(tmp_path):
    started = time.perf_counter()
    summary = train(prepare("configs/quickstart.yaml", [f"run.dir={tmp_path}", "run.progress=false",
                                                        "run.schedule=async"]))
    assert summary["reward_end"] - summary["reward_start"] >= 0.25 and summary["reward_end"] >= 0.5, summary
    rows = metrics_of(tmp_path)
    assert [r["step"] for r in rows] == list(range(200))
    assert all(r["async/staleness_max"] <= 1 and r["samples/failed"] == 0 for r in rows)
    print(f"async quickstart: {time.perf_counter() - started:.1f} s")


@pytest.mark.slow  # starts Ray: the example puts the engine in a process of its own
def test_async_docs_example_trains(tmp_path):
    """The YAML example of docs/async.md, over the quickstart, for 2 steps."""
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parent.parent / "docs" / "async.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]

    def dotted(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from dotted(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}={value}"

    overrides = list(dotted(yaml.safe_load(block)))
    assert "run.schedule=async" in overrides
    train(prepare("configs/quickstart.yaml", [*overrides, f"run.dir={tmp_path}", *QUICK, "sft.steps=0",
                                              "run.steps=2"]))
    rows = metrics_of(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["async/staleness_max"] <= 1 and r["samples/failed"] == 0 for r in rows)
    assert [r["weight_version"] for r in rows] == [1, 2]
