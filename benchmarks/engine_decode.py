"""The embedded engine's decode against a bare batched KV-cache decode loop: what the engine adds to a step.

B prompts decode N tokens each (EOS ignored), admitted together. The bare loop is what any engine must do: one
left-padded prefill, then a forward of one token per row with the KV cache, the token drawn from
softmax(logits / T) and its log-prob taken, nothing else. The engine does the same work through its request
queue, continuous batching, stop and budget checks and answers. Both run in this process on one torch thread,
alternated pair by pair; the figure is the engine's speed as a share of the loop's (1.0: it adds nothing).

With ``--partition`` it prints where a decode step's time goes in each (the model's forward, the sampling, the
rest), from wrappers around the forward and the sampler.

    python benchmarks/engine_decode.py [--batch 32 1] [--tokens 128] [--hidden 256] [--layers 4] [--pairs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from miles.engine import LocalEngine
from miles.testing import build_tiny_model

TEMPERATURE = 0.8


def prompts(batch: int) -> list[list[int]]:
    return [[3 + (i * 7 + j) % 11 for j in range(6 + i % 5)] for i in range(batch)]


@torch.inference_mode()
def bare_decode(model, rows: list[list[int]], tokens: int, generator: torch.Generator) -> list[list[int]]:
    """The loop: prefill, then ``tokens - 1`` one-token forwards; each token drawn at TEMPERATURE, its log-prob kept."""
    width = max(len(p) for p in rows)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in rows])[:, None]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                   logits_to_keep=1).logits[:, -1, :].float()
    next_pos = mask.sum(-1)
    out, logprobs = [], []
    for step in range(tokens):
        scaled = logits / TEMPERATURE
        token = torch.multinomial(scaled.softmax(-1), 1, generator=generator)
        logprobs.append(scaled.log_softmax(-1).gather(1, token))
        out.append(token)
        if step == tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        logits = model(input_ids=token, attention_mask=mask, position_ids=next_pos.unsqueeze(1), cache=cache,
                       use_cache=True).logits[:, -1, :].float()
        next_pos = next_pos + 1
    torch.cat(logprobs, dim=1).tolist()
    return torch.cat(out, dim=1).tolist()


def engine_decode(engine: LocalEngine, rows: list[list[int]], tokens: int) -> list[dict]:
    async def go():
        params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": TEMPERATURE}
        return await asyncio.gather(*(engine.generate(p, dict(params)) for p in rows))

    return asyncio.run(go())


def timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


class Partition:
    """Wall time inside the model's forward and inside the sampler, by wrapping them."""

    def __init__(self, model, module, name: str) -> None:
        self.forward_s = self.sample_s = 0.0
        self.model, self.module, self.name = model, module, name
        self.forward, self.sampler = model.forward, getattr(module, name)

    def _timed(self, fn, field: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)

        return wrapper

    def __enter__(self) -> Partition:
        forward, sampler = self._timed(self.forward, "forward_s"), self._timed(self.sampler, "sample_s")
        self.model.forward = forward
        setattr(self.module, self.name, sampler)
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward
        setattr(self.module, self.name, self.sampler)


def measure(model_dir: Path, batch: int, tokens: int, pairs: int,
            clock=time.perf_counter) -> tuple[list[float], list[float]]:
    """(bare seconds, engine seconds) of ``pairs`` pairs, the order alternated; after two warm-ups of each. Both
    sides run in this thread (the engine generates in the calling thread): ``clock=time.thread_time`` counts the
    CPU time they take, which other processes on a busy machine do not change."""
    engine = LocalEngine(max_batch_size=batch, prefix_cache_tokens=0)
    engine.load_model(str(model_dir))
    rows = prompts(batch)
    generator = torch.Generator().manual_seed(0)
    runs = [lambda: bare_decode(engine.model, rows, tokens, generator), lambda: engine_decode(engine, rows, tokens)]
    for fn in runs + runs:  # warm-up: the allocator, lazy imports, the first requests' paths
        fn()
    bare, miles = [], []
    for i in range(pairs):
        first, second = (0, 1) if i % 2 == 0 else (1, 0)
        times = {first: timed(runs[first], clock), second: timed(runs[second], clock)}
        bare.append(times[0])
        miles.append(times[1])
    engine.close()
    return bare, miles


def partition(model_dir: Path, batch: int, tokens: int) -> None:
    import miles.engine.batcher as batcher_module

    engine = LocalEngine(max_batch_size=batch, prefix_cache_tokens=0)
    engine.load_model(str(model_dir))
    rows = prompts(batch)
    generator = torch.Generator().manual_seed(0)
    engine_decode(engine, rows, tokens)
    bare_decode(engine.model, rows, tokens, generator)
    for name, fn in (("bare loop", lambda: bare_decode(engine.model, rows, tokens, generator)),
                     ("engine", lambda: engine_decode(engine, rows, tokens))):
        with Partition(engine.model, batcher_module, "sample_next") as parts:
            total = timed(fn)
        rest = total - parts.forward_s - parts.sample_s
        per_step = {part: 1000 * seconds / tokens
                    for part, seconds in (("total", total), ("forward", parts.forward_s),
                                          ("sampler", parts.sample_s), ("rest", rest))}
        print(f"    {name:<10}: {per_step['total']:6.3f} ms/token-step: forward {per_step['forward']:6.3f}, "
              f"sampling (engine's sampler) {per_step['sampler']:6.3f}, the rest {per_step['rest']:6.3f}")
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 1])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--partition", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "m", hidden_size=args.hidden, num_layers=args.layers,
                                     intermediate_size=4 * args.hidden, max_position_embeddings=args.tokens + 64)
        print(f"model: Qwen3 hidden {args.hidden}, {args.layers} layers; {args.tokens} new tokens per row, "
              f"temperature {TEMPERATURE}, {args.pairs} pairs (order alternated)")
        for batch in args.batch:
            bare, miles = measure(model_dir, batch, args.tokens, args.pairs)
            ratios = sorted(b / m for b, m in zip(bare, miles))
            useful = batch * args.tokens
            print(f"  batch {batch:3d}: bare loop {useful / min(bare):8.0f} tokens/s, "
                  f"engine {useful / min(miles):8.0f} tokens/s; "
                  f"engine / loop speed: median {statistics.median(ratios):.3f} "
                  f"(pairs {', '.join(f'{r:.3f}' for r in ratios)})")
            if args.partition:
                partition(model_dir, batch, args.tokens)


if __name__ == "__main__":
    main()
