"""A run's phases: the checks before anything is written, the SFT warm-up (when configured), the RL phase
(:mod:`miles.run.rl`) and the summary. ``prepare`` (:mod:`miles.config.prepared`) loads and validates the config;
``train`` runs the phases; ``evaluate_model`` is ``miles eval``.

Each plane is assembled by a module of its own: :mod:`miles.rollout.assemble` (engines, rollout context),
:mod:`miles.train.assemble` (the backend), :class:`miles.loop.learner.Learner` (advantage, loss, KL penalty).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from miles.config.prepared import Prepared, prepare
from miles.config.validate import component_node
from miles.loop.evaluation import evaluate_sets
from miles.loop.sft import sft_step
from miles.registry import plugin_stack
from miles.rollout.assemble import close_with_run, rollout_context, rollout_plane
from miles.rollout.data_source import PromptSource
from miles.run.lock import RunDirLock
from miles.run.preflight import Staged, chat_format, eval_inputs, preflight
from miles.run.settings import batch_arithmetic
from miles.run.progress import progress
from miles.run.rl import RLPhase
from miles.run.state import RunState, start_loggers
from miles.train.assemble import build_backend, start_trainer

__all__ = ["Prepared", "prepare", "train", "evaluate_model"]


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


def _pad_token_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _sft_phase(run: RunState, model_path: str) -> str:
    """Supervised warm-up on prompt/label pairs; returns the checkpoint RL starts from."""
    config, start = run.p.config, time.perf_counter()
    # SFT data has no engine routing to replay
    overrides = {"routing_replay": False} if component_node(config.backend).get("routing_replay") else {}
    if config.rollout.true_on_policy:  # SFT trains on data, not on the engine's samples: the usual batched forward
        overrides["exact_logprobs"] = False
    backend = build_backend(run.p, run.ray_cluster, lr=float(config.sft.lr), **overrides)
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


def evaluate_model(p: Prepared, model_dir: str) -> dict[str, float]:
    """``miles eval``: the eval section's datasets (see :func:`miles.run.preflight.eval_inputs`) on the model in
    ``model_dir``, with the config's engine, rollout function, env and reward; nothing is trained or written."""
    config = p.config
    tokenizer, sets = eval_inputs(p, model_dir)
    with ExitStack() as closing, tempfile.TemporaryDirectory(prefix="miles-eval-") as scratch:
        run = RunState(p, Path(scratch) / "eval", int(config.run.seed), plugin_stack(p.pm, p.registry), tokenizer,
                       pad_token_id=_pad_token_id(tokenizer), train_prompts=[], eval_prompts=[], loggers=[],
                       eval_sets=sets, closing=closing, chat_format=chat_format(p, tokenizer, model_dir))
        run.run_dir.mkdir()
        transport = p.build("weight_transport", "rollout.weight_sync")
        plane = rollout_plane(p, model_dir, transport, run.ray_cluster, closing)
        ctx = rollout_context(p, plane, tokenizer, model_dir, run.chat_format, run.seed, run.run_dir.name, closing)
        rollout_fn = p.build("rollout_fn", "rollout.fn")
        close_with_run(rollout_fn, plane, closing)
        return evaluate_sets(sets, rollout_fn, ctx, p.build("reward", "reward"))


def train(p: Prepared) -> dict[str, Any]:
    """Run every phase; returns the summary (also written to ``<run.dir>/summary.json``).

    Every check runs first (:func:`miles.run.preflight.preflight`); ``run.dir`` changes only after all passed.
    The run holds ``run.dir`` (:class:`miles.run.lock.RunDirLock`) from before its checks to its end.
    """
    run_cfg, started = p.config.run, time.perf_counter()
    stack = plugin_stack(p.pm, p.registry)
    with RunDirLock(Path(run_cfg.dir)) as lock, ExitStack() as trainer:
        process = start_trainer(p)  # it starts up while the checks and the SFT phase run
        if process is not None:
            trainer.callback(process.stop)  # never used (a check failed): ended here
        staged = preflight(p, stack)
        staged.commit(overwrite=bool(run_cfg.overwrite))
        lock.keep()
        return _train(p, staged, stack, started, process)


def _train(p: Prepared, staged: Staged, stack: list[dict[str, Any]], started: float,
           trainer_process: Any = None) -> dict[str, Any]:
    config, run_cfg = p.config, p.config.run
    seed = int(run_cfg.seed)
    run_dir, model_path, tokenizer = staged.run_dir, staged.model_path, staged.tokenizer
    torch.manual_seed(seed)
    if run_cfg.torch_threads > 0:
        torch.set_num_threads(run_cfg.torch_threads)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(config))
    (run_dir / "run.json").write_text(json.dumps({"config": OmegaConf.to_container(config), "plugins": stack},
                                                 indent=1))
    p.pm.hook.miles_run_start(run_dir=str(run_dir), config=config, plugins=stack)

    with ExitStack() as closing:
        loggers = start_loggers(p, run_dir, closing)
        run = RunState(
            p, run_dir, seed, stack, tokenizer, pad_token_id=_pad_token_id(tokenizer),
            train_prompts=staged.train_prompts, eval_prompts=staged.eval_prompts, loggers=loggers, closing=closing,
            eval_sets=staged.eval_sets, ray_num_cpus=staged.ray_num_cpus, base_model=model_path,
            resume_from=staged.resume_from, chat_format=staged.chat_format,
            summary={"run_dir": str(run_dir), "plugins": stack, **{k: v for k, v in staged.data_stats.items() if v}},
        )
        run.timed("setup", started)
        run.trainer_process = trainer_process
        if run.resume_from is not None:
            print(f"run.resume: continuing from {run.resume_from.path} ({run.resume_from.step} steps done)",
                  file=sys.stderr)
            model_path = run.resume_from.state["start_model"]  # the SFT phase (if any) finished before it
        elif config.sft.steps > 0:
            model_path = _sft_phase(run, model_path)
        if run_cfg.steps > 0:
            print(batch_arithmetic(config), file=sys.stderr)
            model_path = RLPhase(run, model_path).run_steps()

    summary = run.summary
    summary["final_model"] = model_path
    summary["time_s"] = {**run.times, "total": time.perf_counter() - started}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    p.pm.hook.miles_run_end(run_dir=str(run_dir), summary=summary)
    print(_summary_text(summary))
    return summary
