"""Peer comparison: the quickstart's GRPO phase in Miles against TRL's ``GRPOTrainer``.

Both start from the same SFT checkpoint (made by Miles' own SFT recipe) and train on the same
prompts ("3+4=" -> "7", exact-match reward) with the same settings: 16 prompts x 8 samples per step,
max 4 new tokens, temperature 1.0, group-normalized advantages, PPO clip 0.2 on both sides and
token-mean over the batch (TRL ``loss_type="dapo"``, which with one process and no gradient
accumulation divides by the batch's completion tokens, like Miles' ``ppo_clip``), no KL term,
AdamW at lr 1e-3 with a constant schedule, gradient clipping at 1.0, one optimizer step per batch,
fp32 on CPU with one torch thread.

Step time is the optimizer step's own work on both sides: Miles' ``time/step_s`` (rollout, reward,
train step, weight sync) and, for TRL, on_step_begin to on_step_end (generation, reward, loss,
backward, optimizer step). Model loading and SFT are not timed. Prints median and total step time,
the reward curve, when each first reaches a rolling-10 mean reward of 0.5, and Miles / TRL ratios.

Differences TRL does not let us remove: its advantage divides by ``std + 1e-4`` (Miles: ``1e-6``),
its old log-probs are the trainer's own detached ones (Miles: the engine's, equal up to numerics),
it samples with ``model.generate`` and its own RNG streams, so the two reward curves are two
samples of the same process rather than the same trajectory.

    pip install -e '.[bench]'
    HF_HUB_OFFLINE=1 python benchmarks/trl_peer.py [--steps 200] [--seed 0] [--skip-trl] [--skip-miles]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from statistics import fmean, median

import torch

from _common import ROLLING, first_reach, miles_grpo_phase, sft_checkpoint

TARGETS, WINDOW = (0.5, 0.7), 20
Curve = tuple[list[float], list[float]]  # per-step rewards, per-step wall times (s)


def miles_grpo(model_dir: Path, train_file: Path, run_dir: Path, steps: int, seed: int) -> Curve:
    """Per-step rewards and wall times of Miles' runner on the quickstart config."""
    rows = miles_grpo_phase(model_dir, train_file, run_dir, [f"run.steps={steps}", f"run.seed={seed}"])
    return [r["reward/mean"] for r in rows], [r["time/step_s"] for r in rows]


def trl_grpo(model_dir: Path, train_file: Path, out_dir: Path, steps: int, seed: int) -> Curve:
    """Per-step rewards and wall times of TRL's GRPOTrainer with the quickstart's settings."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    def exact_match(completions: list[str], label: list[str], **kwargs) -> list[float]:
        return [float(c.strip() == str(target).strip()) for c, target in zip(completions, label)]

    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, seed=seed, use_cpu=True, bf16=False, fp16=False,
        activation_checkpointing=False, per_device_train_batch_size=16 * 8, num_generations=8,
        gradient_accumulation_steps=1, num_iterations=1, max_completion_length=4, temperature=1.0,
        optim="adamw_torch", learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", use_vllm=False,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        reward_funcs=exact_match, args=config, callbacks=[timer],
        train_dataset=Dataset.from_list([json.loads(line) for line in train_file.read_text().splitlines()]),
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    return rewards, timer.times


def row(label: str, cells: list[str]) -> None:
    print(f"  {label:<34}" + "".join(f"{c:>20}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-miles", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir, train_file = sft_checkpoint(tmp / "sft", args.seed)
        results = {}
        if not args.skip_miles:
            results["miles"] = miles_grpo(model_dir, train_file, tmp / "miles", args.steps, args.seed)
        if not args.skip_trl:
            results["trl"] = trl_grpo(model_dir, train_file, tmp / "trl", args.steps, args.seed)
    if not results:
        return

    names = list(results)
    print(f"\nGRPO phase, {args.steps} steps of 16 prompts x 8 samples, seed {args.seed}:")
    row("", names)
    row("median step time", [f"{1000 * median(times):.1f} ms" for _, times in results.values()])
    row("total time of the GRPO steps", [f"{sum(times):.2f} s" for _, times in results.values()])
    reached = {target: {name: first_reach(*results[name], target) for name in names} for target in TARGETS}
    for target, by_name in reached.items():
        row(f"first rolling-{ROLLING} reward >= {target}",
            [f"step {r[0]} at {r[1]:.2f} s" if r else "not reached" for r in by_name.values()])
    if len(names) == 2:
        (_, miles_times), (_, trl_times) = results["miles"], results["trl"]
        for target, by_name in reached.items():
            ratio = (f"{by_name['miles'][1] / by_name['trl'][1]:.3f}"
                     if by_name["miles"] and by_name["trl"] else "n/a (not reached by both)")
            print(f"  ratio miles / trl, time to reward {target}: {ratio}")
        print(f"  ratio miles / trl, total time: {sum(miles_times) / sum(trl_times):.3f}")
    print(f"\nmean reward per {WINDOW} steps:")
    row("steps", names)
    for start in range(0, args.steps, WINDOW):
        row(f"{start + 1}-{min(start + WINDOW, args.steps)}",
            [f"{fmean(rewards[start : start + WINDOW]):.3f}" for rewards, _ in results.values()])


if __name__ == "__main__":
    main()
