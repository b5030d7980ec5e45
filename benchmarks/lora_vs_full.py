"""LoRA against full fine-tuning for RL from the same SFT model (the quickstart): reward per step, RL time,
parameters trained.

    python benchmarks/lora_vs_full.py [--steps 200] [--out /tmp/lora_bench] [--plot docs/images/lora_reward.png]

The start is the quickstart's full SFT warm-up (``run.steps=0``); then GRPO trains the whole model, and LoRA
adapters (rank 8, alpha 16, adapters sync) on it. One torch thread per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RUNS = {"full": [], "lora r8": ["backend.lora.rank=8", "backend.lora.alpha=16", "backend.lora.sync=adapters"]}
WINDOW = 10


def miles(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "miles", *args, "run.progress=false", "run.overwrite=true"],
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(f"miles {' '.join(args)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def rewards(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["reward/mean"] for r in rows if "reward/mean" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="/tmp/lora_bench")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    out = Path(args.out)
    miles("train", "configs/quickstart.yaml", f"run.dir={out / 'sft'}", "run.steps=0")
    start = out / "sft" / "sft_model"
    print(f"{'run':<10} {'reward first/last 10 steps':>28} {'greedy accuracy (train prompts)':>32} {'RL s':>6}")
    curves = {}
    for name, extra in RUNS.items():
        run_dir = out / name.replace(" ", "_")
        miles("train", "configs/quickstart.yaml", f"run.dir={run_dir}", f"model.path={start}", "sft.steps=0",
              f"run.steps={args.steps}", *extra)
        summary = json.loads((run_dir / "summary.json").read_text())
        curves[name] = rewards(run_dir)
        acc = f"{summary['eval_start']['eval/accuracy_train']:.3f} -> {summary['eval_end']['eval/accuracy_train']:.3f}"
        print(f"{name:<10} {summary['reward_start']:>13.3f} -> {summary['reward_end']:.3f}{acc:>32} "
              f"{summary['time_s']['rl']:>6.1f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        for name, values in curves.items():
            means = [sum(values[max(0, i - WINDOW + 1):i + 1]) / len(values[max(0, i - WINDOW + 1):i + 1])
                     for i in range(len(values))]
            ax.plot(range(1, len(means) + 1), means, label=name)
        ax.set_xlabel("RL step")
        ax.set_ylabel(f"train reward (mean of {WINDOW} steps)")
        ax.set_title("GRPO from the same SFT model: full weights and LoRA")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
