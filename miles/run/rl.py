"""The RL phase: the planes assembled, the steps of the configured schedule, evaluations before, during and
after, checkpoints every ``run.save_every`` steps, and the exported final policy."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from statistics import fmean
from typing import Any

from miles.config.validate import component_node, split_node
from miles.hookspecs import ClosingTransport
from miles.loop.distill import make_teacher
from miles.loop.evaluation import evaluate, evaluate_sets
from miles.loop.learner import Learner
from miles.loop.saved_rollouts import RolloutWriter
from miles.loop.trajectories import TrajectoryWriter
from miles.loop.schedules import make_schedule, stream_settings
from miles.engine.speculative import SpeculativeConfig
from miles.loop.draft import DraftLearner
from miles.loop.step import Step
from miles.precision.checkpoint import planned_layers, write_stored_form
from miles.rollout.assemble import close_with_run, rollout_context, rollout_plane
from miles.rollout.collect import GroupCollector
from miles.rollout.data_source import PromptSource
from miles.run.checkpoint import model_signature, remove_partial_checkpoints, save_checkpoint
from miles.run.progress import phase, progress
from miles.run.state import RunState, frozen_heap, rewind_loggers
from miles.train.assemble import rl_backend
from miles.train.process_backend import separate_trainer
from miles.train.torch_backend import rng_state, set_rng_state
from miles.weights.precision import StoredFormPush

__all__ = ["RLPhase"]



def draft_learner(engine_args: dict, model_path: str, seed: int) -> DraftLearner | None:
    """The learner of the engines' speculative draft when ``rollout.engine.speculative.train`` is true."""
    spec = engine_args.get("speculative")
    if not spec or not (config := SpeculativeConfig.parse(dict(spec))).train:
        return None
    return DraftLearner(config, model_path, seed, lr=float(config.lr), window=config.train_window)

class RLPhase:
    """Built on the model in ``model_path``: the weight transport, the rollout plane, the backend, the learner
    and the step's parts; :meth:`run` trains and returns the exported final policy."""

    def __init__(self, run: RunState, model_path: str) -> None:
        p, config = run.p, run.p.config
        run_cfg = config.run
        start = time.perf_counter()
        self.run, self.model_path = run, model_path
        self._remove_partial_checkpoints()
        self.transport = p.build("weight_transport", "rollout.weight_sync")
        if (scheme := p.build("precision", "rollout.precision")) is not None:  # the engines hold a stored form
            self.transport = StoredFormPush(self.transport, scheme, planned_layers(model_path, scheme))
        if isinstance(self.transport, ClosingTransport):  # e.g. shm's file under /dev/shm
            run.closing.callback(self.transport.close)
        self.plane = plane = rollout_plane(p, model_path, self.transport, run.ray_cluster, run.closing,
                                           trainer_apart=not run_cfg.rollout_only and separate_trainer(config,
                                                                                                       p.registry))
        # engines as Ray actors (not the one engine a child process serves: rollout.engine.separate_process)
        on_ray = plane.remote and split_node(config.rollout.engine, "rollout.engine")[1]["num_engines"] > 0
        self.backend = None if run_cfg.rollout_only else rl_backend(p, run.ray_cluster, run.closing, model_path,
                                                                    run.seed, remote=on_ray,
                                                                    process=run.trainer_process)
        self.ctx = rollout_context(p, plane, run.tokenizer, model_path, run.chat_format, run.seed, run.run_dir.name,
                                   run.closing, return_routed_experts=config.rollout.return_routed_experts)
        writer = RolloutWriter(run.run_dir, model_path, run.pad_token_id) if run_cfg.save_rollouts else None
        shown = TrajectoryWriter(run.run_dir, run.tokenizer, run_cfg.trajectories) if run_cfg.trajectories else None
        learner = Learner.from_config(p, self.backend, run.pad_token_id, save_rollouts=writer, trajectories=shown,
                                      teacher=make_teacher(config.distill, p, model_path, run.closing))
        selectors = [(component_node(n)["name"],
                      p.registry.build("data_selector", component_node(n), f"selection[{i}]"))
                     for i, n in enumerate(config.selection)]
        self.c = Step(
            hooks=p.pm.hook,
            data=PromptSource.from_prompts(run.train_prompts, shuffle=config.data.shuffle, seed=run.seed),
            rollout_fn=p.build("rollout_fn", "rollout.fn"), ctx=self.ctx, reward_fn=p.build("reward", "reward"),
            collector=GroupCollector(selectors, config.rollout.prompts_per_step, config.rollout.n_samples,
                                     partial_rollout=config.rollout.partial_rollout),
            plane=plane, learner=learner, transport=self.transport, max_failed_frac=run_cfg.max_failed_frac,
            release_memory=bool(split_node(config.rollout.engine, "rollout.engine")[1]["release_memory_during_train"])
            and not run_cfg.rollout_only,
        )
        close_with_run(self.c.rollout_fn, plane, run.closing)
        self.c.draft = draft_learner(split_node(config.rollout.engine, "rollout.engine")[0], model_path, run.seed)
        if self.c.draft is not None and not run_cfg.rollout_only:  # the engines speculate with the learner's draft
            self.c.draft.push(plane)
        # evaluations ask for no expert ids; greedy decoding for the accuracy, each dataset's own sampling for the sets
        self.sampled = replace(self.ctx, return_routed_experts=False)
        self.greedy = replace(self.sampled, sampling_params={**self.ctx.sampling_params, "temperature": 0.0,
                                                             "top_p": 1.0, "top_k": -1})
        self.train_eval_prompts = self.c.data.prompts[: run_cfg.eval_size] if run.eval_prompts else []
        self.rewards: list[float] = []
        self.first_step = self._resume()
        rewind_loggers(run.loggers, self.first_step)  # drop what an interrupted run logged after its checkpoint
        self.architecture = model_signature(run.base_model)
        self.schedule: Any = None
        run.timed("setup", start)

    def _remove_partial_checkpoints(self) -> None:
        """What checkpoint writes that never completed left: now (an earlier run killed while it wrote one), and
        when the run ends, after its backend has shut down (registered first, so that it runs last: a trainer in a
        process of its own may still write into the checkpoint an interrupted run gave up on)."""
        root = self.run.run_dir / "checkpoints"
        if removed := remove_partial_checkpoints(root):
            print(f"run.resume: removed {len(removed)} half-written checkpoint folder(s) that a run killed while "
                  f"writing left in {root}: {', '.join(removed)}", file=sys.stderr)
        self.run.closing.callback(remove_partial_checkpoints, root)

    def _resume(self) -> int:
        """With ``run.resume``: the newest checkpoint's backend, data, selectors, RNGs and weights; its step."""
        run, c = self.run, self.c
        if run.resume_from is None:
            return 0
        ckpt = run.resume_from
        self.backend.load_checkpoint(ckpt.backend_dir)
        loop_state = ckpt.loop_state()
        c.data.position = loop_state["data_position"]
        # prompts a one_step_off/async run had admitted and not trained: generated again, first
        c.data.requeue(loop_state.get("data_requeued", []))
        c.collector.load_state_dict(loop_state["collector"])
        set_rng_state(loop_state["rng"])
        for engine, state in zip(self.plane.local_engines, loop_state["engine_rng"]):
            engine.set_rng_state(state)
        self.transport.push(self.backend, self.plane, version=ckpt.state["weight_version"])
        if c.draft is not None and "draft" in loop_state:  # the speculative draft as it had learnt, to the engines
            c.draft.load_state_dict(loop_state["draft"])
            c.draft.push(self.plane)
        self.rewards = list(ckpt.state["rewards"])
        run.summary.update(ckpt.state["summary"])
        return ckpt.step

    def evaluate(self, greedy_accuracy: bool = True, datasets: bool = True) -> dict[str, float]:
        """The greedy accuracy on run.eval_size held-out and training prompts, and the eval section's datasets."""
        run, c, eval_start = self.run, self.c, time.perf_counter()
        result: dict[str, float] = {}
        greedy_accuracy = greedy_accuracy and bool(run.eval_prompts)
        datasets = datasets and bool(run.eval_sets)
        what = " and ".join(([f"{len(run.eval_prompts)} held-out and {len(self.train_eval_prompts)} training prompts"]
                             if greedy_accuracy else []) + ([f"{len(run.eval_sets)} eval set(s)"] if datasets else []))
        with phase(f"evaluating on {what}", bool(what) and run.p.config.run.progress):
            if greedy_accuracy:
                args = (c.rollout_fn, self.greedy, c.reward_fn, run.p.config.run.eval_pass_reward)
                result.update(evaluate(run.eval_prompts, *args))
                result.update({f"{k}_train": v for k, v in evaluate(self.train_eval_prompts, *args).items()})
            if datasets:
                result.update(evaluate_sets(run.eval_sets, c.rollout_fn, self.sampled, c.reward_fn))
        run.timed("eval", eval_start)
        return result

    def checkpoint(self, steps_done: int) -> None:
        run, config, save_start = self.run, self.run.p.config, time.perf_counter()
        state = {"step": steps_done, "weight_version": self.plane.weight_version, "rewards": self.rewards,
                 "start_model": self.model_path, "model": self.architecture, "backend": config.backend.name,
                 "plugins": run.stack, "summary": {k: v for k, v in run.summary.items() if k.startswith("eval_")}}
        position, requeued = self.schedule.data_state()
        loop_state = {"data_position": position, "data_requeued": requeued, "rng": rng_state(),
                      # in-process engines' sampling RNGs (remote engines keep theirs; see docs/checkpoints.md)
                      "engine_rng": [engine.rng_state() for engine in self.plane.local_engines],
                      "collector": self.c.collector.state_dict(),
                      **({"draft": self.c.draft.state_dict()} if self.c.draft is not None else {})}
        with phase(f"saving the checkpoint of step {steps_done}", config.run.progress):
            path = save_checkpoint(run.run_dir / "checkpoints", state, loop_state, self.backend,
                                   keep=config.run.keep_checkpoints,
                                   extra=lambda folder: self._export_quantized(folder, "model", steps_done))
        run.p.pm.hook.miles_checkpoint_save(path=str(path), step=steps_done)
        run.timed("checkpoint", save_start)

    def _export_quantized(self, folder: Path, name: str, step: int) -> str | None:
        """With ``run.export_precision``: the policy as ``<folder>/<name>_<scheme>``, in the scheme's stored form
        (what an engine in that format serves); its path, else None."""
        run = self.run
        if (scheme := run.p.build("precision", "run.export_precision")) is None:
            return None
        out = Path(folder) / f"{name}_{scheme.name}"
        self.backend.save_pretrained(str(out), run.tokenizer, {"phase": "rl", "step": step, "plugins": run.stack})
        write_stored_form(out, scheme, planned_layers(self.model_path, scheme, "run.export_precision"))
        return str(out)

    def run_steps(self) -> str:
        """Train ``run.steps`` steps (from the checkpoint's, when resumed); returns the exported final policy."""
        run, p = self.run, self.run.p
        config, run_cfg = p.config, p.config.run
        evaluates = bool(run.eval_prompts or run.eval_sets)
        if evaluates and self.first_step == 0:
            run.summary.update(eval_start=self.evaluate(), eval_prompts=len(run.eval_prompts),
                               eval_train_prompts=len(self.train_eval_prompts))
            if run.eval_sets:  # the datasets' curves start before the first step
                names = tuple(f"eval/{es.name}/" for es in run.eval_sets)
                for logger in run.loggers:
                    logger.log(0, {k: v for k, v in run.summary["eval_start"].items() if k.startswith(names)})
        self.schedule = make_schedule(run_cfg.schedule, self.c, stream_settings(config),
                                      version=self.plane.weight_version)
        run.closing.callback(self.schedule.close)  # before the envs, sandboxes and engines it uses are closed
        with frozen_heap(), progress(run_cfg.steps, config.advantage.name, run_cfg.progress) as bar:
            bar.update(self.first_step)
            for step in range(self.first_step, run_cfg.steps):
                self._step(step, bar)
        self.schedule.close()  # what the stream generated past the last step is not trained
        if evaluates:
            run.summary["eval_end"] = self.evaluate()
            for logger in run.loggers:
                logger.log(run_cfg.steps, run.summary["eval_end"])
        window = max(1, min(10, len(self.rewards) // 5))
        if self.rewards:
            run.summary.update(reward_window=window, reward_start=fmean(self.rewards[:window]),
                               reward_end=fmean(self.rewards[-window:]))
        if self.backend is None:  # run.rollout_only: the policy is still the start model
            return self.model_path
        out = str(run.run_dir / "final_model")
        self.backend.save_pretrained(out, run.tokenizer, {"phase": "rl", "step": run_cfg.steps, "plugins": run.stack})
        if (quantized := self._export_quantized(run.run_dir, "final_model", run_cfg.steps)) is not None:
            run.summary["final_model_quantized"] = quantized
        self.backend.shutdown()
        p.pm.hook.miles_checkpoint_save(path=out, step=run_cfg.steps)
        return out

    def _step(self, step: int, bar: Any) -> None:
        run, config = self.run, self.run.p.config
        run_cfg = config.run
        step_start = time.perf_counter()
        if self.plane.fleet is not None:  # `miles fleet RUN_DIR --engines N`, between two steps
            self.plane.fleet.follow(run.run_dir)
        metrics = self.schedule.step(step)
        run.timed("rl", step_start)
        every = run_cfg.eval_every if run_cfg.eval_every is not None else run_cfg.steps // 5
        greedy_due = bool(run.eval_prompts) and _due(step, every, run_cfg.steps)
        sets_due = bool(run.eval_sets) and _due(step, config.eval.every, run_cfg.steps)
        if greedy_due or sets_due:
            self.schedule.settle()  # the engines hold this step's weights
            metrics.update(self.evaluate(greedy_due, sets_due))
        run.p.pm.hook.miles_train_step_end(step=step, metrics=metrics)
        for logger in run.loggers:
            logger.log(step, metrics)
        if not math.isnan(metrics["reward/mean"]):  # nan: the step trained nothing (selection removed every group)
            self.rewards.append(metrics["reward/mean"])
        if run_cfg.save_every and (step + 1) % run_cfg.save_every == 0:
            self.checkpoint(step + 1)
        reward = {"reward": f"{fmean(self.rewards[-10:]):.3f}"} if self.rewards else {}  # the mean of the last 10
        step_s = metrics.get("time/step_s", time.perf_counter() - step_start)
        bar.set_postfix(**reward, step_s=f"{step_s:.2f}", refresh=False)
        bar.update()


def _due(step: int, every: int, steps: int) -> bool:
    """Whether an evaluation every ``every`` steps falls after ``step`` (not after the last: the final one does)."""
    return bool(every) and (step + 1) % every == 0 and step + 1 < steps
