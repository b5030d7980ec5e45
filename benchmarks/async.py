"""The schedules side by side (run.schedule sync, one_step_off, async) on the quickstart and on the ReTool
recipe (multi-turn, uneven trajectory lengths): samples/s of the RL phase, where a step's time goes,
how busy each core was, staleness, and the wall time to a rolling-10 train reward of 0.7.

Every variant starts from the same SFT checkpoint (made once per workload by the recipe itself) and runs
in a process of its own. The baseline is the synchronous run with the engine in the trainer's process.

    python benchmarks/async.py [--workloads quickstart retool] [--steps N] [--schedules ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import fmean

from _common import first_reach

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {"quickstart": ("configs/quickstart.yaml", 200), "retool": ("configs/retool.yaml", 30)}
VARIANTS = {  # name: overrides
    "sync, engine in process": ["run.schedule=sync"],
    "sync, trainer process": ["run.schedule=sync", "backend.separate_process=true"],
    "one_step_off (defaults)": ["run.schedule=one_step_off"],
    "async (defaults)": ["run.schedule=async"],
    "async k=1, in_place": ["run.schedule=async", "rollout.async.update=in_place"],
    "async k=2, in_place": ["run.schedule=async", "rollout.async.update=in_place", "rollout.async.max_staleness=2"],
    "async, abort, partial": ["run.schedule=async", "rollout.async.update=abort", "rollout.partial_rollout=true"],
    # the trainer here, the engine in a process of its own (the default before backend.separate_process)
    "async, engine process": ["run.schedule=async", "backend.separate_process=false"],
    "async, one process": ["run.schedule=async", "backend.separate_process=false",
                           "rollout.engine.separate_process=false"],
}


def cpu_times() -> list[tuple[int, int]]:
    """(busy, total) jiffies of each core, from /proc/stat."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            values = [int(v) for v in line.split()[1:]]
            idle = values[3] + values[4]
            out.append((sum(values) - idle, sum(values)))
    return out


def run(config: str, run_dir: Path, overrides: list[str]) -> tuple[list[dict], list[float]]:
    """Train in a process of its own; per-step metrics, and each core's busy share while the RL steps ran."""
    metrics = run_dir / "metrics.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "miles", "train", config, f"run.dir={run_dir}", "run.progress=false",
                             "run.overwrite=true", *overrides], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    window: dict[str, list] = {}

    def watch() -> None:  # from the first RL step logged to the last
        while proc.poll() is None:
            rows = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            if rows >= 1 and "start" not in window:
                window["start"] = cpu_times()
            if rows >= 1:
                window["end"] = cpu_times()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    output = proc.communicate()[0]
    watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"miles train {' '.join(overrides)} failed:\n{output[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r.get("metrics", r) for r in rows if "time/step_s" in r.get("metrics", r)]
    busy = [(b1 - b0) / max(1, t1 - t0) for (b0, t0), (b1, t1) in zip(window.get("start", []), window.get("end", []))]
    return rows, busy


def report(name: str, rows: list[dict], busy: list[float], base: dict | None) -> dict:
    """Print one variant's line; returns its figures (the first variant's are the base of the others'). The overlap
    limit is the base's step with rollout and the rest (training, push) overlapped: max(rollout, step - rollout)."""
    steady = rows[2:]  # the first steps warm up
    samples_per_s = sum(r["samples/total"] for r in steady) / sum(r["time/step_s"] for r in steady)
    part = {k: 1000 * fmean(r[k] for r in steady) for k in ("time/step_s", "time/rollout_s", "time/train_s",
                                                             "time/weight_sync_s")}
    stale = [r.get("async/staleness_mean", 0.0) for r in steady]
    rewards = [r["reward/mean"] if r["reward/mean"] is not None else 0.0 for r in rows]  # null: nothing rewarded
    reach = first_reach(rewards, [r["time/step_s"] for r in rows], 0.7)
    figures = {"samples_per_s": samples_per_s, "reach_s": reach[1] if reach else None}
    if base is None:
        samples_per_step = fmean(r["samples/total"] for r in steady)
        overlapped_ms = max(part["time/rollout_s"], part["time/step_s"] - part["time/rollout_s"])
        base = figures | {"limit": 1000 * samples_per_step / overlapped_ms}
        figures = base
    to_reward = (f"{reach[1]:.1f} s ({reach[1] / base['reach_s']:.2f}x)" if reach and base["reach_s"]
                 else f"{reach[1]:.1f} s" if reach else "not reached")
    print(f"{name:<24} {samples_per_s:>9.0f} {samples_per_s / base['samples_per_s']:>6.2f}x "
          f"{samples_per_s / base['limit']:>6.2f} "
          f"{part['time/step_s']:>7.1f} {part['time/rollout_s']:>7.1f} {part['time/train_s']:>7.1f} "
          f"{part['time/weight_sync_s']:>6.1f} {' '.join(f'{b:4.0%}' for b in busy):>10} {fmean(stale):>6.2f} "
          f"{max(r.get('async/staleness_max', 0) for r in steady):>4} "
          f"{sum(r.get('async/stale_dropped', 0) for r in rows):>5} {to_reward:>18} "
          f"{fmean(rewards[-10:]):>6.3f}", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=0, help="RL steps (0: the recipe's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads:
            config, steps = WORKLOADS[workload]
            steps = args.steps or steps
            sft = Path(tmp) / workload / "sft"
            run(config, sft, ["run.steps=0"])  # the recipe's SFT warm-up, once
            common = [f"model.path={sft / 'sft_model'}", "sft.steps=0", "run.eval_size=0", f"run.steps={steps}"]
            print(f"\n{workload}: {steps} RL steps from {config}'s SFT checkpoint; times in ms per step (mean "
                  f"after 2 warm-up steps); limit: samples/s as a share of the base's with rollout and training "
                  f"overlapped; busy: each core's share while the RL steps ran; to reward 0.7: wall time of the "
                  f"steps to a rolling-10 train reward of 0.7 (x the base's)")
            print(f"{'variant':<24} {'samples/s':>9} {'vs base':>7} {'limit':>6} {'step':>7} {'rollout':>7} "
                  f"{'train':>7} "
                  f"{'push':>6} {'busy':>10} {'stale':>6} {'max':>4} {'drop':>5} {'to reward 0.7':>18} "
                  f"{'last10':>6}")
            base = None
            for name in args.variants:
                # short run dirs: Ray's sockets live under them, and a socket path has at most 107 bytes
                rows, busy = run(config, Path(tmp) / workload[0] / str(list(VARIANTS).index(name)),
                                 common + VARIANTS[name])
                figures = report(name, rows, busy, base)
                base = base or figures


if __name__ == "__main__":
    main()
