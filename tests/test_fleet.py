"""An elastic fleet on a real local Ray instance: `miles fleet RUN_DIR --engines N` during a run makes engine actors
join (caught up with the current weights before they serve) and leave (drained) between steps, at seeded random
steps, and nothing is lost or trained twice; the run learns as a run with a fixed fleet does."""

import json
import random
from statistics import fmean

import pytest

import miles
from miles.cli import main
from miles.run.runner import prepare, train

STEPS = 100
COMMON = ["run.progress=false", "run.eval_size=0", "sft.steps=20", f"run.steps={STEPS}",
          "rollout.engine.num_engines=1", "cluster.router.health_interval_s=0.2",
          "cluster.num_cpus=4"]


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "reward/mean" in line]


class FleetPlan:
    """After the steps of ``plan``, asks the run for another number of engines with `miles fleet` (read before the
    next step); records the weight version of every token each engine's answers carried."""

    def __init__(self, run_dir, plan):
        self.run_dir, self.plan = run_dir, plan
        self.trained: list[tuple[int, int]] = []

    @miles.hookimpl
    def miles_train_step_end(self, step, metrics):
        if step in self.plan:
            assert main(["fleet", str(self.run_dir), "--engines", str(self.plan[step])]) == 0

    @miles.hookimpl
    def miles_rollout_end(self, step, groups):
        self.trained += [(g.index, s.index) for g in groups for s in g.samples]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0])
def test_engines_join_and_leave_a_running_run_at_random_steps_and_nothing_is_lost(tmp_path, seed):
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(2, STEPS - 4), 8))
    plan = dict(zip(steps, [*(rng.choice([2, 3]) if i % 2 == 0 else 1 for i in range(7)), 1]))
    elastic = FleetPlan(tmp_path / "elastic", plan)
    train(prepare("configs/quickstart.yaml", [f"run.dir={tmp_path / 'elastic'}", *COMMON],
                  extra_plugins=[("fleet_plan", elastic)]))
    train(prepare("configs/quickstart.yaml", [f"run.dir={tmp_path / 'fixed'}", *COMMON]))
    rows, fixed = metrics_of(tmp_path / "elastic"), metrics_of(tmp_path / "fixed")
    print("plan", plan, "engines in service", [r["rollout/engines_in_service"] for r in rows])
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["samples/total"] == r["train/samples"] == 128 and r["samples/failed"] == 0 for r in rows)
    assert len(elastic.trained) == len(set(elastic.trained)) == STEPS * 128  # each sample generated and trained once
    assert [r["weight_version"] for r in rows] == list(range(1, STEPS + 1))  # every push reached the fleet
    failures = {r["step"]: r["rollout/engine_failures"] for r in rows if r["rollout/engine_failures"]}
    assert not failures, f"engine failures at steps {failures} with the plan {plan}"
    in_service = [r["rollout/engines_in_service"] for r in rows]
    assert max(in_service) == max(plan.values()) and in_service[-1] == 1  # they joined (served once caught up), left
    sizes = [1, *plan.values()]
    joins = sum(max(0, new - old) for old, new in zip(sizes, sizes[1:]))
    assert sum(r["rollout/readmissions"] for r in rows) == joins  # each engine that joined was caught up first
    # the same learning as a fixed fleet (the samples differ: each engine draws from its own generator)
    assert fmean(r["reward/mean"] for r in rows[-10:]) == pytest.approx(fmean(r["reward/mean"] for r in fixed[-10:]),
                                                                        abs=0.1)


@pytest.mark.parametrize("config, why", [
    (None, "is not a Miles run directory (it has no config.yaml)"),
    ("rollout: {engine: {num_engines: 0}}", "has its engine in process (rollout.engine.num_engines=0)"),
    ("rollout: {engine: {num_engines: 2}}\ncluster: {local_mode: true}", "num_engines=2, cluster.local_mode"),
])
def test_a_fleet_request_a_run_cannot_follow_is_refused_with_exit_code_2(tmp_path, capsys, config, why):
    if config is not None:
        (tmp_path / "config.yaml").write_text(config)
    assert main(["fleet", str(tmp_path), "--engines", "2"]) == 2
    assert why in capsys.readouterr().err and not (tmp_path / "fleet.json").exists()


def test_a_fleet_of_no_engines_is_refused_with_exit_code_2(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("rollout: {engine: {num_engines: 2}}")
    assert main(["fleet", str(tmp_path), "--engines", "0"]) == 2
    assert "--engines must be at least 1" in capsys.readouterr().err and not (tmp_path / "fleet.json").exists()
