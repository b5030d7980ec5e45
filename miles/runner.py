"""Assembling a run from its config: plugins, data, model, engine, backend; then the phases.

``prepare`` loads and validates everything that can be checked before work starts;
``train`` runs the SFT warm-up (when configured), the RL steps and the evaluations.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from statistics import fmean
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from miles.config import load_config, validate_config
from miles.config.validate import component_node
from miles.errors import DataError
from miles.loop import Components, evaluate, rl_step, sft_step
from miles.models import build_model_dir, load_tokenizer
from miles.plugins import PluginManager, build_plugin_manager
from miles.registry import Registry
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import PromptSource, read_rows

__all__ = ["Prepared", "prepare", "train", "plugin_stack"]


class Prepared:
    def __init__(self, config: DictConfig, pm: PluginManager, registry: Registry) -> None:
        self.config, self.pm, self.registry = config, pm, registry

    def build(self, kind: str, key: str) -> Any:
        return self.registry.build(kind, component_node(OmegaConf.select(self.config, key)), key)


def prepare(config_path: str | Path | None, overrides: Sequence[str] = (), extra_plugins=()) -> Prepared:
    """Load the config, build the plugin manager and registry, validate every component."""
    config = load_config(config_path, overrides)
    pm = build_plugin_manager(config.run.plugins.allow, extra_plugins=extra_plugins)
    registry = Registry.from_plugin_manager(pm)
    validate_config(config, registry)
    pm.hook.miles_configure(config=config)
    validate_config(config, registry)
    return Prepared(config, pm, registry)


def plugin_stack(pm: PluginManager, registry: Registry) -> list[dict[str, Any]]:
    """Every plugin with its version and what it registered, by kind."""
    stack = []
    for name, info in pm.info.items():
        registered: dict[str, list[str]] = {}
        for kind in registry._entries:
            names = [e.name for e in registry.entries(kind) if e.plugin.name == name]
            if names:
                registered[kind] = names
        stack.append(
            {"name": name, "version": info.version, "distribution": info.distribution,
             "module": info.module, "builtin": info.builtin, "registered": registered}
        )
    return stack


def _progress(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, dynamic_ncols=True, leave=True)


def _prepare_data(p: Prepared, run_dir: Path) -> tuple[str, str | None]:
    cfg = p.config.data
    if cfg.generator is None:
        return cfg.train_path, cfg.eval_path
    generate = p.build("data_generator", "data.generator")
    splits = generate(int(p.config.run.seed))
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        paths[split] = data_dir / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    if "train" not in paths:
        raise DataError(f"data generator {cfg.generator.name!r} returned no 'train' split (got {', '.join(splits)})")
    return str(cfg.train_path or paths["train"]), str(cfg.eval_path or paths.get("eval") or "") or None


def _summary_text(summary: dict[str, Any]) -> str:
    lines = [f"Miles run finished: {summary['run_dir']}"]
    if "reward_start" in summary:
        lines.append(
            f"  train reward (mean of first/last {summary['reward_window']} steps): "
            f"{summary['reward_start']:.3f} -> {summary['reward_end']:.3f}"
        )
    if "eval_start" in summary:
        start, end = summary["eval_start"], summary["eval_end"]
        lines.append(
            f"  greedy accuracy on {summary['eval_prompts']} held-out prompts: "
            f"{start['eval/accuracy']:.3f} -> {end['eval/accuracy']:.3f}; on {summary['eval_train_prompts']} "
            f"training prompts: {start['eval/accuracy_train']:.3f} -> {end['eval/accuracy_train']:.3f}"
        )
    lines.append("  time per phase: " + ", ".join(f"{k} {v:.1f} s" for k, v in summary["time_s"].items()))
    lines.append(f"  final model: {summary['final_model']}")
    return "\n".join(lines)


def train(p: Prepared) -> dict[str, Any]:
    """Run every phase; returns the summary (also written to ``<run.dir>/summary.json``)."""
    config, pm, registry = p.config, p.pm, p.registry
    run_cfg = config.run
    seed = int(run_cfg.seed)
    run_dir = Path(run_cfg.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if run_cfg.torch_threads > 0:
        torch.set_num_threads(run_cfg.torch_threads)
    times: dict[str, float] = {}
    started = time.perf_counter()

    stack = plugin_stack(pm, registry)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(config))
    (run_dir / "run.json").write_text(json.dumps({"config": OmegaConf.to_container(config), "plugins": stack}, indent=1))
    pm.hook.miles_run_start(run_dir=str(run_dir), config=config, plugins=stack)

    train_path, eval_path = _prepare_data(p, run_dir)
    model_path = config.model.path
    if model_path is None:
        model_path = str(build_model_dir(config.model.build, config.model.tokenizer, run_dir / "init_model", seed))
    tokenizer = load_tokenizer(model_path)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data_cfg = config.data
    sft_enabled = config.sft.steps > 0
    source_args = dict(prompt_key=data_cfg.prompt_key, label_key=data_cfg.label_key,
                       chat_template=data_cfg.chat_template, seed=seed)
    train_rows = read_rows(train_path, data_cfg.prompt_key, data_cfg.label_key if sft_enabled else None)
    train_data = PromptSource(train_rows, tokenizer, shuffle=data_cfg.shuffle, **source_args)
    eval_prompts = []
    if eval_path and run_cfg.eval_size > 0:
        eval_rows = read_rows(eval_path, data_cfg.prompt_key, None)[: run_cfg.eval_size]
        eval_prompts = PromptSource(eval_rows, tokenizer, shuffle=False, **source_args).prompts
    times["setup"] = time.perf_counter() - started

    summary: dict[str, Any] = {"run_dir": str(run_dir), "plugins": stack}
    with ExitStack() as stack_cm:
        loggers = [registry.build("logger", component_node(node), f"run.loggers[{i}]") for i, node in enumerate(run_cfg.loggers)]
        for logger in loggers:
            logger.start(str(run_dir), config)
            stack_cm.callback(logger.close)

        if sft_enabled:
            phase_start = time.perf_counter()
            backend_node = {**component_node(config.backend), "lr": float(config.sft.lr)}
            backend = registry.build("backend", backend_node, "backend")
            backend.setup(model_path, seed=seed)
            sft_loss = p.build("loss", "sft.loss")
            sft_data = PromptSource(train_rows, tokenizer, shuffle=True, **{**source_args, "seed": seed + 1})
            with _progress(config.sft.steps, "sft", run_cfg.progress) as bar:
                for step in range(config.sft.steps):
                    metrics = sft_step(sft_data, tokenizer, config.sft.batch_size, backend, sft_loss, pad_token_id)
                    bar.update()
                    bar.set_postfix(loss=f"{metrics['train/loss']:.3f}")
            model_path = str(run_dir / "sft_model")
            backend.save_pretrained(model_path, tokenizer)
            backend.shutdown()
            pm.hook.miles_checkpoint_save(path=model_path, step=0)
            summary["sft_final_loss"] = metrics["train/loss"]
            times["sft"] = time.perf_counter() - phase_start

        final_model = model_path
        if run_cfg.steps > 0:
            phase_start = time.perf_counter()
            engine = p.build("rollout_engine", "rollout.engine")
            engine.load_model(model_path)
            backend = p.build("backend", "backend")
            backend.setup(model_path, seed=seed)
            sampling = OmegaConf.to_container(config.rollout.sampling)
            components = Components(
                pm=pm,
                train_data=train_data,
                rollout_fn=p.build("rollout_fn", "rollout.fn"),
                rollout_ctx=RolloutContext(engine=engine, tokenizer=tokenizer, sampling_params=sampling),
                engines=[engine],
                reward_fn=p.build("reward", "reward"),
                selectors=[registry.build("data_selector", component_node(n), f"selection[{i}]") for i, n in enumerate(config.selection)],
                advantage_fn=p.build("advantage", "advantage"),
                loss_fn=p.build("loss", "loss"),
                backend=backend,
                transport=p.build("weight_transport", "rollout.weight_sync"),
                pad_token_id=pad_token_id,
                prompts_per_step=config.rollout.prompts_per_step,
                n_samples=config.rollout.n_samples,
                max_failed_frac=run_cfg.max_failed_frac,
            )
            times["setup"] += time.perf_counter() - phase_start
            eval_ctx = RolloutContext(engine=engine, tokenizer=tokenizer,
                                      sampling_params={**sampling, "temperature": 0.0, "top_p": 1.0, "top_k": -1})

            train_eval_prompts = train_data.prompts[: run_cfg.eval_size]

            def run_eval() -> dict[str, float]:
                eval_start = time.perf_counter()
                args = (components.rollout_fn, eval_ctx, components.reward_fn, run_cfg.eval_pass_reward)
                result = evaluate(eval_prompts, *args)
                result.update({f"{k}_train": v for k, v in evaluate(train_eval_prompts, *args).items()})
                times["eval"] = times.get("eval", 0.0) + time.perf_counter() - eval_start
                return result

            if eval_prompts:
                summary["eval_start"] = run_eval()
                summary["eval_prompts"] = len(eval_prompts)
                summary["eval_train_prompts"] = len(train_eval_prompts)
            rewards: list[float] = []
            rl_start = time.perf_counter()
            with _progress(run_cfg.steps, "grpo" if config.advantage.name == "grpo" else "rl", run_cfg.progress) as bar:
                for step in range(run_cfg.steps):
                    metrics = rl_step(components, step)
                    if eval_prompts and run_cfg.eval_every and (step + 1) % run_cfg.eval_every == 0 and step + 1 < run_cfg.steps:
                        metrics.update(run_eval())
                    pm.hook.miles_train_step_end(step=step, metrics=metrics)
                    for logger in loggers:
                        logger.log(step, metrics)
                    rewards.append(metrics["reward/mean"])
                    bar.update()
                    bar.set_postfix(reward=f"{fmean(rewards[-10:]):.3f}")
            times["rl"] = time.perf_counter() - rl_start - times.get("eval", 0.0)
            if eval_prompts:
                summary["eval_end"] = run_eval()
                for logger in loggers:
                    logger.log(run_cfg.steps, summary["eval_end"])
            window = max(1, min(10, len(rewards) // 5))
            summary.update(reward_window=window, reward_start=fmean(rewards[:window]), reward_end=fmean(rewards[-window:]))
            final_model = str(run_dir / "final_model")
            backend.save_pretrained(final_model, tokenizer)
            backend.shutdown()
            pm.hook.miles_checkpoint_save(path=final_model, step=run_cfg.steps)

    summary["final_model"] = final_model
    times["total"] = time.perf_counter() - started
    summary["time_s"] = times
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    pm.hook.miles_run_end(run_dir=str(run_dir), summary=summary)
    print(_summary_text(summary))
    return summary
