"""A draft that keeps up: the acceptance of speculative proposals over a GRPO run, with and without draft training.

The quickstart's RL phase from its SFT model, the draft starting as that same SFT model (so that it agrees with
the policy at step 0), speculating at every step. Without ``speculative.train`` the draft stays the step-0 policy
and its proposals are kept less often as the policy learns; with it, the draft learns each step's rollouts and
its acceptance holds. Prints the acceptance every ``--every`` steps (means over the steps since the last row).

``--draft mtp``: the draft is an MTP head on the policy (``draft: mtp``) instead, taught the SFT model first (its
samples on the training prompts, ``--head-passes`` passes) and shipped in the SFT checkpoint, as a published model
ships its head.

    python benchmarks/speculative_training.py [--steps 200] [--seed 0] [--lr 3e-4] [--window 8] [--draft mtp]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from statistics import fmean

import torch

from _common import miles_grpo_phase, sft_checkpoint, ship_taught_head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--window", type=int, default=8, help="speculative.train_window: steps of rollouts learnt")
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--policy-lr", type=float, default=None, help="backend.lr (the quickstart's by default)")
    parser.add_argument("--draft", choices=("model", "mtp"), default="model")
    parser.add_argument("--head-passes", type=int, default=10, help="--draft mtp: passes teaching it the SFT model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, data = sft_checkpoint(root / "sft", args.seed)
        draft = f"{{path: {model}}}"
        if args.draft == "mtp":
            model, draft = with_taught_head(model, data, root / "sft_mtp", args.seed, args.head_passes), "mtp"
        runs = {}
        for train in (False, True):
            spec = (f"{{draft: {draft}, num_tokens: 2, when: always, force: true, "
                    f"train: {str(train).lower()}, lr: {args.lr}, train_window: {args.window}}}")
            rows = miles_grpo_phase(model, data, root / f"train-{train}", [
                f"run.steps={args.steps}", f"run.seed={args.seed}", f"rollout.engine.speculative={spec}",
                *([f"backend.lr={args.policy_lr}"] if args.policy_lr else [])])
            runs[train] = [r for r in rows if "rollout/spec_accept_rate" in r]
    start = "the SFT model" if args.draft == "model" else "an MTP head taught the SFT model"
    print(f"quickstart GRPO from its SFT model, {args.steps} steps, seed {args.seed}; the draft starts as {start}; "
          f"2 proposals a step; draft lr {args.lr}, window {args.window}; "
          f"policy lr {args.policy_lr or 'as the quickstart'}")
    print(f"{'steps':>9} {'reward':>7} {'kept (fixed draft)':>19} {'reward':>7} {'kept (trained draft)':>21} "
          f"{'draft loss':>10}")
    fixed, trained = runs[False], runs[True]
    for start in range(0, min(len(fixed), len(trained)), args.every):
        a, b = fixed[start:start + args.every], trained[start:start + args.every]
        print(f"{start:>4}-{start + len(a) - 1:<4} {fmean(r['reward/mean'] for r in a):7.3f} "
              f"{fmean(r['rollout/spec_accept_rate'] for r in a):19.3f} {fmean(r['reward/mean'] for r in b):7.3f} "
              f"{fmean(r['rollout/spec_accept_rate'] for r in b):21.3f} "
              f"{fmean(r['rollout/spec_draft_loss'] for r in b):10.3f}")
    for name, rows in (("fixed draft", fixed), ("trained draft", trained)):
        start = rows[0]["rollout/spec_accept_rate"]
        last = fmean(r["rollout/spec_accept_rate"] for r in rows[-args.every:])
        lowest = min(fmean(r["rollout/spec_accept_rate"] for r in rows[i:i + args.every])
                     for i in range(0, len(rows), args.every))
        print(f"{name}: kept {start:.3f} at step 0, {last:.3f} over the last {args.every} steps "
              f"({(last - start) / start:+.1%}); the lowest {args.every}-step mean {lowest:.3f} "
              f"({(lowest - start) / start:+.1%})")


def with_taught_head(model: Path, train_file: Path, out: Path, seed: int, passes: int) -> Path:
    """A copy of ``model`` shipping an MTP head taught its samples: 4 of each training prompt, temperature 1."""
    import json

    from miles.models.hf import load_tokenizer
    from miles.testing import generate_all, local_engine

    tokenizer = load_tokenizer(model)
    prompts = [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in train_file.read_text().splitlines()] * 4
    engine = local_engine(model, seed=seed)
    answers = generate_all(engine, prompts, {"max_new_tokens": 4, "temperature": 1.0})
    weights = {name: t.clone() for name, t in engine.model.state_dict().items()}
    engine.close()
    return ship_taught_head(model, prompts, answers, weights, out, seed, passes, lr=1e-2)

if __name__ == "__main__":
    main()
