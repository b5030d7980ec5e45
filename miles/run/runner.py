"""Assembling a run from its config: plugins, data, model, engine, backend; then the phases.

``prepare`` loads and validates everything that can be checked before work starts;
``train`` runs the SFT warm-up (when configured), the RL steps and the evaluations.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import fmean
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from miles.run.checkpoint import Checkpoint, model_signature, save_checkpoint
from miles.config import load_config, validate_config
from miles.config.algorithms import apply_estimator_defaults
from miles.config.validate import component_node, resolve_tool, split_node
from miles.sandboxes.remote import RemoteSandbox
from miles.loop.distill import make_teacher
from miles.errors import RunError
from miles.loop.evaluation import evaluate_sets
from miles.loop.step import Components, evaluate, sft_step
from miles.plugins import PluginManager, build_plugin_manager
from miles.registry import KINDS, Registry
from miles.run.preflight import batch_arithmetic, chat_format, context_length, eval_inputs, preflight
from miles.run.progress import progress
from miles.loop.saved_rollouts import RolloutWriter
from miles.rollout.collect import GroupCollector
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import Prompt, PromptSource
from miles.rollout.generate import with_time_limit
from miles.rollout.plane import RolloutPlane
from miles.loop.schedules import make_schedule, stream_settings
from miles.train.regularizers import regularized
from miles.train.torch_backend import rng_state, set_rng_state

__all__ = ["Prepared", "prepare", "train", "evaluate_model", "plugin_stack"]


class Prepared:
    def __init__(self, config: DictConfig, pm: PluginManager, registry: Registry) -> None:
        self.config, self.pm, self.registry = config, pm, registry

    def build(self, kind: str, key: str) -> Any:
        args, extra = split_node(OmegaConf.select(self.config, key), key)
        component = self.registry.build(kind, args, key)
        # the stage that calls it keeps to the limit (rollout.fn, reward); cluster.local_mode sets none, so that a
        # plain reward runs on the main thread (not a watchdog's) and a breakpoint does not time the sample out
        if "timeout_s" in extra and not self.config.cluster.local_mode:
            component = with_time_limit(component, extra["timeout_s"])
        return component


def prepare(config_path: str | Path | None, overrides: Sequence[str] = (), extra_plugins=()) -> Prepared:
    """Load the config, build the plugin manager and registry, validate every component."""
    config = load_config(config_path, overrides)
    pm = build_plugin_manager(config.run.plugins.allow, extra_plugins=extra_plugins)
    registry = Registry.from_plugin_manager(pm)
    apply_estimator_defaults(config, registry)
    validate_config(config, registry)
    pm.hook.miles_configure(config=config)
    validate_config(config, registry)
    return Prepared(config, pm, registry)


def plugin_stack(pm: PluginManager, registry: Registry) -> list[dict[str, Any]]:
    """Every plugin with its version and what it registered, by kind."""
    stack = []
    for name, info in pm.info.items():
        registered: dict[str, list[str]] = {}
        for kind in KINDS:
            names = [e.name for e in registry.entries(kind) if e.plugin.name == name]
            if names:
                registered[kind] = names
        stack.append(
            {"name": name, "version": info.version, "distribution": info.distribution,
             "module": info.module, "builtin": info.builtin, "registered": registered}
        )
    return stack


def _summary_text(summary: dict[str, Any]) -> str:
    lines = [f"Miles run finished: {summary['run_dir']}"]
    if "reward_start" in summary:
        lines.append(
            f"  train reward (mean of first/last {summary['reward_window']} steps): "
            f"{summary['reward_start']:.3f} -> {summary['reward_end']:.3f}"
        )
    start, end = summary.get("eval_start") or {}, summary.get("eval_end") or {}
    if "eval/accuracy" in start and "eval/accuracy" in end:
        lines.append(
            f"  greedy accuracy on {summary['eval_prompts']} held-out prompts: "
            f"{start['eval/accuracy']:.3f} -> {end['eval/accuracy']:.3f}; on {summary['eval_train_prompts']} "
            f"training prompts: {start['eval/accuracy_train']:.3f} -> {end['eval/accuracy_train']:.3f}"
        )
    for key in sorted(k for k in end if k.startswith("eval/") and k.rsplit("/", 1)[1].startswith(("mean@", "pass@"))):
        before = f"{start[key]:.3f} -> " if key in start else ""
        lines.append(f"  {key}: {before}{end[key]:.3f}")
    lines.append("  time per phase: " + ", ".join(f"{k} {v:.1f} s" for k, v in summary["time_s"].items()))
    lines.append(f"  final model: {summary['final_model']}")
    return "\n".join(lines)


@dataclass
class _Run:
    """What the phases of one run share."""

    p: Prepared
    run_dir: Path
    seed: int
    stack: list[dict[str, Any]]
    tokenizer: Any
    pad_token_id: int
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    loggers: list[Any]
    eval_sets: list[Any]  # miles.loop.evaluation.EvalSet: the eval section's datasets
    closing: ExitStack
    cluster: Any = None  # miles.cluster.RayCluster, when engines or the backend run on Ray
    ray_num_cpus: int | None = None  # CPUs of a local Ray instance (see miles.run.preflight)
    base_model: str = ""  # the model the run starts from, before any SFT; its architecture is checked on resume
    resume_from: Checkpoint | None = None
    chat_format: Any = None  # miles.agentic.chat_format.BoundFormat (None: no format fits the tokenizer)
    times: dict[str, float] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    def timed(self, phase: str, since: float) -> None:
        self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - since

    def ray_cluster(self) -> Any:
        """The run's Ray cluster, started (or joined) on first use."""
        if self.cluster is None:
            from miles.cluster import RayCluster

            self.cluster = RayCluster(self.p.config.cluster, self.run_dir, num_cpus=self.ray_num_cpus)
            self.closing.callback(self.cluster.shutdown)
        return self.cluster

    def build_backend(self, **overrides: Any) -> Any:
        if self.p.config.rollout.true_on_policy:  # log-probs as the engine computes them (rollout.true_on_policy)
            overrides = {"exact_logprobs": True, **overrides}
        node = {**component_node(self.p.config.backend), **overrides}
        backend_cls = self.p.registry.get("backend", node["name"]).obj
        if not getattr(backend_cls, "uses_ray", False):
            return self.p.registry.build("backend", node, "backend")
        self.ray_cluster()
        backend = self.p.registry.build("backend", node, "backend")
        backend.ray_resources = OmegaConf.to_container(self.p.config.cluster.train_resources)
        return backend


def _sft_phase(run: _Run, model_path: str) -> str:
    """Supervised warm-up on prompt/label pairs; returns the checkpoint RL starts from."""
    config, start = run.p.config, time.perf_counter()
    # SFT data has no engine routing to replay
    replay = {"routing_replay": False} if component_node(config.backend).get("routing_replay") else {}
    if config.rollout.true_on_policy:  # SFT trains on data, not on the engine's samples: the usual batched forward
        replay["exact_logprobs"] = False
    backend = run.build_backend(lr=float(config.sft.lr), **replay)
    backend.setup(model_path, seed=run.seed, total_steps=config.sft.steps)
    loss = run.p.build("loss", "sft.loss")
    data = PromptSource.from_prompts(run.train_prompts, shuffle=True, seed=run.seed + 1)
    with progress(config.sft.steps, "sft", config.run.progress) as bar:
        for _ in range(config.sft.steps):
            metrics = sft_step(data, run.tokenizer, config.sft.batch_size, backend, loss, run.pad_token_id,
                               config.sft.messages_key, run.chat_format)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", step_s=f"{metrics['time/step_s']:.2f}", refresh=False)
            bar.update()
    out = str(run.run_dir / "sft_model")
    backend.save_pretrained(out, run.tokenizer, {"phase": "sft", "step": config.sft.steps, "plugins": run.stack})
    backend.shutdown()
    run.p.pm.hook.miles_checkpoint_save(path=out, step=config.sft.steps)
    run.summary["sft_final_loss"] = metrics["train/loss"]
    run.timed("sft", start)
    return out


def _rollout_plane(run: _Run, model_path: str, transport: Any) -> RolloutPlane:
    """One in-process engine, or ``num_engines`` engines served over HTTP by Ray actors behind a router."""
    p = run.p
    engine_args, extra = split_node(p.config.rollout.engine, "rollout.engine")
    if p.config.rollout.true_on_policy:  # the engine answers with the log-probs the trainer computes, bit for bit
        engine_args = {**engine_args, "exact_logprobs": True}
    num_engines = extra.get("num_engines", 0)
    if p.config.cluster.local_mode:
        instead = f"; one in-process engine instead of rollout.engine.num_engines={num_engines}" if num_engines else ""
        print(f"cluster.local_mode: every plane in this process, rollouts on the main thread, no time limits on "
              f"rollout.fn and reward{instead}", file=sys.stderr)
        num_engines = 0
    if num_engines == 0:
        engine = p.registry.build("rollout_engine", engine_args, "rollout.engine")
        streaming = p.config.run.schedule != "sync"
        if streaming and hasattr(engine, "background"):  # generates in a thread of its own, beside the trainer
            engine.background = True
        engine.load_model(model_path)
        return RolloutPlane(local_engines=[engine], threaded=streaming)

    from miles.engine.ray_actors import launch_engines, shutdown_engines

    cluster_cfg = p.config.cluster
    cluster = run.ray_cluster()
    launcher = _engine_launcher(p, engine_args)
    if extra["release_memory_during_train"] and getattr(launcher, "enable_memory_saver", False) is None:
        launcher.enable_memory_saver = True  # SGLang gives memory back only when started with --enable-memory-saver
    if p.config.rollout.return_routed_experts and getattr(launcher, "enable_return_routed_experts", False) is None:
        launcher.enable_return_routed_experts = True  # SGLang returns expert ids only when started with its flag
    router, actors, group = launch_engines(
        cluster.ray, num_engines, model_path, launcher, cpus_per_engine=cluster_cfg.cpus_per_engine,
        multi_node=cluster.multi_node, startup_timeout_s=cluster_cfg.engine_startup_timeout_s,
        router_args=OmegaConf.to_container(cluster_cfg.router),
        resources=OmegaConf.to_container(cluster_cfg.engine_resources),
    )
    run.closing.callback(shutdown_engines, cluster.ray, actors, group)
    if getattr(launcher, "protocol", "miles") == "sglang" and hasattr(transport, "use_disk"):
        transport.use_disk()  # auto: SGLang servers take checkpoints on disk (or a broadcast: distributed)
    plane = RolloutPlane(router=router)
    # A restarted engine gets the current weights before it serves again.
    router.on_readmit = lambda endpoint: transport.catch_up(plane, endpoint)
    plane.run(router.wait_healthy(timeout_s=cluster_cfg.engine_startup_timeout_s))
    return plane


def _engine_launcher(p: Prepared, engine_args: dict[str, Any]) -> Any:
    """What each engine actor serves with: the registered engine when it is a server launcher (e.g. ``sglang``),
    else the in-process engine served from the actor (:class:`~miles.engine.launchers.EmbeddedLauncher`)."""
    from miles.engine.launchers import EmbeddedLauncher, is_server_launcher

    if is_server_launcher(p.registry.get("rollout_engine", engine_args["name"]).obj):
        return p.registry.build("rollout_engine", engine_args, "rollout.engine")
    return EmbeddedLauncher({k: v for k, v in engine_args.items() if k != "name"})


def _agentic_parts(run: _Run, model_path: str, plane: RolloutPlane) -> dict[str, Any]:
    """What rollout functions get for envs, sandboxes and tool calls (RolloutContext fields)."""
    p, rollout = run.p, run.p.config.rollout
    parts: dict[str, Any] = {
        "context_length": context_length(model_path),
        "tool_parser": p.build("tool_parser", "rollout.tool_parser") if rollout.tool_parser is not None else
        run.chat_format.tool_parser if run.chat_format is not None else
        p.registry.build("tool_parser", {"name": "hermes"}, "rollout.tool_parser"),
        "chat_format": run.chat_format,
        "tito_on_mismatch": str(rollout.tito.on_mismatch),
        "tool": lambda name: resolve_tool(p.registry, name, "rollout.env.tools"),
        "seed": run.seed,
    }
    if rollout.env is not None:
        parts["env"] = p.build("env", "rollout.env")
    if rollout.sandbox is not None:
        factory = p.build("sandbox", "rollout.sandbox")
        if "workspace_root" in inspect.signature(factory.func).parameters and "workspace_root" not in factory.keywords:
            # The run's workspaces live under one folder that goes with the run, whatever stopped it.
            root = tempfile.mkdtemp(prefix="miles-workspaces-")
            os.chmod(root, 0o711)  # commands may run as another user (nobody, when Miles runs as root)
            run.closing.callback(shutil.rmtree, root, ignore_errors=True)
            factory = functools.partial(factory, workspace_root=root)
        hosted = isinstance(factory.func, type) and issubclass(factory.func, RemoteSandbox)
        if (hosted or "run_id" in inspect.signature(factory).parameters) and "run_id" not in factory.keywords:
            # Hosted sandboxes are tagged with the run, so that `miles sandbox gc` finds what a killed run left.
            factory = functools.partial(factory, run_id=f"{run.run_dir.name}-{uuid.uuid4().hex[:8]}")
        parts["sandbox"] = factory
        sandbox_cls = factory.func
        describe = getattr(sandbox_cls, "describe", None)
        if describe is not None:
            tag = f" (tagged miles-run={factory.keywords['run_id']})" if "run_id" in factory.keywords else ""
            print(f"rollout.sandbox: {describe(**factory.keywords)}{tag}", file=sys.stderr)
        if hasattr(sandbox_cls, "close_all"):  # what is still open at the end, on failure or Ctrl-C
            run.closing.callback(_close_sandboxes, plane, sandbox_cls, factory.keywords.get("run_id"))
        if hasattr(sandbox_cls, "preflight"):  # an unreachable service fails the start, in bounded time
            try:
                plane.run(sandbox_cls.preflight(**factory.keywords))
            except Exception as exc:
                raise RunError(f"rollout.sandbox ({p.config.rollout.sandbox.name}): {exc}") from exc
    return parts


def _close_sandboxes(plane: RolloutPlane, sandbox_cls: type, run_id: str | None) -> None:
    """Delete the run's sandboxes still open, being created, or whose delete was cut short (Ctrl-C can stop
    the rollouts' event loop in the middle of their clean-up). With the run's id the run is over for the
    sandbox class: on a remote plane the rollouts still run on the plane's loop until it closes, and none of
    them creates a sandbox after this. A failure is reported, not raised: the rest of the closing goes on."""
    by_run = run_id is not None and "run_id" in inspect.signature(sandbox_cls.close_all).parameters
    try:
        plane.run(sandbox_cls.close_all(**({"run_id": run_id} if by_run else {})))
    except Exception as exc:
        print(f"miles: warning: rollout.sandbox: {exc}", file=sys.stderr)


def _engine_rng(plane: RolloutPlane) -> list[Any]:
    """The sampling RNG of every in-process engine (remote engines keep theirs; see docs/checkpoints.md)."""
    return [engine.rng_state() for engine in plane.local_engines]


def _rl_backend(run: _Run, model_path: str, remote: bool) -> Any:
    """The policy's backend, set up from ``model_path``; with engines over HTTP (``remote``), an actor."""
    config = run.p.config
    backend = run.build_backend()
    # On Ray, the synchronous loop's training plane is an actor too. A streaming schedule trains here, beside the
    # rollout loop's thread: measured on the quickstart, 50 ms a step against 65 ms through an actor.
    if remote and not getattr(backend, "uses_ray", False) and config.run.schedule == "sync":
        from miles.train.ray_backend import launch_backend

        backend = launch_backend(run.cluster.ray, backend, cpus=config.cluster.train_cpus,
                                 startup_timeout_s=config.cluster.engine_startup_timeout_s,
                                 resources=OmegaConf.to_container(config.cluster.train_resources))
    run.closing.callback(backend.shutdown)
    _setup_rl_backend(run.p, backend, model_path, run.seed)
    return backend


def _setup_rl_backend(p: Prepared, backend: Any, model_path: str, seed: int) -> None:
    """Load the policy (and the reference and value models the config needs) from ``model_path``."""
    reg = p.config.regularization
    estimator = p.registry.get("advantage", component_node(p.config.advantage)["name"]).obj
    backend.setup(model_path, seed=seed, total_steps=p.config.run.steps,
                  **({"ref_model_path": model_path} if reg.kl_coef > 0 else {}),
                  # A value model starts from the policy's checkpoint with a new scalar head.
                  **({"critic_model_path": model_path} if getattr(estimator, "needs_values", False) else {}))


def _training_parts(p: Prepared) -> dict[str, Any]:
    """The training side of :class:`~miles.loop.step.Components`: advantage, loss with its regularizers, KL penalty."""
    config, reg = p.config, p.config.regularization
    return dict(
        mask_off_policy=config.rollout.mask_off_policy,
        advantage_fn=p.build("advantage", "advantage"),
        loss_fn=regularized(p.build("loss", "loss"), kl_coef=reg.kl_coef if reg.kl_in == "loss" else 0.0,
                            kl_estimator=reg.kl_estimator, entropy_coef=reg.entropy_coef),
        kl_reward_coef=reg.kl_coef if reg.kl_in == "reward" else 0.0,
        kl_estimator=reg.kl_estimator,
    )


def _rl_phase(run: _Run, model_path: str) -> str:
    """RL steps with evaluations before and after, checkpoints every ``run.save_every`` steps;
    returns the exported final policy."""
    p, config, run_cfg = run.p, run.p.config, run.p.config.run
    start = time.perf_counter()
    transport = p.build("weight_transport", "rollout.weight_sync")
    if hasattr(transport, "close"):  # e.g. shm's file under /dev/shm
        run.closing.callback(transport.close)
    plane = _rollout_plane(run, model_path, transport)
    run.closing.callback(plane.close)
    backend = None if run_cfg.rollout_only else _rl_backend(run, model_path, remote=plane.remote)
    sampling = OmegaConf.to_container(config.rollout.sampling)
    agentic = _agentic_parts(run, model_path, plane)
    c = Components(
        pm=p.pm,
        train_data=PromptSource.from_prompts(run.train_prompts, shuffle=config.data.shuffle, seed=run.seed),
        rollout_fn=p.build("rollout_fn", "rollout.fn"),
        rollout_ctx=RolloutContext(engine=plane.client, tokenizer=run.tokenizer, sampling_params=sampling, run=plane.run,
                                   return_routed_experts=config.rollout.return_routed_experts, **agentic),
        plane=plane,
        reward_fn=p.build("reward", "reward"),
        collector=GroupCollector(
            [(component_node(n)["name"], p.registry.build("data_selector", component_node(n), f"selection[{i}]"))
             for i, n in enumerate(config.selection)], config.rollout.prompts_per_step, config.rollout.n_samples,
            partial_rollout=config.rollout.partial_rollout),
        **_training_parts(p),
        backend=backend,
        transport=transport,
        pad_token_id=run.pad_token_id,
        prompts_per_step=config.rollout.prompts_per_step,
        n_samples=config.rollout.n_samples,
        max_failed_frac=run_cfg.max_failed_frac,
        release_memory=bool(split_node(config.rollout.engine, "rollout.engine")[1]["release_memory_during_train"])
        and not run_cfg.rollout_only,
        save_rollouts=RolloutWriter(run.run_dir, model_path, run.pad_token_id) if run_cfg.save_rollouts else None,
        rollout_only=run_cfg.rollout_only,
    )
    c.teacher = make_teacher(config.distill, p, model_path, run.closing)  # on-policy distillation
    aclose = getattr(getattr(c.rollout_fn, "func", c.rollout_fn), "aclose", None)
    if aclose is not None:  # e.g. the envs of multi-turn trajectories waiting to be continued
        run.closing.callback(lambda: plane.run(aclose()))
    greedy = RolloutContext(engine=plane.client, tokenizer=run.tokenizer, run=plane.run, **agentic,
                            sampling_params={**sampling, "temperature": 0.0, "top_p": 1.0, "top_k": -1})
    train_eval_prompts = c.train_data.prompts[: run_cfg.eval_size] if run.eval_prompts else []
    rewards: list[float] = []
    first_step = 0
    if run.resume_from is not None:
        ckpt = run.resume_from
        backend.load_checkpoint(ckpt.backend_dir)
        loop_state = ckpt.loop_state()
        c.train_data.position = loop_state["data_position"]
        # prompts a one_step_off/async run had admitted and not trained: generated again, first
        c.train_data.requeue(loop_state.get("data_requeued", []))
        c.collector.load_state_dict(loop_state["collector"])
        set_rng_state(loop_state["rng"])
        for engine, state in zip(plane.local_engines, loop_state["engine_rng"]):
            engine.set_rng_state(state)
        transport.push(backend, plane, version=ckpt.state["weight_version"])
        rewards, first_step = list(ckpt.state["rewards"]), ckpt.step
        run.summary.update(ckpt.state["summary"])
    for logger in run.loggers:
        if hasattr(logger, "rewind"):
            logger.rewind(first_step)  # drop what an interrupted run logged after its last checkpoint
    run.timed("setup", start)

    sampled = replace(greedy, sampling_params=sampling)  # each eval dataset sets its own sampling parameters

    def run_eval(greedy_accuracy: bool = True, datasets: bool = True) -> dict[str, float]:
        """The greedy accuracy on run.eval_size held-out and training prompts, and the eval section's datasets."""
        eval_start = time.perf_counter()
        result: dict[str, float] = {}
        if greedy_accuracy and run.eval_prompts:
            args = (c.rollout_fn, greedy, c.reward_fn, run_cfg.eval_pass_reward)
            result.update(evaluate(run.eval_prompts, *args))
            result.update({f"{k}_train": v for k, v in evaluate(train_eval_prompts, *args).items()})
        if datasets and run.eval_sets:
            result.update(evaluate_sets(run.eval_sets, c.rollout_fn, sampled, c.reward_fn))
        run.timed("eval", eval_start)
        return result

    def eval_due(step: int, every: int) -> bool:
        return bool(every) and (step + 1) % every == 0 and step + 1 < run_cfg.steps

    architecture = model_signature(run.base_model)

    def checkpoint(steps_done: int) -> None:
        save_start = time.perf_counter()
        state = {"step": steps_done, "weight_version": plane.weight_version, "rewards": rewards,
                 "start_model": model_path, "model": architecture, "backend": config.backend.name,
                 "plugins": run.stack, "summary": {k: v for k, v in run.summary.items() if k.startswith("eval_")}}
        position, requeued = schedule.data_state()
        loop_state = {"data_position": position, "data_requeued": requeued, "rng": rng_state(),
                      "engine_rng": _engine_rng(plane), "collector": c.collector.state_dict()}
        path = save_checkpoint(run.run_dir / "checkpoints", state, loop_state, backend, keep=run_cfg.keep_checkpoints)
        p.pm.hook.miles_checkpoint_save(path=str(path), step=steps_done)
        run.timed("checkpoint", save_start)

    if (run.eval_prompts or run.eval_sets) and first_step == 0:
        run.summary.update(eval_start=run_eval(), eval_prompts=len(run.eval_prompts),
                           eval_train_prompts=len(train_eval_prompts))
        if run.eval_sets:  # the datasets' curves start before the first step
            for logger in run.loggers:
                names = tuple(f"eval/{es.name}/" for es in run.eval_sets)
                logger.log(0, {k: v for k, v in run.summary["eval_start"].items() if k.startswith(names)})
    schedule = make_schedule(run_cfg.schedule, c, stream_settings(config), version=plane.weight_version)
    run.closing.callback(schedule.close)  # before the envs, sandboxes and engines it uses are closed
    with progress(run_cfg.steps, config.advantage.name, run_cfg.progress) as bar:
        bar.update(first_step)
        for step in range(first_step, run_cfg.steps):
            step_start = time.perf_counter()
            metrics = schedule.step(step)
            run.timed("rl", step_start)
            greedy_due = bool(run.eval_prompts) and eval_due(step, run_cfg.eval_every)
            sets_due = bool(run.eval_sets) and eval_due(step, config.eval.every)
            if greedy_due or sets_due:
                schedule.settle()  # the engines hold this step's weights
                metrics.update(run_eval(greedy_due, sets_due))
            p.pm.hook.miles_train_step_end(step=step, metrics=metrics)
            for logger in run.loggers:
                logger.log(step, metrics)
            if not math.isnan(metrics["reward/mean"]):  # nan: no sample finished in the step (a streaming schedule
                rewards.append(metrics["reward/mean"])  # can train groups that finished before the step began)
            if run_cfg.save_every and (step + 1) % run_cfg.save_every == 0:
                checkpoint(step + 1)
            reward = {"reward": f"{fmean(rewards[-10:]):.3f}"} if rewards else {}  # the mean of the last 10 steps
            step_s = metrics.get("time/step_s", time.perf_counter() - step_start)
            bar.set_postfix(**reward, step_s=f"{step_s:.2f}", refresh=False)
            bar.update()
    schedule.close()  # what the stream generated past the last step is not trained
    if run.eval_prompts or run.eval_sets:
        run.summary["eval_end"] = run_eval()
        for logger in run.loggers:
            logger.log(run_cfg.steps, run.summary["eval_end"])
    window = max(1, min(10, len(rewards) // 5))
    if rewards:
        run.summary.update(reward_window=window, reward_start=fmean(rewards[:window]), reward_end=fmean(rewards[-window:]))
    if backend is None:  # run.rollout_only: the policy is still the start model
        return model_path
    out = str(run.run_dir / "final_model")
    backend.save_pretrained(out, run.tokenizer, {"phase": "rl", "step": run_cfg.steps, "plugins": run.stack})
    backend.shutdown()
    p.pm.hook.miles_checkpoint_save(path=out, step=run_cfg.steps)
    return out


def evaluate_model(p: Prepared, model_dir: str) -> dict[str, float]:
    """``miles eval``: the eval section's datasets (see :func:`miles.run.preflight.eval_inputs`) on the model in
    ``model_dir``, with the config's engine, rollout function, env and reward; nothing is trained or written."""
    config = p.config
    tokenizer, sets = eval_inputs(p, model_dir)
    with ExitStack() as closing, tempfile.TemporaryDirectory(prefix="miles-eval-") as scratch:
        run = _Run(p, Path(scratch) / "eval", int(config.run.seed), plugin_stack(p.pm, p.registry), tokenizer,
                   pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                   train_prompts=[], eval_prompts=[], loggers=[], eval_sets=sets, closing=closing,
                   chat_format=chat_format(p, tokenizer, model_dir))
        run.run_dir.mkdir()
        plane = _rollout_plane(run, model_dir, p.build("weight_transport", "rollout.weight_sync"))
        closing.callback(plane.close)
        ctx = RolloutContext(engine=plane.client, tokenizer=tokenizer, run=plane.run,
                             sampling_params=OmegaConf.to_container(config.rollout.sampling),
                             **_agentic_parts(run, model_dir, plane))
        rollout_fn = p.build("rollout_fn", "rollout.fn")
        aclose = getattr(getattr(rollout_fn, "func", rollout_fn), "aclose", None)
        if aclose is not None:
            closing.callback(lambda: plane.run(aclose()))
        return evaluate_sets(sets, rollout_fn, ctx, p.build("reward", "reward"))


def start_loggers(p: Prepared, run_dir: Path, closing: ExitStack) -> list[Any]:
    """The loggers of ``run.loggers``, started on ``run_dir``; ``closing`` closes them."""
    loggers = [p.registry.build("logger", component_node(node), f"run.loggers[{i}]")
               for i, node in enumerate(p.config.run.loggers)]
    for logger in loggers:
        logger.start(str(run_dir), p.config)
        closing.callback(logger.close)
    return loggers


def train(p: Prepared) -> dict[str, Any]:
    """Run every phase; returns the summary (also written to ``<run.dir>/summary.json``).

    Every check runs first (:func:`miles.run.preflight.preflight`); ``run.dir`` changes only after all passed.
    """
    config, run_cfg, started = p.config, p.config.run, time.perf_counter()
    seed = int(run_cfg.seed)
    stack = plugin_stack(p.pm, p.registry)
    staged = preflight(p, stack)
    staged.commit(overwrite=bool(run_cfg.overwrite))
    run_dir, model_path, tokenizer = staged.run_dir, staged.model_path, staged.tokenizer
    torch.manual_seed(seed)
    if run_cfg.torch_threads > 0:
        torch.set_num_threads(run_cfg.torch_threads)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(config))
    (run_dir / "run.json").write_text(json.dumps({"config": OmegaConf.to_container(config), "plugins": stack}, indent=1))
    p.pm.hook.miles_run_start(run_dir=str(run_dir), config=config, plugins=stack)

    with ExitStack() as closing:
        loggers = start_loggers(p, run_dir, closing)
        run = _Run(
            p, run_dir, seed, stack, tokenizer,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            train_prompts=staged.train_prompts, eval_prompts=staged.eval_prompts, loggers=loggers, closing=closing,
            eval_sets=staged.eval_sets,
            ray_num_cpus=staged.ray_num_cpus,
            summary={"run_dir": str(run_dir), "plugins": stack, **{k: v for k, v in staged.data_stats.items() if v}},
        )
        run.timed("setup", started)
        run.base_model = model_path
        run.resume_from = staged.resume_from
        run.chat_format = staged.chat_format
        if run.resume_from is not None:
            print(f"run.resume: continuing from {run.resume_from.path} ({run.resume_from.step} steps done)",
                  file=sys.stderr)
            model_path = run.resume_from.state["start_model"]  # the SFT phase (if any) finished before it
        elif config.sft.steps > 0:
            model_path = _sft_phase(run, model_path)
        if run_cfg.steps > 0:
            print(batch_arithmetic(config), file=sys.stderr)
            model_path = _rl_phase(run, model_path)

    summary = run.summary
    summary["final_model"] = model_path
    summary["time_s"] = {**run.times, "total": time.perf_counter() - started}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    p.pm.hook.miles_run_end(run_dir=str(run_dir), summary=summary)
    print(_summary_text(summary))
    return summary
