"""Miles' control plane from 8 to 1,024 GPUs, by simulation (miles.simulate): the schedules, the collector, the
stream, the router and the weight pushes run unchanged against simulated engines and trainers on a simulated clock,
calibrated on a published Qwen3-30B-A3B GRPO run on eight MI300X (miles/simulate/published.py says which figure
comes from where).

    python benchmarks/scale.py [--sections a b c d] [--plots docs/images]

(a) the published case, predicted; (b) the schedules on its eight GPUs, with partial rollouts and long tails;
(c) 8, 64, 256 and 1,024 GPUs split between engines and trainers, the best split per schedule; (d) faults: engines
killed at random, a straggler, engines joining a running fleet. Every simulated step checks the control plane's
invariants (nothing trained twice or lost, staleness within its bound, engines in service on the weights pushed).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from miles.simulate.cluster import Faults, Scenario, simulate, summary
from miles.simulate.published import PUBLISHED, published_case, published_lengths, qwen3_30b_engine, split

# name, schedule fields; the streams run with partial rollouts (Miles' default update for them is then abort)
SCHEDULES = [
    ("sync, colocated", {"schedule": "sync", "partial_rollout": True}),
    ("sync", {"schedule": "sync", "partial_rollout": True}),
    ("one_step_off", {"schedule": "one_step_off"}),
    ("async s=1", {"schedule": "async", "max_staleness": 1, "partial_rollout": True}),
    ("async s=2", {"schedule": "async", "max_staleness": 2, "partial_rollout": True}),
    ("async s=4", {"schedule": "async", "max_staleness": 4, "partial_rollout": True}),
]


def run(scenario: Scenario) -> dict[str, float]:
    """A stream's steady state: ``steps`` steps after its pipeline filled (max_staleness + 2 steps)."""
    skip = 1 if scenario.schedule == "sync" else scenario.max_staleness + 2
    return summary(simulate(replace(scenario, steps=skip + scenario.steps)), skip=skip)


def section_a() -> None:
    print("(a) The published case: Qwen3-30B-A3B, 8 x MI300X colocated, sync, partial rollouts, 32 x 8, cap 8k")
    lengths = published_lengths()
    print(f"    lengths: log-normal, median {lengths.median:.0f}, sigma {lengths.sigma:.3f}: mean "
          f"{lengths.truncated_mean(8192):.0f} tokens, {lengths.truncated_frac(8192):.0%} truncated at 8,192")
    s = run(published_case(steps=4))
    parts = ("rollout_s", "logprob_s", "train_s", "update_s")
    print(f"    {'':<22}{'simulated':>10}{'published':>10}{'off':>8}")
    for key in parts:
        note = "  (taken as published)" if key == "update_s" else ""
        print(f"    {key:<22}{s[key]:>10.1f}{PUBLISHED[key]:>10.2f}{s[key] / PUBLISHED[key] - 1:>+8.1%}{note}")
    four = sum(PUBLISHED[k] for k in parts)
    print(f"    {'the four parts':<22}{s['step_s']:>10.1f}{four:>10.2f}{s['step_s'] / four - 1:>+8.1%}")
    print(f"    {'step (with the 75 s':<22}{s['step_s']:>10.1f}{PUBLISHED['step_s']:>10.2f}"
          f"{s['step_s'] / PUBLISHED['step_s'] - 1:>+8.1%}  the post does not partition)")
    print(f"    rollout throughput: {s['tokens_per_step'] / s['rollout_s'] / 8:.0f} tokens/GPU/s (published 1.1-1.3k)")
    print("    sensitivity to the one engine figure not from the post (a single row's decode speed):")
    for single in (60, 75, 100, 150):
        r = run(published_case(engine=qwen3_30b_engine(single_row_tokens_s=single), steps=3))
        off = r["rollout_s"] / PUBLISHED["rollout_s"] - 1
        print(f"      {single:>4} tokens/s: rollout {r['rollout_s']:6.1f} s ({off:+.1%}), "
              f"{r['tokens_per_step'] / r['rollout_s'] / 8:.0f} tokens/GPU/s")


def best_split(gpus: int, fields: dict, colocated: bool, fractions: list[float], **extra) -> tuple[int, dict]:
    if colocated:
        scenario = published_case(**{**split(gpus, gpus, gpus), "colocated": True}, **fields, **extra)
        return gpus, run(scenario)
    best = None
    for frac in fractions:
        engine_gpus = max(1, round(gpus * frac))
        scenario = published_case(**split(gpus, engine_gpus, gpus - engine_gpus), **fields, **extra)
        result = run(scenario)
        if best is None or result["samples_per_s"] > best[1]["samples_per_s"]:
            best = (engine_gpus, result)
    return best


def section_b(plots: Path | None) -> None:
    print("\n(b) The schedules on the published eight GPUs (split: the best engines/trainer split of 2-6 GPUs)")
    rows = []
    for tail, sigma in (("published tail", None), ("long tail (sigma 1.0)", 1.0)):
        lengths = published_lengths(sigma)
        print(f"  {tail}: {lengths.truncated_frac(8192):.0%} truncated")
        for name, fields in SCHEDULES:
            engines, r = best_split(8, fields, name.endswith("colocated"), [0.25, 0.375, 0.5, 0.625, 0.75],
                                    lengths=lengths, steps=6, token_scale=64)
            rows.append((tail, name, r["samples_per_s"]))
            where = "all 8 both" if name.endswith("colocated") else f"{engines} engine / {8 - engines} trainer"
            print(f"    {name:<16} {where:<22} step {r['step_s']:6.1f} s, trainer waits {r['rollout_s']:6.1f} s, "
                  f"{r['samples_per_s']:.3f} samples/s, staleness max {r['staleness_max']}")
        for partial in (False, True):
            fields = {"schedule": "async", "max_staleness": 2, "partial_rollout": partial}
            engines, r = best_split(8, fields, False, [0.375, 0.5, 0.625], lengths=lengths, steps=6, token_scale=64)
            print(f"    async s=2, partial rollouts {'on ' if partial else 'off'} (update "
                  f"{'abort' if partial else 'pause'}): step {r['step_s']:6.1f} s, {r['samples_per_s']:.3f} samples/s")
    print("  The router's batches (cluster.router.batch_requests): a batched /generate answers when its last "
          "request is done")
    for name, fields in (("sync colocated, partial rollouts, over-sampling 1.25",
                          {"schedule": "sync", "partial_rollout": True, "oversampling": 1.25}),
                         ("sync colocated, partial rollouts, over-sampling 1.5",
                          {"schedule": "sync", "partial_rollout": True, "oversampling": 1.5}),
                         ("async s=2, partial rollouts, 4 engine / 4 trainer",
                          {"schedule": "async", "max_staleness": 2, "partial_rollout": True, **split(8, 4, 4)})):
        for batched in (True, False):
            r = run(published_case(**fields, batch_requests=batched, steps=6, token_scale=64))
            print(f"    {name:<54} {'batched' if batched else 'one request per sample':<24} step "
                  f"{r['step_s']:6.1f} s, trainer waits {r['rollout_s']:6.1f} s, {r['samples_per_s']:.3f} samples/s")
    if plots is not None:
        _bars(plots / "scale_schedules.png", rows, "samples/s on 8 x MI300X (simulated)")


def section_c(plots: Path | None, sizes: list[int]) -> None:
    print("\n(c) 8 to 1,024 GPUs: the batch grows with the GPUs (32 prompts x 8 samples per eight GPUs); engines of "
          "eight GPUs; the best split per schedule")
    series: dict[str, list[tuple[int, float]]] = {}
    for gpus in sizes:
        scale = 64 if gpus <= 64 else 256 if gpus <= 256 else 512
        for name, fields in SCHEDULES:
            if name == "sync":
                continue
            start = time.perf_counter()
            fractions = [0.375, 0.5, 0.625] if gpus <= 256 else [0.5, 0.625]
            engines, r = best_split(gpus, fields, name.endswith("colocated"), fractions, steps=5, token_scale=scale)
            series.setdefault(name, []).append((gpus, r["samples_per_s"] / gpus))
            where = "colocated" if name.endswith("colocated") else f"{engines} engine / {gpus - engines} trainer GPUs"
            print(f"  {gpus:>5} GPUs {name:<16} {where:<32} step {r['step_s']:6.1f} s, "
                  f"{r['samples_per_s']:8.2f} samples/s ({r['samples_per_s'] / gpus * 1000:.1f} per 1k GPU-s) "
                  f"[{time.perf_counter() - start:.0f} s to simulate]", flush=True)
    if plots is not None:
        _lines(plots / "scale_gpus.png", series)


def section_d() -> None:
    print("\n(d) Faults, 64 GPUs (8 engines of 4 GPUs, 32 trainer GPUs), 6 steps; every step's invariants checked")
    cases = [("no faults", Faults()), ("engines killed at random (2 per engine-hour), back after 120 s",
                                        Faults(kills_per_engine_hour=2.0, restart_s=120.0)),
             ("engine 0 three times slower", Faults(stragglers={0: 3.0})),
             ("4 engines join at t=300 s", Faults(joins=((300.0, 4),)))]
    for name, fields in (("sync", {"schedule": "sync", "partial_rollout": True}),
                         ("async s=2", {"schedule": "async", "max_staleness": 2, "partial_rollout": True})):
        for label, faults in cases:
            scenario = replace(published_case(**split(64, 32, 32, engine_size=4), **fields, steps=6,
                                              token_scale=128, seed=1), faults=faults)
            records = simulate(scenario)
            r = summary(records, skip=2)
            failures = sum(x.metrics.get("rollout/engine_failures", 0) for x in records)
            readmitted = sum(x.metrics.get("rollout/readmissions", 0) for x in records)
            print(f"  {name:<10} {label:<62} step {r['step_s']:6.1f} s, {r['samples_per_s']:.2f} samples/s, "
                  f"failures {failures:.0f}, caught up and back {readmitted:.0f}, staleness max {r['staleness_max']}")


def _bars(path: Path, rows: list[tuple[str, str, float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tails = sorted({t for t, _, _ in rows}, key=[t for t, _, _ in rows].index)
    names = [n for t, n, _ in rows if t == tails[0]]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(tails)
    for i, tail in enumerate(tails):
        values = [v for t, _, v in rows if t == tail]
        ax.bar([x + i * width for x in range(len(names))], values, width, label=tail)
    ax.set_xticks([x + width * (len(tails) - 1) / 2 for x in range(len(names))], names, fontsize=8)
    ax.set_ylabel("samples / s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _lines(path: Path, series: dict[str, list[tuple[int, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, points in series.items():
        ax.plot([g for g, _ in points], [v * 1000 for _, v in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("samples per 1k GPU-seconds")
    ax.set_title("Best split per schedule (simulated, Qwen3-30B-A3B on MI300X)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["a", "b", "c", "d"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--plots", type=Path, default=None, help="write the plots (PNG) into this folder")
    args = parser.parse_args()
    if "a" in args.sections:
        section_a()
    if "b" in args.sections:
        section_b(args.plots)
    if "c" in args.sections:
        section_c(args.plots, args.sizes)
    if "d" in args.sections:
        section_d()


if __name__ == "__main__":
    main()
