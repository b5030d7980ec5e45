"""What ``rollout.true_on_policy`` costs: the quickstart's GRPO phase with and without it, paired and alternated.

The engine computes each answer's log-probs again, one sequence at a time at the context length, and the trainer
computes its log-probs the same way (one sequence at a time instead of one padded batch), so that both are
bit-identical. Prints the RL phase's seconds per step, the ratio, and the largest engine/trainer log-prob gap.

    python benchmarks/true_on_policy.py [--steps 30] [--pairs 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from statistics import fmean

import torch

from _common import CONFIG
from miles.run.runner import prepare, train


def run(root: Path, name: str, steps: int, true_on_policy: bool) -> tuple[float, float]:
    run_dir = root / name
    overrides = [f"run.dir={run_dir}", f"run.steps={steps}", "run.eval_size=0", "run.progress=false",
                 f"rollout.true_on_policy={str(true_on_policy).lower()}"]
    summary = train(prepare(CONFIG, overrides))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary["time_s"]["rl"] / steps, max(r["train/logprob_abs_diff_max"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    times: dict[bool, list[float]] = {False: [], True: []}
    gaps: dict[bool, float] = {False: 0.0, True: 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for mode in ((False, True) if i % 2 == 0 else (True, False)):
                per_step, gap = run(Path(tmp), f"{i}-{mode}", args.steps, mode)
                times[mode].append(per_step)
                gaps[mode] = max(gaps[mode], gap)
    for mode in (False, True):
        print(f"true_on_policy={str(mode).lower():<5}  RL s/step {fmean(times[mode]):.3f}  "
              f"(runs: {', '.join(f'{t:.3f}' for t in times[mode])})  max |engine - trainer| log-prob {gaps[mode]:.3g}")
    print(f"cost: {fmean(times[True]) / fmean(times[False]):.2f}x the default's RL step time")


if __name__ == "__main__":
    main()
