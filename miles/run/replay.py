"""``miles replay RUN_DIR``: train on a run's saved rollouts (``run.save_rollouts``) again, without an engine.

The run's ``config.yaml`` (with the given overrides) builds the backend, advantage and loss; the backend starts
from the model the run's RL phase started from (``rollouts/meta.json``) with the run's seed and torch threads,
and each saved step goes through the run's own :class:`~miles.loop.learner.Learner`, with this process's RNG as
that step found it (a distillation run's teacher scores them again). Without overrides, every ``train/*`` metric
of every step equals the original's. Nothing under RUN_DIR changes but the output folder (``RUN_DIR/replay`` by
default).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from miles.config.prepared import prepare
from miles.errors import ConfigError, DataError
from miles.loop.distill import make_teacher
from miles.loop.learner import Learner
from miles.loop.saved_rollouts import groups_of, read_meta, read_step, restore_rng, saved_steps, step_path
from miles.registry import plugin_stack
from miles.run.progress import progress
from miles.run.state import start_loggers
from miles.train.assemble import build_backend, setup_backend

__all__ = ["replay"]

# Keys of the run's config that describe the original run, not the replay (which writes to its own folder).
_FORCED = ("run.resume=false", "run.overwrite=false", "run.save_every=0", "run.save_rollouts=false",
           "run.rollout_only=false")


def _check_source(run_dir: Path) -> tuple[Path, list[int]]:
    if not run_dir.is_dir():
        raise ConfigError(f"miles replay: {str(run_dir)!r} is not a directory; expected a run's directory (run.dir)")
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"miles replay: {str(run_dir)!r} has no config.yaml, so it is not a Miles run directory")
    rollouts = run_dir / "rollouts"
    steps = saved_steps(rollouts)
    if not steps:
        raise ConfigError(f"miles replay: {str(run_dir)!r} has no saved rollouts ({rollouts}/step_*.npz); the run "
                          f"was made without run.save_rollouts=true. Run it again with run.save_rollouts=true")
    expected = list(range(len(steps)))
    if steps != expected:
        missing = next(s for s in range(steps[-1] + 1) if s not in steps)
        raise DataError(f"saved rollouts {step_path(rollouts, missing)}: no such file; steps are trained in order "
                        f"from step 0, and this run saved {len(steps)} steps up to step {steps[-1]}")
    return rollouts, steps


def _out_dir(run_dir: Path, out: str | Path | None, overwrite: bool) -> Path:
    target = Path(out) if out is not None else run_dir / "replay"
    if target.resolve() == run_dir.resolve():
        raise ConfigError(f"miles replay --out {str(target)!r}: that is the run's own directory; the replay writes "
                          f"to a folder of its own (default RUN_DIR/replay)")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"miles replay --out {str(target)!r} is a file; expected a directory")
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise ConfigError(f"miles replay --out {str(target)!r} is not empty; choose another folder with --out, "
                              f"or replace an earlier replay with --overwrite")
        if not (target / "replay.json").is_file():
            raise ConfigError(f"miles replay --overwrite: {str(target)!r} holds no earlier replay (no replay.json); "
                              f"it is left alone, choose another folder with --out")
    return target


def _ray_cluster(p: Any, out: Path, closing: ExitStack) -> Any:
    """How a backend on Ray gets its cluster here: started on first use, with the CPUs the run would reserve."""
    cluster: list[Any] = []

    def start() -> Any:
        if not cluster:
            from miles.cluster import RayCluster
            from miles.run.settings import check_cpus

            cluster.append(RayCluster(p.config.cluster, out, num_cpus=check_cpus(p.config, build_backend(p))))
            closing.callback(cluster[0].shutdown)
        return cluster[0]

    return start


def replay(run_dir: str | Path, overrides: Sequence[str] = (), out: str | Path | None = None,
           steps: int | None = None, overwrite: bool = False, extra_plugins: Sequence[Any] = ()) -> dict[str, Any]:
    """Train on the first ``steps`` (default: all) saved steps of ``run_dir``; metrics go to ``out``'s loggers
    (``metrics.jsonl``), and a summary to ``out/summary.json``, which is returned."""
    started = time.perf_counter()
    run_dir = Path(run_dir)
    rollouts, saved = _check_source(run_dir)
    if steps is not None and not 1 <= steps <= len(saved):
        raise ConfigError(f"miles replay --steps {steps}: expected 1 to {len(saved)} (the steps {run_dir} saved)")
    saved = saved[:steps]
    meta = read_meta(rollouts)
    start_model = run_dir / meta["start_model"]  # an absolute path stays as it is
    if not (start_model / "config.json").is_file():
        raise DataError(f"saved rollouts {rollouts / 'meta.json'}: the run's RL phase started from {start_model}, "
                        f"which is not an HF model directory (any more)")
    out_dir = _out_dir(run_dir, out, overwrite)
    p = prepare(run_dir / "config.yaml", [*overrides, f"run.dir={out_dir}", *_FORCED], extra_plugins=extra_plugins)
    config, run_cfg = p.config, p.config.run
    seed = int(run_cfg.seed)
    if out_dir.is_dir():  # an earlier replay, checked above; replaced once the config is known to be good
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(config))
    (out_dir / "replay.json").write_text(json.dumps({
        "source": str(run_dir.resolve()), "start_model": str(start_model.resolve()), "steps": len(saved),
        "overrides": list(overrides), "plugins": plugin_stack(p.pm, p.registry)}, indent=1))
    torch.manual_seed(seed)
    if run_cfg.torch_threads > 0:
        torch.set_num_threads(run_cfg.torch_threads)
    with ExitStack() as closing:
        loggers = start_loggers(p, out_dir, closing)
        backend = build_backend(p, _ray_cluster(p, out_dir, closing))
        closing.callback(backend.shutdown)
        setup_backend(p, backend, str(start_model), seed)
        # the distillation run's teacher scores the saved samples again, as in the run
        learner = Learner.from_config(p, backend, int(meta["pad_token_id"]),
                                      teacher=make_teacher(config.distill, p, str(start_model), closing))
        setup_s = time.perf_counter() - started
        with progress(len(saved), "replay", run_cfg.progress) as bar:
            for step in saved:
                step_start = time.perf_counter()
                samples, rng = read_step(step_path(rollouts, step))
                restore_rng(rng)  # as the original step found it when it began training
                metrics: dict[str, float] = {}
                learner.learn(step, groups_of(samples), metrics)
                metrics["time/weight_sync_s"] = 0.0  # nothing to push: no engine
                metrics["time/step_s"] = time.perf_counter() - step_start
                p.pm.hook.miles_train_step_end(step=step, metrics=metrics)
                for logger in loggers:
                    logger.log(step, metrics)
                bar.set_postfix(loss=f"{metrics.get('train/loss', float('nan')):.3f}", refresh=False)
                bar.update()
    summary = {"run_dir": str(out_dir), "source": str(run_dir), "steps": len(saved),
               "time_s": {"setup": setup_s, "total": time.perf_counter() - started}}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"Miles replay of {run_dir}: {len(saved)} step(s) trained on the saved rollouts, without an engine\n"
          f"  metrics: {out_dir / 'metrics.jsonl'}", file=sys.stdout)
    return summary
