"""The engine's prefix cache on rollout-like workloads: prompt tokens prefilled and generation speed with
the cache on and off, same model, one torch thread.

Two workloads: multi-turn (each trajectory's next prompt is its previous prompt + output + an
observation of a few tokens) and groups (n samples of each prompt, sent together). Outputs ignore EOS,
so both settings generate the same number of tokens.

    python benchmarks/prefix_cache.py [--trajectories 32] [--turns 4] [--prompts 32] [--n 8] [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import torch

from miles.engine import LocalEngine
from miles.testing import build_tiny_model


def multi_turn(engine: LocalEngine, args: argparse.Namespace, rng: random.Random) -> int:
    params = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}

    async def trajectory(prompt: list[int]) -> int:
        made = 0
        for _ in range(args.turns):
            answer = await engine.generate(prompt, params)
            made += len(answer["output_ids"])
            prompt = prompt + answer["output_ids"] + [rng.randrange(3, 15) for _ in range(args.obs)]
        return made

    async def go() -> list[int]:
        return await asyncio.gather(*(trajectory(_prompt(rng, args.prompt_len)) for _ in range(args.trajectories)))

    return sum(asyncio.run(go()))


def groups(engine: LocalEngine, args: argparse.Namespace, rng: random.Random) -> int:
    params = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}
    prompts = [_prompt(rng, args.prompt_len) for _ in range(args.prompts)]

    async def go() -> list[dict]:
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts for _ in range(args.n)))

    return sum(len(a["output_ids"]) for a in asyncio.run(go()))


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 15) for _ in range(length)]


def measure(model_dir: Path, workload, args: argparse.Namespace, cache_tokens: int) -> tuple[int, int, int, float]:
    engine = LocalEngine(max_batch_size=args.batch, prefix_cache_tokens=cache_tokens)
    engine.load_model(str(model_dir))
    start = time.perf_counter()
    made = workload(engine, args, random.Random(0))
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    engine.close()
    return stats["prefill_tokens_requested"], stats["prefill_tokens_computed"], made, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--obs", type=int, default=10, help="observation tokens appended each turn")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--cache-tokens", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    context = args.prompt_len + args.turns * (args.new_tokens + args.obs) + 16
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "m", hidden_size=args.hidden, num_layers=args.layers,
                                     intermediate_size=4 * args.hidden, max_position_embeddings=context)
        print(f"model: Qwen3 hidden {args.hidden}, {args.layers} layers; prompts of {args.prompt_len} tokens, "
              f"{args.new_tokens} new tokens per request, batch {args.batch}, cache {args.cache_tokens} tokens")
        for name, workload, what in (
            ("multi-turn", multi_turn,
             f"{args.trajectories} trajectories x {args.turns} turns, +{args.obs} observation tokens a turn"),
            ("groups", groups, f"{args.prompts} prompts x n={args.n}"),
        ):
            print(f"{name}: {what}")
            for label, cache_tokens in (("cache off", 0), ("cache on ", args.cache_tokens)):
                requested, computed, made, elapsed = measure(model_dir, workload, args, cache_tokens)
                print(f"  {label}: prefill {computed:7d} of {requested:7d} prompt tokens computed "
                      f"(hit {1 - computed / requested:5.1%}), {elapsed:6.2f} s, "
                      f"{made / elapsed:7.0f} tokens/s generated")


if __name__ == "__main__":
    main()
