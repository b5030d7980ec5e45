"""Rollout routing replay (R3) on a tiny Qwen3-MoE: how often the trainer's routing differs from the engine's,
and the rollout/train log-prob gap with and without replay.

The engine serves in bfloat16 (as rollout engines do) and the trainer computes in float32, from the same
random-init weights; rollouts are the single-turn function's with ``return_routed_experts``. Prints the share of
(token, MoE layer) pairs routed differently, and the mean and largest |trainer - engine| log-prob per generated
token, over all samples and over the samples where some routing differed.

    python benchmarks/moe_r3.py [--prompts 100] [--samples 8] [--tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import torch

from miles.engine.local import LocalEngine
from miles.models.hf import load_model, load_tokenizer
from miles.models.moe import routing
from miles.rollout.context import RolloutContext
from miles.rollout.single_turn import single_turn
from miles.testing import build_tiny_model
from miles.train.torch_backend import TorchBackend
from miles.types import Sample, TrainBatch


def rollouts(model_dir: Path, prompts: int, samples: int, tokens: int) -> TrainBatch:
    tokenizer = load_tokenizer(model_dir)
    engine = LocalEngine(seed=0, dtype="bfloat16")
    engine.load_model(str(model_dir))
    ctx = RolloutContext(engine, tokenizer, {"temperature": 1.0, "max_new_tokens": tokens, "ignore_eos": True},
                         return_routed_experts=True)
    texts = [f"{a % 10}+{a // 10 % 10}=" for a in range(prompts)]

    async def generate() -> list[Sample]:
        todo = [Sample(prompt_ids=tokenizer.encode(t), group_index=i, index=j, reward=0.0)
                for i, t in enumerate(texts) for j in range(samples)]
        return await asyncio.gather(*(single_turn(s, ctx) for s in todo))

    return TrainBatch.from_samples(asyncio.run(generate()), pad_token_id=tokenizer.pad_token_id)


def flipped(model_dir: Path, batch: TrainBatch) -> tuple[float, torch.Tensor]:
    """The share of (token, layer) pairs whose experts differ from the engine's, and which rows had any."""
    model = load_model(model_dir)
    with torch.no_grad(), routing(model) as record:
        model(input_ids=batch.input_ids)
    layout = record.layout
    shape = (*batch.input_ids.shape, layout.num_layers, layout.top_k)
    mine = record.routed(len(batch)).reshape(shape).sort(-1).values
    theirs = batch.routed_experts.long().reshape(shape).sort(-1).values
    known = (theirs >= 0).all(-1) & batch.attention_mask.bool()[..., None]
    differ = (mine != theirs).any(-1) & known
    return float(differ.sum() / known.sum()), differ.flatten(1).any(1)


def gaps(model_dir: Path, batch: TrainBatch, rows: torch.Tensor, replay: bool) -> tuple[float, float, float]:
    backend = TorchBackend(routing_replay=replay)
    backend.setup(str(model_dir), seed=0)
    diff = (backend.compute_logprobs(batch) - batch.rollout_logprobs).abs() * batch.loss_mask
    mask = batch.loss_mask
    return float(diff.sum() / mask.sum()), float(diff[rows].sum() / mask[rows].sum()), float(diff.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "moe", arch="qwen3_moe")
        batch = rollouts(model_dir, args.prompts, args.samples, args.tokens)
        share, rows = flipped(model_dir, batch)
        print(f"{len(batch)} samples, {int(batch.loss_mask.sum())} generated tokens; (token, layer) pairs routed "
              f"differently by the fp32 trainer: {share:.2%}; samples with such a pair: {int(rows.sum())}")
        print(f"{'':>12} {'mean gap':>10} {'mean gap, samples with a flip':>30} {'largest gap':>12}")
        for replay in (False, True):
            mean, on_flipped, largest = gaps(model_dir, batch, rows, replay)
            print(f"{'with R3' if replay else 'without R3':>12} {mean:>10.2e} {on_flipped:>30.2e} {largest:>12.2e}")


if __name__ == "__main__":
    main()
