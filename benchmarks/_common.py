"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import fmean

from miles.run.runner import prepare, train

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml")
ROLLING = 10


def sft_checkpoint(run_dir: Path, seed: int, config: str = CONFIG) -> tuple[Path, Path]:
    """A recipe's SFT model (the quickstart's unless ``config``) made by Miles' own recipe, and its training data
    file."""
    train(prepare(config, [f"run.dir={run_dir}", "run.steps=0", "run.progress=false", f"run.seed={seed}"]))
    return run_dir / "sft_model", run_dir / "data" / "train.jsonl"


def miles_grpo_phase(model_dir: Path, train_file: Path, run_dir: Path, overrides: list[str],
                     config: str = CONFIG) -> list[dict]:
    """Per-step metrics of a recipe's RL phase (the quickstart's unless ``config``) from ``model_dir``."""
    train(prepare(config, [f"run.dir={run_dir}", f"model.path={model_dir}", f"data.train_path={train_file}",
                           "sft.steps=0", "run.eval_size=0", "run.progress=false", *overrides]))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def first_reach(rewards: list[float], times: list[float], target: float) -> tuple[int, float] | None:
    """The first step (1-based) whose rolling mean reward reaches ``target``, and the wall time up to it."""
    for step in range(ROLLING, len(rewards) + 1):
        if fmean(rewards[step - ROLLING: step]) >= target:
            return step, sum(times[:step])
    return None
