"""The ReTool recipe end to end (configs/retool.yaml): time per phase, train reward and tool use over
the run, and greedy held-out accuracy of the final model with the Python tool and without it (the same
model, the same env with no tools: its code comes back as "unknown tool" and it must answer anyway).

    python benchmarks/retool.py [--run-dir runs/retool-bench] [--reuse] [CONFIG OVERRIDES ...]
    python benchmarks/retool.py --sandboxes cold,warm,pooled [CONFIG OVERRIDES ...]

``--reuse`` reads a finished run in ``--run-dir`` (e.g. ``runs/retool`` after ``miles train configs/retool.yaml``)
instead of training again. ``--sandboxes`` trains the recipe once per sandbox setting, one after the other in
this process, and prints their step times, sandbox figures and reward side by side (no held-out evaluation):
``cold`` (a fresh bwrap and python3 per tool call), ``warm`` (a warm sandbox per trajectory, the stateful tool:
one bwrap and interpreter start per trajectory), ``pooled`` (the recipe's settings: warm sandboxes from a pool,
reset and reused between trajectories).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from statistics import fmean

import torch

from miles.agentic.tool_calls import PythonBlockParser
from miles.rewards import exact_match
from miles.agentic.sandboxes.local import LocalSandbox
from miles.agentic.tool_env import ToolEnv, execute_python_code
from miles.engine import LocalEngine
from miles.loop.evaluation import evaluate
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import encode_rows, read_rows
from miles.rollout.multi_turn import MultiTurn
from miles.run.runner import prepare, train

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "retool.yaml")
SANDBOXES = {  # --sandboxes: each setting's overrides of the recipe
    "cold": ["rollout.sandbox={name: local, warm: false, pool: 0}", "rollout.env.stateful=false"],
    "warm": ["rollout.sandbox={name: local, warm: true, pool: 0}", "rollout.env.stateful=true"],
    "pooled": [],  # the recipe as it is
}
FIGURES = ("time/step_s", "time/rollout_s", "sandbox/exec_s_p50", "sandbox/exec_s_p99", "sandbox/pool_reused",
           "sandbox/pool_empty", "sandbox/pool_discarded", "sandbox/reset_s_p50", "tools/calls", "reward/mean")


def compare_sandboxes(names: list[str], run_dir: Path, overrides: list[str]) -> None:
    """Train the recipe once per sandbox setting and print the figures side by side (medians over the steps; the
    reward as its mean over the first and the last steps)."""
    rows: dict[str, dict[str, str]] = {}
    for name in names:
        directory = run_dir / name
        shutil.rmtree(directory, ignore_errors=True)
        started = time.perf_counter()
        train(prepare(CONFIG, [f"run.dir={directory}", "run.progress=false", "run.eval_size=0",
                               *SANDBOXES[name], *overrides]))
        steps = [r for r in map(json.loads, (directory / "metrics.jsonl").read_text().splitlines())
                 if "reward/mean" in r]
        k = max(1, min(10, len(steps) // 5))
        row = {key: f"{sorted(r[key] for r in steps if key in r)[len(steps) // 2]:.4g}"
               for key in FIGURES if any(key in r for r in steps)}
        row["reward/mean"] = (f"{fmean(r['reward/mean'] for r in steps[:k]):.3f} -> "
                              f"{fmean(r['reward/mean'] for r in steps[-k:]):.3f}")
        row["steps"], row["run_s"] = str(len(steps)), f"{time.perf_counter() - started:.0f}"
        rows[name] = row
        print(f"{name}: {row}", flush=True)
    keys = ["steps", "run_s", *[key for key in FIGURES if any(key in row for row in rows.values())]]
    print("\nReTool recipe by sandbox setting (medians over the steps; reward: first and last steps averaged)")
    print(f"  {'':<24}" + "".join(f"{name:>18}" for name in rows))
    for key in keys:
        print(f"  {key:<24}" + "".join(f"{row.get(key, '-'):>18}" for row in rows.values()))
    if "cold" in rows and "pooled" in rows:
        cold, pooled = float(rows["cold"]["time/step_s"]), float(rows["pooled"]["time/step_s"])
        print(f"  step time, cold / pooled: {cold / pooled:.2f}x")


def held_out(run_dir: Path, config, with_tool: bool) -> dict[str, float]:
    engine = LocalEngine(seed=0)
    engine.load_model(str(run_dir / "final_model"))
    rows = read_rows(run_dir / "data" / "eval.jsonl", "prompt", "label")
    prompts = encode_rows(rows, engine.tokenizer, prompt_key="prompt", label_key="label", chat_template="auto")
    fn_args = {k: v for k, v in config.rollout.fn.items() if k not in ("name", "timeout_s")}
    ctx = RolloutContext(
        engine=engine, tokenizer=engine.tokenizer, context_length=engine.context_length,
        sampling_params={"max_new_tokens": config.rollout.sampling.max_new_tokens, "temperature": 0.0},
        env=lambda c: ToolEnv(c, tools=["execute_python_code"] if with_tool else []),
        sandbox=LocalSandbox, tool={"execute_python_code": execute_python_code}.__getitem__,
        tool_parser=PythonBlockParser())
    return evaluate(prompts, MultiTurn(**fn_args), ctx, exact_match, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default="runs/retool-bench")
    parser.add_argument("--reuse", action="store_true", help="report on the finished run in --run-dir")
    parser.add_argument("--sandboxes", help=f"compare sandbox settings, e.g. cold,warm,pooled ({', '.join(SANDBOXES)})")
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(1)
    run_dir = Path(args.run_dir)
    if args.sandboxes:
        names = args.sandboxes.split(",")
        if unknown := [name for name in names if name not in SANDBOXES]:
            parser.error(f"--sandboxes: expected names among {', '.join(SANDBOXES)}, got {', '.join(unknown)}")
        compare_sandboxes(names, run_dir, overrides)
        return
    if args.reuse:
        p = prepare(run_dir / "config.yaml", [])
        summary = json.loads((run_dir / "summary.json").read_text())
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        p = prepare(CONFIG, [f"run.dir={run_dir}", "run.progress=false", *overrides])
        summary = train(p)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    k = max(1, min(10, len(steps) // 5))

    def first_last(key: str) -> str:
        values = [r[key] for r in steps]
        return f"{fmean(values[:k]):.3f} -> {fmean(values[-k:]):.3f}"

    print(f"\nReTool recipe ({len(steps)} GRPO steps; first and last {k} steps averaged)")
    print("  time per phase: " + ", ".join(f"{name} {s:.1f} s" for name, s in summary["time_s"].items()))
    for key in ("reward/mean", "tools/calls", "tools/success_rate", "turns/mean", "tools/parse_errors",
                "sandbox/exec_s_p50", "rollout/prefix_hit_frac", "time/step_s"):
        print(f"  {key:<24} {first_last(key)}")
    for with_tool in (True, False):
        result = held_out(run_dir, p.config, with_tool)
        print(f"  held-out greedy accuracy {'with the tool   ' if with_tool else 'without the tool'}: "
              f"{result['eval/accuracy']:.3f} "
              f"({len(read_rows(run_dir / 'data' / 'eval.jsonl', 'prompt', None))} prompts)")


if __name__ == "__main__":
    main()
