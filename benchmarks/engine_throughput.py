"""Engine throughput on a mixed-length workload: Miles' continuous batching against `transformers`
`generate` with static batches of the same size, same model, one torch thread.

Every request asks for its own number of new tokens (a few to a few hundred, EOS ignored). A static
batch runs until its longest request is done; the useful tokens are each request's own.

    python benchmarks/engine_throughput.py [--requests 128] [--batch 32] [--max-len 300]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from miles.engine import LocalEngine
from miles.testing import build_tiny_model


def workload(n: int, max_len: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 15) for _ in range(rng.randrange(4, 12))],
             rng.choice([rng.randrange(4, 20), rng.randrange(20, max_len)]))
            for _ in range(n)]


def hf_static(model_dir: Path, requests, batch: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: rows stop at the batch's max length
    start = time.perf_counter()
    for i in range(0, len(requests), batch):
        chunk = requests[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p, _ in chunk])[:, None]).long()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=max(n for _, n in chunk),
                           pad_token_id=0)
    return time.perf_counter() - start


def miles_engine(model_dir: Path, requests, batch: int) -> float:
    engine = LocalEngine(max_batch_size=batch)
    engine.load_model(str(model_dir))

    async def go():
        await asyncio.gather(*(engine.generate(p, {"max_new_tokens": n, "ignore_eos": True}) for p, n in requests))

    start = time.perf_counter()
    asyncio.run(go())
    elapsed = time.perf_counter() - start
    engine.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "m", hidden_size=args.hidden, num_layers=args.layers,
                                     intermediate_size=4 * args.hidden, max_position_embeddings=args.max_len + 16)
        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        requests = workload(args.requests, args.max_len, seed=0)
        useful = sum(n for _, n in requests)
        hf_s = hf_static(model_dir, requests, args.batch)
        miles_s = miles_engine(model_dir, requests, args.batch)
    print(f"model: Qwen3 hidden {args.hidden}, {args.layers} layers ({params / 1e6:.2f}M params); "
          f"{args.requests} requests, new tokens {min(n for _, n in requests)}-{max(n for _, n in requests)} "
          f"({useful} in all), batch {args.batch}")
    print(f"  transformers generate, static batches : {hf_s:7.2f} s  {useful / hf_s:8.0f} tokens/s")
    print(f"  miles engine, continuous batching     : {miles_s:7.2f} s  {useful / miles_s:8.0f} tokens/s")
    print(f"  speed-up                              : {hf_s / miles_s:7.2f}x")


if __name__ == "__main__":
    main()
