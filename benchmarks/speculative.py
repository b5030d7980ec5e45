"""Speculative rollouts on a CPU: a target big enough that decoding a few rows is bound by reading its weights, a
draft 100x smaller, both trained on one task so that the draft can agree with the target.

The task: over 64 symbols in a fixed order, the prompt ``s:`` asks for the symbols after ``s`` up to the last one
(1 to 63 of them), then the end token. The target (hidden 768, 8 layers, 50M parameters) and the draft (hidden 128,
2 layers) are trained on it once and kept under ``--cache``. Then, at temperature 1:

- the tail: tokens/s of 1 to 16 rows decoding 63 tokens each, plain and speculative (``when: always``);
- a whole rollout batch whose lengths are long-tailed (most answers short, a few long), plain and with the default
  ``when: tail`` (speculation once at most ``tail_rows`` rows decode: 4, 8 and 16, the default), and the share of
  exact answers of each (the same distribution: speculation changes the speed, not the samples).

``--draft mtp``: the draft is an MTP head on the target instead (``draft: mtp``: one block of the target's shape on
its hidden states, and its output layer), taught the target's samples by DraftLearner and shipped in a copy of the
target's checkpoint (kept under ``--cache`` too).

    python benchmarks/speculative.py [--num-tokens 4] [--batch 64] [--threads 2] [--draft mtp]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import torch

from miles.engine.local import LocalEngine
from miles.models.hf import load_model, load_tokenizer, save_pretrained
from miles.testing import build_tiny_model

from _common import ship_taught_head

SYMBOLS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/"
ALPHABET = SYMBOLS + ":"
TARGET = dict(hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=2048)
DRAFT = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=384)


def example(rng: random.Random, distance: int | None = None) -> tuple[str, str]:
    """A prompt ``s:`` and its answer: the symbols after ``s`` up to the cycle's last (``distance`` of them)."""
    distance = distance or rng.randint(1, len(SYMBOLS) - 1)
    start = len(SYMBOLS) - 1 - distance
    return f"{SYMBOLS[start]}:", SYMBOLS[start + 1:]


def long_tailed(rng: random.Random) -> int:
    """Most answers short, a few long: the rollout batch's lengths."""
    return rng.randint(2, 10) if rng.random() < 0.85 else rng.randint(40, 63)


def trained(root: Path, name: str, build: dict, steps: int, lr: float) -> Path:
    """A model of ``build`` trained on the task (once: kept under ``root``)."""
    done = root / name / "model"
    if (done / "config.json").exists():
        return done
    built = build_tiny_model(root / name / "init", alphabet=ALPHABET, max_position_embeddings=128, **build)
    model, tokenizer = load_model(built), load_tokenizer(built)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(0)
    start = time.perf_counter()
    for step in range(steps):
        rows = [example(rng) for _ in range(16)]
        seqs = [tokenizer.encode(p, add_special_tokens=False) + tokenizer.encode(a, add_special_tokens=False)
                + [tokenizer.eos_token_id] for p, a in rows]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, 2: len(s)] = torch.tensor(s[2:])  # the answer and the end token
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  {name} step {step}: loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr, flush=True)
    model.eval()
    save_pretrained(model, tokenizer, done)
    return done


def with_taught_head(root: Path, target: Path, passes: int) -> Path:
    """A copy of ``target`` shipping an MTP head that DraftLearner taught the target's own samples (256 prompts at
    temperature 1); kept under ``root``."""
    done = root / "mtp_head" / "model"
    if (done / "mtp.safetensors").exists():
        return done
    rng, tokenizer = random.Random(2), load_tokenizer(target)
    prompts = [tokenizer.encode(example(rng)[0], add_special_tokens=False) for _ in range(256)]
    engine = engine_of(target, None)
    answers, _ = generate(engine, prompts, 70)
    weights = {name: t.clone() for name, t in engine.model.state_dict().items()}
    engine.close()
    done.parent.mkdir(parents=True, exist_ok=True)
    return ship_taught_head(target, prompts, answers, weights, done, seed=0, passes=passes, lr=3e-3)


def engine_of(target: Path, speculative: dict | None) -> LocalEngine:
    engine = LocalEngine(seed=0, speculative=speculative, prefix_cache_tokens=0)
    engine.load_model(str(target))
    return engine


def generate(engine: LocalEngine, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[dict], float]:
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0}

    async def go() -> list[dict]:
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    start = time.perf_counter()
    answers = asyncio.run(go())
    return answers, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target-steps", type=int, default=150)
    parser.add_argument("--draft-steps", type=int, default=400)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--tail-rows", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--cache", default=".cache/benchmarks/speculative")
    parser.add_argument("--draft", choices=("model", "mtp"), default="model")
    parser.add_argument("--head-passes", type=int, default=20, help="--draft mtp: passes teaching it the target")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.cache)
    target = trained(root, "target", TARGET, args.target_steps, 1e-3)
    if args.draft == "mtp":
        target = with_taught_head(root, target, args.head_passes)
        spec = {"draft": "mtp", "num_tokens": args.num_tokens}
    else:
        draft = trained(root, "draft", DRAFT, args.draft_steps, 3e-3)
        spec = {"draft": {"path": str(draft)}, "num_tokens": args.num_tokens}
    tokenizer = load_tokenizer(target)
    plain = engine_of(target, None)
    always = engine_of(target, {**spec, "when": "always"})
    kind = "an MTP head of" if args.draft == "mtp" else "draft"
    print(f"target {sum(p.numel() for p in plain.model.parameters()) / 1e6:.1f}M parameters, {kind} "
          f"{sum(p.numel() for p in always.draft.parameters()) / 1e6:.2f}M; {args.num_tokens} proposals a step; "
          f"{args.threads} threads; temperature 1")
    rng = random.Random(1)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731

    print("\nthe tail: rows decoding 63 tokens each")
    print(f"{'rows':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'speed-up':>9} {'kept':>6} {'tok/forward':>12}")
    for rows in args.rows:
        prompts = [encode(example(rng, 63)[0]) for _ in range(rows)]
        generate(plain, prompts[:1], 4)  # warm up
        answers, plain_s = generate(plain, prompts, 63)
        plain_tokens = sum(len(a["output_ids"]) for a in answers)
        before = dict(always.stats())
        answers, spec_s = generate(always, prompts, 63)
        after = always.stats()
        spec_tokens = sum(len(a["output_ids"]) for a in answers)
        grew = {k: after[k] - before[k] for k in ("spec_accepted", "spec_proposed", "spec_tokens", "spec_row_forwards")}
        kept = grew["spec_accepted"] / max(1, grew["spec_proposed"])
        per_forward = grew["spec_tokens"] / max(1, grew["spec_row_forwards"])
        print(f"{rows:>5} {plain_tokens / plain_s:>12.1f} {spec_tokens / spec_s:>11.1f} "
              f"{(spec_tokens / spec_s) / (plain_tokens / plain_s):>8.2f}x {kept:>6.2f} {per_forward:>12.2f}")

    print(f"\na whole rollout batch: {args.batch} prompts, long-tailed lengths (85% 2-10 symbols, 15% 40-63)")
    batch = [example(rng, long_tailed(rng)) for _ in range(args.batch)]
    prompts = [encode(p) for p, _ in batch]
    answers, seconds = generate(plain, prompts, 70)
    exact = sum(a["text"] == answer for a, (_, answer) in zip(answers, batch)) / len(batch)
    tokens = sum(len(a["output_ids"]) for a in answers)
    print(f"  {'plain':<14} {seconds:6.2f} s, {tokens / seconds:7.1f} tok/s, exact answers {exact:.2f}")
    plain_s = seconds
    for rows in args.tail_rows:
        engine = engine_of(target, {**spec, "when": "tail", "tail_rows": rows})
        generate(engine, prompts[:1], 4)  # warm up, as the plain engine was
        answers, seconds = generate(engine, prompts, 70)
        exact = sum(a["text"] == answer for a, (_, answer) in zip(answers, batch)) / len(batch)
        tokens = sum(len(a["output_ids"]) for a in answers)
        print(f"  {f'tail_rows {rows}':<14} {seconds:6.2f} s, {tokens / seconds:7.1f} tok/s, exact answers "
              f"{exact:.2f}, {engine.stats()['spec_steps']} speculative steps: {plain_s / seconds:.2f}x")
        engine.close()
    for engine in (plain, always):
        engine.close()


if __name__ == "__main__":
    main()
