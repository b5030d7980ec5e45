"""Re-tokenization drift on a real BPE vocabulary: the share of trajectories a text-in, text-out path would train on
ids the policy never sampled, against token in, token out.

Reads the saved rollouts of a multi-turn run (``run.save_rollouts=true``; e.g. ``configs/retool_qwen3.yaml``). For
each trajectory, every policy turn (a run of loss-mask-1 tokens) is decoded to text and encoded again, as a naive
path that keeps text and tokenizes it for training would do; the trajectory drifts when any turn comes back as
other ids. Token in, token out trains on the sampled ids themselves: its drift is 0 by construction, and the
script checks that the saved trajectories hold no re-encoded turn (each turn's ids are what the engine returned,
so they include the tokenizations a naive path would rewrite).

    miles train configs/retool_qwen3.yaml run.save_rollouts=true run.dir=runs/retool_qwen3
    python benchmarks/retokenization_drift.py runs/retool_qwen3
"""

from __future__ import annotations

import argparse
from pathlib import Path

from miles.models.hf import load_tokenizer
from miles.loop.saved_rollouts import read_step, saved_steps


def policy_turns(sample) -> list[list[int]]:
    turns, current = [], []
    for token, mask in zip(sample.response_ids, sample.loss_mask):
        if mask:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    return turns + ([current] if current else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    tokenizer = load_tokenizer(run_dir / "final_model")
    trajectories = drifted = turns = turns_drifted = 0
    examples = []
    for step in saved_steps(run_dir / "rollouts"):
        samples, _ = read_step(run_dir / "rollouts" / f"step_{step:06d}.npz")
        for sample in samples:
            trajectories += 1
            hit = False
            for ids in policy_turns(sample):
                turns += 1
                again = tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=False), add_special_tokens=False)
                if again != ids:
                    turns_drifted += 1
                    hit = True
                    if len(examples) < 3:
                        examples.append((tokenizer.convert_ids_to_tokens(ids), tokenizer.convert_ids_to_tokens(again)))
            drifted += hit
    print(f"{trajectories} trajectories, {turns} policy turns ({len(saved_steps(run_dir / 'rollouts'))} steps)")
    print(f"naive text-in path: {drifted / max(trajectories, 1):.3f} of trajectories drift "
          f"({turns_drifted} of {turns} turns re-encode to other ids)")
    print("token in, token out: 0.000 (the sampled ids are trained as they are)")
    for sampled, again in examples:
        print(f"  sampled {sampled[:12]} ... re-encoded {again[:12]} ...")


if __name__ == "__main__":
    main()
