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


def ship_taught_head(model: Path, prompts: list[list[int]], answers: list[dict], weights: dict, out: Path,
                     seed: int, passes: int, lr: float) -> Path:
    """A copy of ``model`` in ``out`` shipping an MTP head (DeepSeek-V3's layout) that DraftLearner taught the
    model's ``answers`` to ``prompts`` (``passes`` passes towards its distribution: its ``weights``)."""
    import shutil
    import sys
    import time

    from safetensors.torch import save_file

    from miles.engine.speculative import SpeculativeConfig
    from miles.loop.draft import DraftLearner
    from miles.models.mtp import published_tensors
    from miles.types import Group, Sample, SampleStatus

    groups = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        sample = Sample(prompt_ids=list(prompt), group_index=i, status=SampleStatus.COMPLETED, reward=0.0)
        sample.append(answer["output_ids"], None, from_policy=True)
        groups.append(Group(index=i, samples=[sample]))

    class Policy:  # what the learner reads of a backend
        def export_weights(self) -> dict:
            return weights

    learner = DraftLearner(SpeculativeConfig.parse({"draft": "mtp", "train": True}), str(model), seed, lr=lr,
                           window=1)
    start = time.perf_counter()
    for n in range(passes):
        loss = learner.learn(groups, Policy())["rollout/spec_draft_loss"]
        print(f"  mtp head pass {n}: KL {loss:.4f} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    staging = out.with_name(out.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(model, staging)
    config = json.loads((staging / "config.json").read_text())
    save_file(published_tensors(learner.model, config["num_hidden_layers"]), str(staging / "mtp.safetensors"))
    (staging / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    staging.rename(out)
    return out
