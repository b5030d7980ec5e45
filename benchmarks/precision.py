"""Low precision side by side: a recipe with every rollout and training precision, the same seeds.

For each variant: the bytes of a weight push (the stored form against the same weights in bfloat16), the engine's
weight memory, the engine/trainer mismatch (mean |log-prob gap| and KL of the sampled tokens, and the share of tokens
TIS masked where it is on), and the final train reward (mean of the last ``--last`` steps), each the mean over
``--seeds``. The quickstart runs whole for each variant (its SFT is part of the run); the ReTool recipe's SFT
(560 steps) runs once per seed, in bfloat16, and each variant's RL phase starts from it.

    python benchmarks/precision.py [--recipe quickstart|retool] [--steps N] [--seeds 0 1] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from statistics import fmean

import torch

from _common import CONFIG, miles_grpo_phase, sft_checkpoint
from miles.engine.local import LocalEngine
from miles.precision.schemes import BUILTIN_SCHEMES
from miles.run.runner import prepare, train

TIS = ["loss.tis=token", "loss.tis_mode=mask_both", "loss.tis_cap=2.0", "backend.old_logprobs=recompute"]
VARIANTS: dict[str, list[str]] = {
    "bf16 (baseline)": [],
    "fp8_block rollout": ["rollout.precision=fp8_block"],
    "fp8_block rollout + MIS": ["rollout.precision=fp8_block", *TIS],
    "fp8_block rollout + unified fp8 training": ["rollout.precision=fp8_block", "backend.precision=fp8_block"],
    "int4 rollout": ["rollout.precision=int4_w4a16"],
    "int4 rollout + MIS": ["rollout.precision=int4_w4a16", *TIS],
    "int4 rollout + QAT": ["rollout.precision=int4_w4a16", "backend.qat=int4_w4a16"],
    "mxfp8 training": ["backend.precision=mxfp8"],
    "nvfp4 training": ["backend.precision=nvfp4"],
}
RETOOL = str(Path(__file__).resolve().parent.parent / "configs" / "retool.yaml")
RECIPES = {"quickstart": (CONFIG, 200, 20), "retool": (RETOOL, 30, 10)}  # config, RL steps, steps averaged


def run(root: Path, name: str, seed: int, steps: int, last: int, overrides: list[str],
        sft: tuple[Path, Path] | None = None, config: str = CONFIG) -> dict[str, float]:
    """One variant's figures; with ``sft`` (a model and its data) the recipe's RL phase from it."""
    run_dir = root / f"{name.replace(' ', '_')}-{seed}"
    common = [f"run.steps={steps}", f"run.seed={seed}", *overrides]
    if sft is None:
        train(prepare(config, [f"run.dir={run_dir}", "run.progress=false", *common]))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    else:
        rows = miles_grpo_phase(*sft, run_dir, common, config=config)
    rows = [r for r in rows if "train/rollout_logprob_abs_diff" in r]
    out = {"reward": fmean(r["reward/mean"] for r in rows[-last:]),
           "gap": fmean(r["train/rollout_logprob_abs_diff"] for r in rows),
           "kl": fmean(r["train/rollout_kl"] for r in rows),
           "masked": fmean(r.get("train/is_clipped_frac", 0.0) for r in rows)}
    if "weight_sync/stored_bytes" in rows[-1]:
        out["push"] = rows[-1]["weight_sync/stored_bytes"] / rows[-1]["weight_sync/bf16_bytes"]
    return out


def engine_bytes(model_dir: Path, scheme: str | None) -> int:
    engine = LocalEngine(precision=BUILTIN_SCHEMES[scheme]().spec() if scheme else None)
    engine.load_model(str(model_dir))
    asyncio.run(engine.generate([4, 13, 5, 14], {"max_new_tokens": 1}))
    size = engine.stats()["weight_bytes"]
    engine.close()
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=list(RECIPES), default="quickstart")
    parser.add_argument("--steps", type=int, default=None, help="RL steps (the quickstart: 200, ReTool: 30)")
    parser.add_argument("--last", type=int, default=None, help="steps the final reward averages (20, 10)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--only", nargs="*", default=None, help="variant names (substrings) to run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config, steps, last = RECIPES[args.recipe]
    steps, last = args.steps or steps, args.last or last
    variants = {k: v for k, v in VARIANTS.items() if not args.only or any(s in k for s in args.only)}
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sft = ({seed: sft_checkpoint(root / f"sft-{seed}", seed, config) for seed in args.seeds}
               if args.recipe == "retool" else {})
        for name, overrides in variants.items():
            results[name] = [run(root, name, seed, steps, last, overrides, sft.get(seed), config)
                             for seed in args.seeds]
            print(f"... {name}: done", flush=True)
        model = next(root.glob("*/init_model"))
        bf16_params = engine_bytes(model, None)
        memory = {scheme: engine_bytes(model, scheme) for scheme in ["fp8_block", "int4_w4a16"]}
    baseline = fmean(r["reward"] for r in results.get("bf16 (baseline)", [{"reward": float("nan")}]))
    print(f"\n{args.recipe}, {steps} RL steps, seeds {args.seeds}; reward: mean of the last {last} steps")
    print(f"{'variant':<42} {'reward':>7} {'vs bf16':>8} {'|gap|':>9} {'KL':>9} {'masked':>7} {'push/bf16':>9}")
    for name, runs in results.items():
        reward = fmean(r["reward"] for r in runs)
        push = f"{runs[0]['push']:.2f}x" if "push" in runs[0] else "-"
        print(f"{name:<42} {reward:7.3f} {reward - baseline:+8.3f} {fmean(r['gap'] for r in runs):9.2e} "
              f"{fmean(r['kl'] for r in runs):9.2e} {fmean(r['masked'] for r in runs):7.3f} {push:>9}")
    print(f"\nengine weight memory (float32 on CPU): bf16 {bf16_params:,} B; "
          + "; ".join(f"{k} {v:,} B ({v / bf16_params:.2f}x)" for k, v in memory.items()))


if __name__ == "__main__":
    main()
