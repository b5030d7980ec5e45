"""Multi-turn rollouts against single-turn on the same engine, same concurrency, one torch thread.

``multi_turn`` runs ``--trajectories`` trajectories at once with an environment that answers every turn
at once with a short observation (no sandbox: this measures the engine and Miles' per-turn work:
the chat template, tool-call parsing, the observation suffix). ``single_turn`` sends the same number of
generations, ``--trajectories`` at a time, with prompts as long as the multi-turn ones on average.
Turns end at a stop token (a random model, a fixed set of stop ids) or at ``--new-tokens``. Reported:
generated tokens per second, with the engine's prefix cache on and off.

    python benchmarks/multi_turn.py [--trajectories 32] [--turns 4] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import torch

from miles.agentic.tool_calls import HermesParser
from miles.agentic.types import StepResult
from miles.engine import LocalEngine
from miles.rollout.context import RolloutContext
from miles.rollout.multi_turn import MultiTurn
from miles.rollout.single_turn import single_turn
from miles.testing import build_chat_model
from miles.types import Sample


class Echo:
    """Observes a short message after every turn; done after ``turns`` turns."""

    def __init__(self, ctx, turns: int) -> None:
        self.n, self.turns, self.tools = 0, turns, []

    async def reset(self, sample):
        return None

    async def step(self, action):
        self.n += 1
        return StepResult(observation=f"step {self.n}: ok", done=self.n >= self.turns)

    async def close(self):
        pass


def _params(engine: LocalEngine, args: argparse.Namespace) -> dict:
    vocab = engine.model.config.vocab_size
    stops = random.Random(1).sample(range(3, vocab), k=max(1, vocab // args.stop_every))
    return {"max_new_tokens": args.new_tokens, "temperature": 1.0, "stop_token_ids": stops}


def run_multi(engine: LocalEngine, args: argparse.Namespace) -> tuple[int, float, list[int]]:
    ctx = RolloutContext(engine=engine, tokenizer=engine.tokenizer, sampling_params=_params(engine, args),
                         context_length=engine.context_length, env=lambda c: Echo(c, args.turns),
                         tool_parser=HermesParser())
    fn = MultiTurn(max_turns=args.turns)
    samples = [Sample(prompt_ids=[0], prompt=f"Question {i}: what comes next?") for i in range(args.trajectories)]

    async def go() -> None:
        await asyncio.gather(*(fn(s, ctx) for s in samples))

    start = time.perf_counter()
    asyncio.run(go())
    seconds = time.perf_counter() - start
    prompt_lengths = [len(s.prompt_ids) + len(s.response_ids) // 2 for s in samples]
    return sum(sum(s.loss_mask) for s in samples), seconds, prompt_lengths


def run_single(engine: LocalEngine, args: argparse.Namespace, prompt_lengths: list[int]) -> tuple[int, float]:
    ctx = RolloutContext(engine=engine, tokenizer=engine.tokenizer, sampling_params=_params(engine, args))
    rng = random.Random(0)
    made, start = 0, time.perf_counter()
    for _ in range(args.turns):  # the same number of generations, `trajectories` at a time
        samples = [Sample(prompt_ids=[rng.randrange(3, 90) for _ in range(n)]) for n in prompt_lengths]

        async def go() -> None:
            await asyncio.gather(*(single_turn(s, ctx) for s in samples))

        asyncio.run(go())
        made += sum(len(s.response_ids) for s in samples)
    return made, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--stop-every", type=int, default=12, help="one token in N is a stop token")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_chat_model(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers,
                                     intermediate_size=4 * args.hidden, max_position_embeddings=1024)
        print(f"{args.trajectories} trajectories x {args.turns} turns, up to {args.new_tokens} tokens a turn, "
              f"hidden {args.hidden} x {args.layers} layers, one torch thread")
        print(f"{'setting':<26}{'generated':>10}{'seconds':>9}{'tokens/s':>10}{'prefill hit':>13}{'vs single':>11}")
        for cache in (32768, 0):
            results = {}
            for kind in ("multi_turn", "single_turn"):  # multi-turn first: its prompt lengths set single-turn's
                engine = LocalEngine(seed=0, prefix_cache_tokens=cache)
                engine.load_model(str(model_dir))
                if kind == "multi_turn":
                    made, seconds, lengths = run_multi(engine, args)
                else:
                    made, seconds = run_single(engine, args, lengths)
                stats = engine.stats()
                results[kind] = (made, seconds,
                                 1 - stats["prefill_tokens_computed"] / max(1, stats["prefill_tokens_requested"]))
            base = results["single_turn"][0] / results["single_turn"][1]
            for kind in ("single_turn", "multi_turn"):
                made, seconds, hit = results[kind]
                label = f"{kind} (cache {'on' if cache else 'off'})"
                print(f"{label:<26}{made:>10}{seconds:>9.2f}{made / seconds:>10.0f}{hit:>13.2f}"
                      f"{made / seconds / base:>10.2f}x")

if __name__ == "__main__":
    main()
