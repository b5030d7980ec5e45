"""A regression check on what the framework adds to a step: the quickstart's GRPO phase in Miles against the bare
single-file loop of benchmarks/grpo_overhead.py (same model, data and work), both measured in this process in
three back-to-back pairs, the smallest pair's ratio; Miles without prefix sharing, so that it does the loop's very
work. The benchmark measures the ratio properly; this fails on a 1.5x regression, which slows every pair, while a
load burst on a busy machine slows one side of one pair."""

import gc
import importlib.util
from pathlib import Path

import torch

import miles
from miles.run.runner import prepare, train

ROOT = Path(__file__).resolve().parent.parent
STEPS = 20
PAIRS = 3


def load_benchmark():
    spec = importlib.util.spec_from_file_location("grpo_overhead", ROOT / "benchmarks" / "grpo_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_miles_grpo_step_costs_less_than_one_and_a_half_bare_loop_steps(tmp_path):
    bench = load_benchmark()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        train(prepare(bench.CONFIG, [f"run.dir={tmp_path / 'sft'}", "run.steps=0", "run.progress=false"]))
        model_dir, train_file = tmp_path / "sft" / "sft_model", tmp_path / "sft" / "data" / "train.jsonl"
        bench.bare_grpo(model_dir, train_file, 3, seed=0)  # first calls warm up (allocator, lazy imports)
        bench.miles_grpo(model_dir, tmp_path / "warm-up", 3, seed=0)
        pairs = []
        for repeat in range(PAIRS):  # each pair measured back to back, so that both see about the same load
            runs = [lambda: bench.bare_grpo(model_dir, train_file, STEPS, seed=repeat)[0],
                    lambda: bench.miles_grpo(model_dir, tmp_path / f"miles{repeat}", STEPS, seed=repeat,
                                             overrides=("backend.share_prefixes=false",))[0]]
            bare, miles = [fn() for fn in runs] if repeat % 2 == 0 else [fn() for fn in runs[::-1]][::-1]
            pairs.append((bare, miles))
    finally:
        torch.set_num_threads(threads)
    # the smallest pair's ratio: load only adds time, to either side of a pair (with the other core busy, two of
    # three pairs measured 1.73x and 1.59x, the third 1.16x); a real regression slows every pair
    ratio = min(miles / bare for bare, miles in pairs)
    print(f"{STEPS} GRPO steps, (bare, miles) in s: {pairs}: ratio {ratio:.2f}")
    assert ratio < 1.5, f"a Miles step costs {ratio:.2f}x a bare loop's ({pairs}); benchmarks/grpo_overhead.py"


def test_the_heap_is_frozen_during_the_steps_only(tmp_path):
    """What exists before the RL steps is out of the collector's view while they run (full collections would walk
    it every few steps), and back in view when the run ends: a process that trains again collects the first run's
    garbage."""
    frozen = []

    class Probe:
        @miles.hookimpl
        def miles_train_step_end(self, step, metrics):
            frozen.append(gc.get_freeze_count())

    train(prepare(str(ROOT / "configs" / "quickstart.yaml"), [
        f"run.dir={tmp_path}", "sft.steps=0", "run.steps=2", "run.eval_size=0", "rollout.prompts_per_step=2",
        "rollout.n_samples=2", "run.progress=false"], extra_plugins=[("probe", Probe())]))
    assert len(frozen) == 2 and min(frozen) > 10_000  # torch and transformers alone are more
    assert gc.get_freeze_count() == 0
