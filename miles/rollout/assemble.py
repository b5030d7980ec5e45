"""The rollout plane from the config: its engines (in process, or served by Ray actors behind a router), and
what rollout functions are given (:class:`~miles.rollout.context.RolloutContext`: the sampling parameters, the
chat format, tool parser, env and sandbox)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from omegaconf import OmegaConf

from miles.agentic.sandboxes.pool import SandboxPool
from miles.agentic.sandboxes.remote import RemoteSandbox
from miles.config.validate import resolve_tool, split_node, tito_on_mismatch
from miles.errors import ConfigError, RunError
from miles.cluster import cores
from miles.engine.process import separate_process, start_engine_process
from miles.hookspecs import (BackgroundEngine, CheckedSandbox, ClosingRolloutFn, DescribedSandbox,
                             DiskTransportSwitch, HostedSandbox, LogprobsOfEngine, MemorySaverLauncher,
                             PrecisionEngine, ProtocolLauncher, RoutedExpertsLauncher, is_server_launcher,
                             takes_option)
from miles.models.hf import context_length
from miles.models.vision import ImageEncoder
from miles.rollout.context import RolloutContext
from miles.rollout.plane import RolloutPlane

__all__ = ["rollout_plane", "engine_launcher", "rollout_context", "close_with_run", "trajectories_at_once"]


def rollout_plane(p: Any, model_path: str, transport: Any, ray_cluster: Callable[[], Any],
                  closing: ExitStack, trainer_apart: bool = False) -> RolloutPlane:
    """One in-process engine, or ``num_engines`` engines served over HTTP by Ray actors behind a router, each
    loading ``model_path``; ``transport`` catches up an engine that comes back. ``closing`` stops them.
    ``trainer_apart``: the trainer has a process of its own (``backend.separate_process``), so the in-process
    engine stays here under ``rollout.engine.separate_process: auto``."""
    engine_args, extra = split_node(p.config.rollout.engine, "rollout.engine")
    if p.config.rollout.true_on_policy:  # the engine answers with the log-probs the trainer computes, bit for bit
        engine_args = {**engine_args, "exact_logprobs": True}
    if isinstance(p.registry.get("rollout_engine", engine_args["name"]).obj, LogprobsOfEngine):
        engine_args = {**engine_args, "logprobs_of": str(p.config.rollout.logprobs_of)}  # as the trainer takes them
    if (scheme := p.build("precision", "rollout.precision")) is not None:
        if not isinstance(p.registry.get("rollout_engine", engine_args["name"]).obj, PrecisionEngine):
            raise ConfigError(f"rollout.precision: {scheme.name} needs an engine that holds a low-precision stored "
                              f"form (accepts_precision); rollout.engine {engine_args['name']!r} does not")
        engine_args = {**engine_args, "precision": scheme.spec()}
    num_engines = extra.get("num_engines", 0)
    if p.config.cluster.local_mode:
        instead = f"; one in-process engine instead of rollout.engine.num_engines={num_engines}" if num_engines else ""
        print(f"cluster.local_mode: every plane in this process, rollouts on the main thread, no time limits on "
              f"rollout.fn and reward{instead}", file=sys.stderr)
        num_engines = 0
    streaming = p.config.run.schedule != "sync"
    if num_engines == 0 and not p.config.cluster.local_mode:
        own, why_not = separate_process(extra["separate_process"], engine=engine_args["name"], streaming=streaming,
                                        trainer_apart=trainer_apart)
        if own:
            return _engine_process_plane(p, model_path, engine_args, transport, closing)
        if why_not:
            print(f"run.schedule={p.config.run.schedule}: {why_not}", file=sys.stderr)
    if num_engines == 0:
        engine = p.registry.build("rollout_engine", engine_args, "rollout.engine")
        if streaming and isinstance(engine, BackgroundEngine):  # generates in a thread of its own, beside the trainer
            engine.background = True
        engine.load_model(model_path)
        plane = RolloutPlane(local_engines=[engine], threaded=streaming)
        closing.callback(plane.close)
        return plane

    from miles.engine.ray_actors import engine_meta, launch_engines, shutdown_engines
    from miles.engine.ray_fleet import RayFleet

    cluster_cfg = p.config.cluster
    cluster = ray_cluster()
    launcher = engine_launcher(p, engine_args)
    if (extra["release_memory_during_train"] and isinstance(launcher, MemorySaverLauncher)
            and launcher.enable_memory_saver is None):
        launcher.enable_memory_saver = True  # SGLang gives memory back only when started with --enable-memory-saver
    if (p.config.rollout.return_routed_experts and isinstance(launcher, RoutedExpertsLauncher)
            and launcher.enable_return_routed_experts is None):
        launcher.enable_return_routed_experts = True  # SGLang returns expert ids only when started with its flag
    router, actors, group, start_more = launch_engines(
        cluster.ray, num_engines, model_path, launcher, cpus_per_engine=cluster_cfg.cpus_per_engine,
        multi_node=cluster.multi_node, startup_timeout_s=cluster_cfg.engine_startup_timeout_s,
        router_args=OmegaConf.to_container(cluster_cfg.router),
        resources=OmegaConf.to_container(cluster_cfg.engine_resources),
    )
    closing.callback(shutdown_engines, cluster.ray, actors, group)
    if (isinstance(launcher, ProtocolLauncher) and launcher.protocol == "sglang"
            and isinstance(transport, DiskTransportSwitch)):
        transport.use_disk()  # auto: SGLang servers take checkpoints on disk (or a broadcast: distributed)
    plane = RolloutPlane(router=router)
    closing.callback(plane.close)
    # A restarted engine gets the current weights before it serves again (and so does one that joins).
    router.on_readmit = lambda endpoint: transport.catch_up(plane, endpoint)
    plane.run(router.wait_healthy(timeout_s=cluster_cfg.engine_startup_timeout_s))
    plane.fleet = RayFleet(cluster.ray, router, plane, start_more, engine_meta(launcher))  # miles fleet RUN_DIR
    closing.callback(plane.fleet.close)
    return plane


def _engine_process_plane(p: Any, model_path: str, engine_args: dict[str, Any], transport: Any,
                          closing: ExitStack) -> RolloutPlane:
    """The builtin engine served from a child process (:mod:`miles.engine.process`), reached through a router."""
    threads = p.config.run.torch_threads if p.config.run.torch_threads > 0 else max(1, cores() // 2)
    router, server = start_engine_process(
        model_path, engine_args, threads=threads, startup_timeout_s=p.config.cluster.engine_startup_timeout_s,
        router_args=OmegaConf.to_container(p.config.cluster.router))
    closing.callback(_stop_engine_process, server)
    plane = RolloutPlane(router=router)
    closing.callback(plane.close)
    router.on_readmit = lambda endpoint: transport.catch_up(plane, endpoint)
    plane.run(router.wait_healthy(timeout_s=p.config.cluster.engine_startup_timeout_s))
    print(f"rollout.engine.separate_process: the engine serves from process {server.pid} (log: {server.log_path})",
          file=sys.stderr)
    return plane


def _stop_engine_process(server: Any) -> None:
    """Stop the engine's process; its log goes with it unless the server had died (the log then says why)."""
    served = server.alive()
    server.stop()
    if served:
        with contextlib.suppress(OSError):
            os.unlink(server.log_path)


def engine_launcher(p: Any, engine_args: dict[str, Any]) -> Any:
    """What each engine actor serves with: the registered engine when it is a server launcher (e.g. ``sglang``),
    else the in-process engine served from the actor (:class:`~miles.engine.launchers.EmbeddedLauncher`)."""
    from miles.engine.launchers import EmbeddedLauncher

    if is_server_launcher(p.registry.get("rollout_engine", engine_args["name"]).obj):
        return p.registry.build("rollout_engine", engine_args, "rollout.engine")
    return EmbeddedLauncher({k: v for k, v in engine_args.items() if k != "name"})


def rollout_context(p: Any, plane: RolloutPlane, tokenizer: Any, model_path: str, chat_format: Any, seed: int,
                    run_name: str, closing: ExitStack, **fields: Any) -> RolloutContext:
    """What rollout functions get besides their sample: the engine client, the sampling parameters, and for
    agentic rollouts the chat format, tool parser, env and sandbox (``rollout.*``). ``fields`` set the others.
    A sandbox's workspaces live under a folder of the run that ``closing`` removes, whatever stopped it."""
    rollout = p.config.rollout
    if rollout.tool_parser is not None:
        tool_parser = p.build("tool_parser", "rollout.tool_parser")
    elif chat_format is not None:
        tool_parser = chat_format.tool_parser
    else:
        tool_parser = p.registry.build("tool_parser", {"name": "hermes"}, "rollout.tool_parser")
    ctx = RolloutContext(
        engine=plane.client, tokenizer=tokenizer, run=plane.run, context_length=context_length(model_path),
        sampling_params=OmegaConf.to_container(rollout.sampling), tool_parser=tool_parser, chat_format=chat_format,
        tito_on_mismatch=tito_on_mismatch(p.config, p.registry), seed=seed, images=ImageEncoder.of(model_path),
        tool=lambda name: resolve_tool(p.registry, name, "rollout.env.tools"), **fields)
    if rollout.env is not None:
        ctx.env = p.build("env", "rollout.env")
    if rollout.sandbox is not None:
        ctx.sandbox = _sandbox_factory(p, plane, run_name, closing)
    return ctx


def _sandbox_factory(p: Any, plane: RolloutPlane, run_name: str, closing: ExitStack) -> Any:
    factory = p.build("sandbox", "rollout.sandbox")
    if takes_option(factory, "workspace_root"):  # the run's workspaces live under one folder that goes with it
        root = tempfile.mkdtemp(prefix="miles-workspaces-")
        os.chmod(root, 0o711)  # commands may run as another user (nobody, when Miles runs as root)
        closing.callback(shutil.rmtree, root, ignore_errors=True)
        factory = functools.partial(factory, workspace_root=root)
    hosted = isinstance(factory.func, type) and issubclass(factory.func, RemoteSandbox)
    if (hosted and "run_id" not in factory.keywords) or takes_option(factory, "run_id"):
        # Hosted sandboxes are tagged with the run, so that `miles sandbox gc` finds what a killed run left.
        factory = functools.partial(factory, run_id=f"{run_name}-{uuid.uuid4().hex[:8]}")
    sandbox_cls = factory.func
    if isinstance(sandbox_cls, DescribedSandbox):
        tag = f" (tagged miles-run={factory.keywords['run_id']})" if "run_id" in factory.keywords else ""
        print(f"rollout.sandbox: {sandbox_cls.describe(**factory.keywords)}{tag}", file=sys.stderr)
    if isinstance(sandbox_cls, HostedSandbox):  # what is still open at the end, on failure or Ctrl-C
        closing.callback(_close_sandboxes, plane, sandbox_cls, factory.keywords.get("run_id"))
    if isinstance(sandbox_cls, CheckedSandbox):  # an unreachable service fails the start, in bounded time
        try:
            plane.run(sandbox_cls.preflight(**factory.keywords))
        except Exception as exc:
            raise RunError(f"rollout.sandbox ({p.config.rollout.sandbox.name}): {exc}") from exc
    size = split_node(p.config.rollout.sandbox, "rollout.sandbox")[1]["pool"]
    if size == "auto":
        size = trajectories_at_once(p.config)
    if size:  # sandboxes started ahead for the next trajectories; the idle ones close with the run
        pool = SandboxPool(factory, size)
        closing.callback(lambda: plane.run(pool.aclose()))
        try:
            plane.run(pool.fill())
        except Exception as exc:
            raise RunError(f"rollout.sandbox ({p.config.rollout.sandbox.name}): pool: {exc}") from exc
        return pool
    return factory


def trajectories_at_once(config: Any) -> int:
    """The most trajectories a step's schedule runs at once (``rollout.sandbox.pool: auto``): one step's samples
    (``sync``, ``one_step_off``), or what ``async`` lets generate: ``max_concurrent_samples``, else
    ``max_staleness + 1`` steps' samples. More (a curriculum's extra rounds) get fresh sandboxes."""
    step = config.rollout.prompts_per_step * config.rollout.n_samples
    node = config.rollout["async"]
    if config.run.schedule != "async":
        return step
    return node.max_concurrent_samples or (node.max_staleness + 1) * step


def _close_sandboxes(plane: RolloutPlane, sandbox_cls: Any, run_id: str | None) -> None:
    """Delete the run's sandboxes still open, being created, or whose delete was cut short (Ctrl-C can stop
    the rollouts' event loop in the middle of their clean-up). With the run's id the run is over for the
    sandbox class: on a remote plane the rollouts still run on the plane's loop until it closes, and none of
    them creates a sandbox after this. A failure is reported, not raised: the rest of the closing goes on."""
    by_run = run_id is not None and takes_option(sandbox_cls.close_all, "run_id")
    try:
        plane.run(sandbox_cls.close_all(**({"run_id": run_id} if by_run else {})))
    except Exception as exc:
        print(f"miles: warning: rollout.sandbox: {exc}", file=sys.stderr)


def close_with_run(rollout_fn: Any, plane: RolloutPlane, closing: ExitStack) -> None:
    """A rollout function that holds something open (:class:`miles.hookspecs.ClosingRolloutFn`: e.g. the envs of
    trajectories waiting to be continued) is closed on the plane's loop when the run ends."""
    owner = getattr(rollout_fn, "func", rollout_fn)  # a registered function comes as a partial of its arguments
    if isinstance(owner, ClosingRolloutFn):
        closing.callback(lambda: plane.run(owner.aclose()))
