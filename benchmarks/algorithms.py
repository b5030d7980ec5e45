"""Every advantage estimator on the quickstart, with and without dynamic sampling.

All runs start from the same SFT checkpoint (Miles' SFT recipe) and train the quickstart's GRPO
phase (16 prompts x 8 samples per step, 200 steps, its loss and backend) with ``advantage.name``
set to each estimator, which brings its own loss defaults (gspo: sequence ratio; dr_grpo: constant
normaliser; ppo: a value model). Prints, for each, the step and wall time at which the rolling-10 training reward first
reaches 0.5 and 0.7, the final reward, and the samples generated (dynamic sampling generates more
per step to keep the batch full).

    python benchmarks/algorithms.py [--steps 200] [--seed 0] [--estimators grpo,rloo] [--max-extra-rounds 4]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from statistics import fmean

import torch

from _common import first_reach, miles_grpo_phase, sft_checkpoint

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "ppo")
TARGETS = (0.5, 0.7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--estimators", default=",".join(ESTIMATORS))
    parser.add_argument("--max-extra-rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    header = ["estimator", "dynamic sampling", *(f"reward {t}: step, time" for t in TARGETS), "final reward",
              "samples", "wall time"]
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir, train_file = sft_checkpoint(tmp / "sft", args.seed)
        for estimator in args.estimators.split(","):
            for dynamic in (False, True):
                selection = (f"selection=[{{name: dynamic_sampling, max_extra_rounds: {args.max_extra_rounds}}}]"
                             if dynamic else "selection=[]")
                rows = miles_grpo_phase(model_dir, train_file, tmp / f"{estimator}-{dynamic}", [
                    f"advantage.name={estimator}", selection, f"run.steps={args.steps}", f"run.seed={args.seed}"])
                rewards, times = [r["reward/mean"] for r in rows], [r["time/step_s"] for r in rows]
                cells = [estimator, "yes" if dynamic else "no"]
                for target in TARGETS:
                    reached = first_reach(rewards, times, target)
                    cells.append(f"{reached[0]}, {reached[1]:.1f} s" if reached else "not reached")
                cells += [f"{fmean(rewards[-10:]):.3f}", str(sum(r["samples/total"] for r in rows)),
                          f"{sum(times):.1f} s"]
                print(" | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
