"""Prefix-shared ("tree") training against unshared rows: training FLOPs (counted) and train-step time of the
torch backend with ``backend.share_prefixes`` true and false, on the same batches in one process, interleaved.

    python benchmarks/prefix_sharing.py [--hidden 256 --layers 4 --steps 3 --repeats 2]

Workloads (random tokens; a random-init Qwen3 with a char tokenizer of ~100 tokens, no download):

- ``grpo_long_prompt``: 4 prompts x n=8 answers, a 512-token prompt and answers of 16 to 128 tokens (the prompt is
  80% or more of every sequence), one group per micro-batch (``micro_batch_size: 8``).
- ``retool``: the ReTool recipe's shape (``configs/retool.yaml``: 16 prompts x n=8, up to 3 turns, 96 tokens at
  most): a 40-token prompt, then 1 to 3 turns of an 8-24-token answer and a 4-12-token tool observation, all 128
  rows in one micro-batch (the recipe's ``micro_batch_size: 128``).

A step is ``TorchBackend.train_step`` with the PPO-clip loss: one forward and backward per micro-batch and the
AdamW step. FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` over one step (matmuls and attention,
forward and backward). Reported: padded and packed tokens, FLOPs, the median step time, and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from miles.builtin.advantages import grpo  # noqa: E402
from miles.testing import CHAT_ALPHABET, build_tiny_model  # noqa: E402
from miles.train.losses import ppo_clip  # noqa: E402
from miles.train.prefix_tree import AUTO_MAX_WORK_FRACTION, PackCosts, pack_rows  # noqa: E402
from miles.train.torch_backend import TorchBackend  # noqa: E402
from miles.types import Sample, SampleStatus, TrainBatch  # noqa: E402

VOCAB = (3, len(CHAT_ALPHABET) + 3)  # token ids of the char tokenizer's characters


def _tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(*VOCAB, (n,), generator=gen).tolist()


def _batch(rows: list[tuple[list[int], list[int], list[int]]], seed: int) -> TrainBatch:
    """Rows of (prompt, response, loss mask) of groups of 8, with GRPO advantages."""
    gen = torch.Generator().manual_seed(seed)
    samples = [Sample(prompt_ids=prompt, response_ids=response, loss_mask=mask, group_index=i // 8, index=i % 8,
                      rollout_logprobs=[-1.0] * len(response), status=SampleStatus.COMPLETED,
                      reward=float(torch.rand((), generator=gen))) for i, (prompt, response, mask) in enumerate(rows)]
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.advantages = grpo(batch)
    return batch


def grpo_long_prompt(seed: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(4):
        prompt = _tokens(gen, 512)
        for _ in range(8):
            answer = _tokens(gen, int(torch.randint(16, 129, (), generator=gen)))
            rows.append((prompt, answer, [1] * len(answer)))
    return _batch(rows, seed)


def retool(seed: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(16):
        prompt = _tokens(gen, 40)
        for _ in range(8):
            response, mask = [], []
            for _ in range(int(torch.randint(1, 4, (), generator=gen))):
                answer = _tokens(gen, int(torch.randint(8, 25, (), generator=gen)))
                observation = _tokens(gen, int(torch.randint(4, 13, (), generator=gen)))
                response, mask = response + answer + observation, mask + [1] * len(answer) + [0] * len(observation)
            rows.append((prompt, response[:56], mask[:56]))  # 96 tokens at most, as max_total_tokens
    return _batch(rows, seed)


WORKLOADS = {"grpo_long_prompt": (grpo_long_prompt, 8), "retool": (retool, 128)}


def _flops(backend: TorchBackend, batch: TrainBatch) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        backend.train_step(batch, ppo_clip)
    return counter.get_total_flops()


def _packed_tokens(batch: TrainBatch, micro_batch_size: int, costs: PackCosts) -> tuple[int, int, float]:
    """(padded tokens, packed tokens, the largest work ratio) over the micro-batches of ``micro_batch_size`` rows in
    order, packed as the backend packs them."""
    padded = packed = 0
    ratio = 0.0
    for start in range(0, len(batch), micro_batch_size):
        micro = batch.select(list(range(start, min(start + micro_batch_size, len(batch)))))
        tree = pack_rows(micro.input_ids, micro.attention_mask.sum(dim=1), costs=costs)
        padded, packed, ratio = padded + tree.padded_tokens, packed + tree.tokens, max(ratio, tree.cost_ratio)
    return padded, packed, ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and repeat (after a warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of both variants, interleaved")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    model_dir = build_tiny_model(tempfile.mkdtemp(prefix="miles-prefix-bench-") + "/model", CHAT_ALPHABET,
                                 hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
                                 num_kv_heads=max(1, args.hidden // 128), head_dim=64,
                                 intermediate_size=3 * args.hidden, max_position_embeddings=1024)
    print(f"Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {VOCAB[1]}, float32, "
          f"{torch.get_num_threads()} torch thread(s); train_step (PPO-clip) median of {args.steps} x {args.repeats}")
    print(f"\n{'workload':<18}{'share':>6}{'padded tok':>12}{'packed tok':>12}{'GFLOP':>10}{'step':>9}"
          f"{'FLOP ratio':>12}{'time ratio':>12}")
    for name in args.workloads:
        make, micro_batch_size = WORKLOADS[name]
        batch = make(0)
        backends = {}
        for share in (False, True):
            backends[share] = TorchBackend(lr=1e-5, share_prefixes=share, micro_batch_size=micro_batch_size)
            backends[share].setup(str(model_dir), seed=0)
        padded, packed, ratio = _packed_tokens(batch, micro_batch_size, backends[True].policy.sharing.costs)
        flops = {share: _flops(backend, batch) for share, backend in backends.items()}  # also the warm-up
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for share, backend in backends.items():
                for _ in range(args.steps):
                    start = time.perf_counter()
                    backend.train_step(batch, ppo_clip)
                    times[share].append(time.perf_counter() - start)
        step = {share: statistics.median(t) for share, t in times.items()}
        for share in (False, True):
            print(f"{name:<18}{str(share).lower():>6}{padded:>12}{packed if share else padded:>12}"
                  f"{flops[share] / 1e9:>10.1f}{step[share]:>8.2f}s{flops[False] / flops[share]:>11.2f}x"
                  f"{step[False] / step[share]:>11.2f}x")
        print(f"{'':<18}packed work / unshared work (PackCosts): {ratio:.2f}: auto "
              f"{'shares' if ratio <= AUTO_MAX_WORK_FRACTION else 'does not share'} (at most {AUTO_MAX_WORK_FRACTION})")


if __name__ == "__main__":
    main()
