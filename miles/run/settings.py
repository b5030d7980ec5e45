"""The start-up checks that read neither the model nor the data: the run directory, the backend's options, the
batch arithmetic, the CPUs a local Ray instance needs, the LoRA settings. They import no torch, so plain
``miles config`` makes them in under a second; :func:`miles.run.preflight.preflight` makes them first, then the
checks that load the model."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

from miles.config.validate import component_node, split_node
from miles.errors import ConfigError, DataError
from miles.hookspecs import LoraEngine, uses_ray
from miles.rollout.data_source import data_file_problem
from miles.run.hub import is_hub_data, local_model_problem
from miles.run.lock import LOCK_NAME
from miles.run.placement import refused_pairs
from miles.train.assemble import build_backend

__all__ = ["batch_arithmetic", "check_cpus", "check_eval_paths", "check_lora", "check_paths", "check_run_dir",
           "check_settings", "lora_options", "ray_reservation", "shown_config", "trial_backends"]


def check_run_dir(run_cfg: Any) -> Path:
    run_dir = Path(run_cfg.dir)
    if run_cfg.resume and run_cfg.overwrite:
        raise ConfigError("run.resume and run.overwrite are both true: resume continues the run in run.dir, "
                          "overwrite deletes it; choose one")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir {str(run_dir)!r} is a file; expected a directory for the run's outputs")
    holds_a_run = run_dir.is_dir() and any(entry.name != LOCK_NAME for entry in run_dir.iterdir())
    if holds_a_run and not (run_cfg.resume or run_cfg.overwrite):
        raise ConfigError(
            f"run.dir {str(run_dir)!r} already holds a run. Continue it with run.resume=true, or start a new "
            f"one in another directory (run.dir=...), or replace it with run.overwrite=true")
    return run_dir


def trial_backends(p: Any) -> Any:
    """Build the backend nodes (cheap: no model is loaded) so that their option checks run now."""
    backend = build_backend(p)
    if p.config.sft.steps > 0:
        build_backend(p, where="backend (with sft.lr)", lr=float(p.config.sft.lr))
    return backend


def batch_arithmetic(config: Any) -> str:
    """The step's batch arithmetic in words, for the start-up line; a combination that cannot be planned is a
    :class:`ConfigError` naming the keys. Checked on the nominal sizes (selectors may keep fewer groups)."""
    prompts, n = int(config.rollout.prompts_per_step), int(config.rollout.n_samples)
    backend = component_node(config.backend)
    minis, epochs = int(backend.get("mini_batches", 1)), int(backend.get("epochs", 1))
    parallel = [int(backend.get(k, 1)) for k in ("tensor_parallel", "pipeline_parallel", "context_parallel")]
    workers = max(1, int(backend.get("world_size", 1)) // math.prod(parallel))  # data-parallel ranks
    if minis > 1 and prompts % minis:
        divisors = ", ".join(str(d) for d in range(1, prompts + 1) if prompts % d == 0)
        raise ConfigError(f"backend.mini_batches={minis} does not divide rollout.prompts_per_step={prompts}: each "
                          f"mini-batch must hold whole groups (a prompt's {n} samples are scored against each other); "
                          f"use one of {divisors}")
    per_mini = prompts // minis * n
    if per_mini < workers:
        raise ConfigError(f"backend.world_size: {workers} data-parallel workers for mini-batches of {per_mini} samples "
                          f"(rollout.prompts_per_step={prompts} x rollout.n_samples={n} / "
                          f"backend.mini_batches={minis}); "
                          f"every worker needs at least one sample: fewer workers or mini-batches, or more prompts")
    steps = minis * epochs
    text = (f"batch: {prompts} prompts x {n} samples = {prompts * n} samples per step; {minis} mini-batch"
            f"{'es' if minis > 1 else ''} of {per_mini} x {epochs} epoch{'s' if epochs > 1 else ''} = "
            f"{steps} optimizer step{'s' if steps > 1 else ''} per rollout")
    if steps > 1:
        text += (f"; the last trains on samples from a policy {steps - 1} optimizer "
                 f"step{'s' if steps > 2 else ''} older (train/policy_lag_max)")
    return text


def ray_reservation(config: Any, backend: Any) -> tuple[int, float]:
    """(engine actors, logical CPUs for training) that the run reserves on Ray; (0, 0) when it uses no Ray."""
    _, extra = split_node(config.rollout.engine, "rollout.engine")
    engines = 0 if config.cluster.local_mode else extra.get("num_engines", 0)  # local_mode: the engine in process
    if uses_ray(backend):
        return engines, float(backend.ray_cpus)
    return engines, config.cluster.train_cpus if engines > 0 else 0.0


def check_cpus(config: Any, backend: Any) -> int | None:
    """The CPU count for a local Ray instance; refuse an explicit one that cannot place the run."""
    cluster = config.cluster
    engines, train = ray_reservation(config, backend)
    need = engines * cluster.cpus_per_engine + train
    if need == 0 or cluster.address:  # no Ray, or a cluster whose size is known only once joined
        return None
    if cluster.num_cpus is None:  # logical CPUs: processes share the cores when there are fewer
        return max(os.cpu_count() or 1, math.ceil(need))
    if cluster.num_cpus < need:
        raise ConfigError(
            f"cluster.num_cpus={cluster.num_cpus} cannot place this run: {engines} engine(s) x "
            f"cluster.cpus_per_engine={cluster.cpus_per_engine} + {train:g} for training (cluster.train_cpus, or the "
            f"backend's workers) = {need:g} CPUs. Raise cluster.num_cpus to {math.ceil(need)} (or leave it unset), "
            f"or lower rollout.engine.num_engines, cluster.cpus_per_engine or cluster.train_cpus")
    return int(cluster.num_cpus)


def lora_options(p: Any) -> Any:
    """The parsed ``backend.lora`` (``miles.train.lora.LoraOptions``), or None: none set, or refused already by the
    backend's constructor, whose message names what is wrong."""
    from miles.train.lora import parse_lora

    try:
        return parse_lora(component_node(p.config.backend).get("lora"))
    except ValueError:
        return None


def check_lora(p: Any) -> None:
    """``backend.lora`` with ``sync: adapters``: the engines can take adapter payloads (the embedded engine; not SGLang
    servers) and keep their base weights. On a model built at random, a warning: adapters on it learn little."""
    options = lora_options(p)
    if options is None:
        return
    if p.config.model.path is None:  # built at random: adapters on it learn little
        print(f"backend.lora: warning: the model is built at random (model.build, no model.path), and LoRA trains only "
              f"small adapters on it{' from the SFT warm-up on' if p.config.sft.steps > 0 else ''}: they learn little "
              f"(the quickstart: train reward 0.015 -> 0.020 in 200 steps). Train a base model first, then adapters "
              f"on it: `miles train CONFIG run.steps=0 run.dir=runs/sft`, then `miles train CONFIG "
              f"model.path=runs/sft/sft_model sft.steps=0 backend.lora.rank=8` (docs/lora.md: 0.488 -> 0.602)",
              file=sys.stderr)
    if options.sync != "adapters":
        return
    engine_args, extra = split_node(p.config.rollout.engine, "rollout.engine")
    engine = p.registry.get("rollout_engine", engine_args["name"]).obj
    if not (isinstance(engine, LoraEngine) and engine.accepts_lora_adapters):
        raise ConfigError(f"backend.lora.sync: adapters needs engines that merge LoRA adapters into the base weights "
                          f"they keep (the embedded engine 'local'); rollout.engine {engine_args['name']!r} cannot "
                          f"take them (SGLang servers load full weights): use backend.lora.sync=merged")
    if extra["release_memory_during_train"]:
        raise ConfigError("backend.lora.sync: adapters merges into base weights the engine keeps, and "
                          "rollout.engine.release_memory_during_train gives them back during training: use "
                          "backend.lora.sync=merged, or keep the engine's memory")


def check_paths(config: Any) -> None:
    """The model and data files the config names are there (a Hub id or dataset is looked up later, when fetched)."""
    if config.model.path is not None and (problem := local_model_problem(str(config.model.path))):
        raise ConfigError(problem)
    named = [(f"data.{key}", config.data[key]) for key in ("train_path", "eval_path")]
    named += [(f"eval.datasets[{i}] ({ds.name}).path", ds.path) for i, ds in enumerate(config.eval.datasets)]
    for key, path in named:
        if path is not None and not is_hub_data(str(path)) and (problem := data_file_problem(str(path))):
            raise DataError(f"{key}: {problem}")


def check_eval_paths(config: Any, model_dir: str) -> None:
    """``miles eval``'s files, checked before torch is imported: those the config names, and ``--model``."""
    check_paths(config)
    if problem := local_model_problem(model_dir, "--model"):
        raise ConfigError(problem)


def shown_config(config: Any) -> str:
    """The resolved config as ``miles config`` prints it: with ``model.path`` set, without ``model.build`` and
    ``model.tokenizer`` (a built model's), and a line that says so."""
    from omegaconf import OmegaConf

    shown = OmegaConf.to_container(config, resolve=False)
    if shown["model"]["path"] is None:
        return OmegaConf.to_yaml(shown)
    del shown["model"]["build"], shown["model"]["tokenizer"]
    return ("# model.build and model.tokenizer are a built model's: not shown, model.path is set\n"
            + OmegaConf.to_yaml(shown))


def check_settings(p: Any) -> tuple[Path, int | None]:
    """The checks that read neither model nor data (``miles config`` makes these only; they import no torch): the
    run directory, the files it names, the backend's options, the batch arithmetic, the CPUs. Returns (run.dir, CPUs
    for local Ray)."""
    run_dir = check_run_dir(p.config.run)
    check_paths(p.config)
    backend = trial_backends(p)
    if component_node(p.config.backend).get("routing_replay", False) and not p.config.rollout.return_routed_experts:
        raise ConfigError("backend.routing_replay: replaying the engine's expert choices needs them in the samples; "
                          "set rollout.return_routed_experts: true")
    check_lora(p)
    refused_pairs(p)
    if p.config.run.steps > 0:
        batch_arithmetic(p.config)
    return run_dir, check_cpus(p.config, backend)
