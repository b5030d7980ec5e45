"""The training plane from the config: the backend, built the one way the runner, preflight and replay share."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf

from miles.config.validate import component_node, split_node
from miles.cluster import cores
from miles.hookspecs import NeedsValues, uses_ray
from miles.train.process_backend import ProcessBackend, TrainerProcess, separate_trainer

__all__ = ["build_backend", "setup_backend", "rl_backend", "start_trainer"]


def build_backend(p: Any, ray_cluster: Callable[[], Any] | None = None, *, where: str = "backend",
                  **overrides: Any) -> Any:
    """The configured backend (``p``: a :class:`miles.config.prepared.Prepared`), its node's arguments updated with
    ``overrides``. One that uses Ray gets ``cluster.train_resources``, and ``ray_cluster()`` starts or joins the
    cluster first; without ``ray_cluster`` it is only built (its constructor checks its options). ``where`` names
    the node in errors."""
    node = {**split_node(p.config.backend, "backend")[0], **overrides}  # without how it runs (separate_process)
    for key in ("qat", "precision"):  # a registered precision scheme: as its spec, which any process can build
        if isinstance(node.get(key), (str, dict)) and "path" not in node[key]:
            scheme = p.registry.build("precision", component_node(node[key]), f"{where}.{key}")
            node[key] = scheme.spec() if scheme is not None else None
    if ray_cluster is None or not uses_ray(p.registry.get("backend", node["name"]).obj):
        return p.registry.build("backend", node, where)
    ray_cluster()
    backend = p.registry.build("backend", node, where)
    backend.ray_resources = OmegaConf.to_container(p.config.cluster.train_resources)
    return backend


def setup_backend(p: Any, backend: Any, model_path: str, seed: int) -> None:
    """Load the policy (and the reference and value models the config needs) from ``model_path``."""
    reg = p.config.regularization
    estimator = p.registry.get("advantage", component_node(p.config.advantage)["name"]).obj
    needs_values = isinstance(estimator, NeedsValues) and estimator.needs_values
    backend.setup(model_path, seed=seed, total_steps=p.config.run.steps,
                  **({"ref_model_path": model_path} if reg.kl_coef > 0 else {}),
                  # A value model starts from the policy's checkpoint with a new scalar head.
                  **({"critic_model_path": model_path} if needs_values else {}))


def trainer_threads(config: Any) -> int:
    """Torch threads of a trainer in a process of its own: ``run.torch_threads``, else half the cores."""
    return config.run.torch_threads if config.run.torch_threads > 0 else max(1, cores() // 2)


def start_trainer(p: Any) -> TrainerProcess | None:
    """The trainer's process, started now when the RL phase will train in one (``backend.separate_process``), so
    that its start-up overlaps what comes before (the SFT phase, the engine's start); None otherwise."""
    config = p.config
    if config.run.steps <= 0 or config.run.rollout_only or not separate_trainer(config, p.registry):
        return None
    return TrainerProcess(trainer_threads(config))


def rl_backend(p: Any, ray_cluster: Callable[[], Any], closing: Any, model_path: str, seed: int,
               remote: bool, process: TrainerProcess | None = None) -> Any:
    """The policy's backend for RL, set up from ``model_path``; with engines on Ray (``remote``) and the sync
    schedule, a backend that does not use Ray itself trains in an actor; with ``backend.separate_process``, in a
    child process (:mod:`miles.train.process_backend`; ``process``, when :func:`start_trainer` started it).
    ``closing`` shuts it down."""
    config = p.config
    overrides = {"exact_logprobs": True} if config.rollout.true_on_policy else {}  # as the engine computes them
    backend = build_backend(p, ray_cluster, **overrides)
    if separate_trainer(config, p.registry):
        backend = ProcessBackend(backend, threads=trainer_threads(config), process=process)
        closing.callback(backend.shutdown)
        print(f"backend.separate_process: the trainer runs in process {backend.pid}", file=sys.stderr)
        setup_backend(p, backend, model_path, seed)
        return backend
    # On Ray, the synchronous loop's training plane is an actor too. A streaming schedule trains here, beside the
    # rollout loop's thread: measured on the quickstart, 50 ms a step against 65 ms through an actor.
    if remote and not uses_ray(backend) and config.run.schedule == "sync":
        from miles.train.ray_backend import launch_backend

        backend = launch_backend(ray_cluster().ray, backend, cpus=config.cluster.train_cpus,
                                 startup_timeout_s=config.cluster.engine_startup_timeout_s,
                                 resources=OmegaConf.to_container(config.cluster.train_resources))
    closing.callback(backend.shutdown)
    setup_backend(p, backend, model_path, seed)
    return backend
