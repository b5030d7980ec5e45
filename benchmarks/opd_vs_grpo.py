"""On-policy distillation against GRPO from the same start (configs/opd.yaml): steps and wall time to a
train reward of 0.7 (the mean of 20 steps), and where each ends.

    python benchmarks/opd_vs_grpo.py [--steps 300] [--out /tmp/opd_bench]

Trains the teacher first (configs/sft.yaml with a larger model), then three students from the quickstart's
SFT warm-up: GRPO (distill.teacher=null), distillation alone (reward_coef 0) and distillation plus the
reward's advantages (reward_coef 1). One torch thread per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TEACHER = ["sft.steps=600", "model.build.hidden_size=128", "model.build.num_layers=4", "model.build.head_dim=32",
           "model.build.intermediate_size=512"]
WINDOW, TARGET = 20, 0.7


def miles(*args: str) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "miles", *args, "run.progress=false", "run.overwrite=true"],
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(f"miles {' '.join(args)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def to_target(run_dir: Path) -> tuple[int | None, float | None, float]:
    """(steps until the 20-step mean reward first reaches 0.7, the RL seconds they took, the last 20 steps' mean)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    rewards, seconds = [r["reward/mean"] for r in rows], [r["time/step_s"] for r in rows]
    for end in range(WINDOW, len(rewards) + 1):
        if sum(rewards[end - WINDOW:end]) / WINDOW >= TARGET:
            return end, sum(seconds[:end]), sum(rewards[-WINDOW:]) / WINDOW
    return None, None, sum(rewards[-WINDOW:]) / WINDOW


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="/tmp/opd_bench")
    parser.add_argument("--plot", default=None, help="also draw the three reward curves to this PNG")
    args = parser.parse_args()
    out = Path(args.out)
    teacher_s = miles("train", "configs/sft.yaml", f"run.dir={out / 'teacher'}", *TEACHER)
    teacher = out / "teacher" / "sft_model"
    print(f"teacher: {teacher_s:.0f} s to train ({' '.join(TEACHER)})")
    print(f"{'student':<24} {'steps to 0.7':>12} {'RL time to 0.7':>15} {'RL time/step':>13} {'last 20 steps':>14}")
    for name, extra in (("grpo", ["distill.teacher=null"]), ("opd", []), ("opd + reward", ["distill.reward_coef=1.0"])):
        run_dir = out / name.replace(" + ", "_")
        miles("train", "configs/opd.yaml", f"run.dir={run_dir}", f"distill.teacher={teacher}",
              f"run.steps={args.steps}", *extra)
        steps, seconds, last = to_target(run_dir)
        per_step = json.loads((run_dir / "summary.json").read_text())["time_s"]["rl"] / args.steps
        reached = (f"{steps:>12} {seconds:>14.1f}s" if steps is not None else f"{'not reached':>12} {'-':>15}")
        print(f"{name:<24} {reached} {per_step * 1000:>11.0f}ms {last:>14.3f}")
    if args.plot:
        plot(out, args.plot)


def plot(out: Path, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for name in ("grpo", "opd", "opd_reward"):
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
        means = [sum(rewards[max(0, i - WINDOW + 1):i + 1]) / len(rewards[max(0, i - WINDOW + 1):i + 1])
                 for i in range(len(rewards))]
        ax.plot(range(1, len(means) + 1), means, label={"grpo": "GRPO", "opd": "distillation",
                                                         "opd_reward": "distillation + reward"}[name])
    ax.axhline(TARGET, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"train reward (mean of {WINDOW} steps)")
    ax.set_title("configs/opd.yaml: the student from the same start")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
