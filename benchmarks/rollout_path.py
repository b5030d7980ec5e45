"""The rollout path across processes: one quickstart-sized step of generation (16 prompts x 8 samples,
4 new tokens) from an engine in this process, and from a `miles engine serve` process through the router,
one HTTP request per sample and batched (one `/generate` per event-loop turn, `cluster.router.batch_requests`).

    python benchmarks/rollout_path.py [--steps 30]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from miles.engine import LocalEngine
from miles.engine.router import Router
from miles.testing import build_tiny_model, serve_engine

PROMPTS, SAMPLES = 16, 8
PARAMS = {"max_new_tokens": 4, "temperature": 1.0}


async def one_step(client, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    await asyncio.gather(*(client.generate(p, PARAMS, return_logprob=True) for p in prompts for _ in range(SAMPLES)))
    return time.perf_counter() - start


async def measure(model: Path, url: str, steps: int) -> dict[str, list[float]]:
    local = LocalEngine(seed=0)
    local.load_model(str(model))
    prompts = [[4 + (i % 10), 13, 4 + (i * 3) % 10, 14] for i in range(PROMPTS)]
    out: dict[str, list[float]] = {"in process": [], "HTTP, a request per sample": [], "HTTP, batched": []}
    async with Router([url], batch_requests=False) as single, Router([url], batch_requests=True) as batched:
        clients = {"in process": local, "HTTP, a request per sample": single, "HTTP, batched": batched}
        for client in clients.values():  # warm-up
            await one_step(client, prompts)
        for _ in range(steps):  # interleaved, so that drift on a busy machine hits all alike
            for name, client in clients.items():
                out[name].append(await one_step(client, prompts))
    local.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "m")
        with serve_engine(model) as url:
            results = asyncio.run(measure(model, url, args.steps))
    base = statistics.median(results["in process"])
    print(f"{'path':<30} {'median ms/step':>15} {'x in process':>13}")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:<30} {median * 1000:>15.1f} {median / base:>13.2f}")


if __name__ == "__main__":
    main()
