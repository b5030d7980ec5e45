"""Peak memory and step time of per-token log-probs and entropy: the whole path (the model's [tokens x vocab]
float32 logits) against the chunked path (``logprob_chunk_tokens``).

    python benchmarks/logprob_memory.py [--rows 4 --length 2048 --vocab 32768 --hidden 256 --layers 2]
                                        [--chunks 1024 2048 --steps 3 --repeats 1]

A random-init Qwen3 (vocabulary 32,768, hidden 256, 2 layers, tied embeddings; no download) and one batch of
4 rows x 2,048 tokens (8,192 tokens). A step is the forward and backward pass of a loss that uses the
log-probs and the entropy (with its gradient, as an entropy bonus needs), as a training micro-batch does.
Each variant runs in a fresh process: build the model, one warm-up step, reset the peak RSS (VmHWM, through
``/proc/self/clear_refs``), then ``steps`` steps. Reported: the peak RSS above the RSS just before those steps
(what the step itself adds: activations, logits, gradients), and the median step time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(args: argparse.Namespace) -> None:
    """Runs in a fresh process: one variant (``--chunk``, 0 for the whole path); prints its figures as JSON."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from miles.train.kernels import TorchKernel
    from miles.train.logprobs import token_logprobs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    heads = max(1, args.hidden // 64)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                         intermediate_size=3 * args.hidden, max_position_embeddings=args.length,
                         tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    input_ids = torch.randint(0, args.vocab, (args.rows, args.length))
    advantages = torch.randn(args.rows, args.length - 1)
    kernel = TorchKernel(**({"vocab_block": args.vocab_block} if args.vocab_block else {}))

    def step() -> float:
        start = time.perf_counter()
        logprobs, entropy = token_logprobs(model, input_ids, with_entropy=True, entropy_grad=True,
                                           chunk_tokens=args.chunk, kernel=kernel)
        loss = -(logprobs * advantages).mean() - 0.01 * entropy.mean()
        loss.backward()
        seconds = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return seconds

    step()  # warm-up
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current RSS
    base = _status_kib("VmRSS")
    times = [step() for _ in range(args.steps)]
    peak = _status_kib("VmHWM")
    print(json.dumps({"chunk": args.chunk, "peak_above_base_mib": round((peak - base) / 1024, 1),
                      "base_mib": round(base / 1024, 1), "step_s": round(statistics.median(times), 3),
                      "steps_s": [round(t, 3) for t in times]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--vocab-block", type=int, help="the torch kernel's vocab_block (default: its own)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every variant, interleaved")
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)  # the child's variant
    args = parser.parse_args()
    if args.chunk is not None:
        return child(args)

    shape = ["--rows", str(args.rows), "--length", str(args.length), "--vocab", str(args.vocab),
             "--hidden", str(args.hidden), "--layers", str(args.layers), "--steps", str(args.steps),
             *(["--vocab-block", str(args.vocab_block)] if args.vocab_block else [])]
    tokens = args.rows * (args.length - 1)
    print(f"Qwen3 vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers; {args.rows} x {args.length} tokens "
          f"({tokens} predicted); forward + backward of a loss on log-probs and entropy; {args.steps} steps, "
          f"median; one torch thread. The whole path's float32 logits alone: {tokens * args.vocab * 4 / 2**20:.0f} MiB")
    results: dict[int, list[dict]] = {chunk: [] for chunk in (0, *args.chunks)}
    for _ in range(args.repeats):
        for chunk in results:
            done = subprocess.run([sys.executable, __file__, *shape, "--chunk", str(chunk)], capture_output=True,
                                  text=True, check=True)
            results[chunk].append(json.loads(done.stdout.strip().splitlines()[-1]))
    whole_peak = statistics.median(r["peak_above_base_mib"] for r in results[0])
    whole_step = statistics.median(r["step_s"] for r in results[0])
    print(f"\n{'variant':<22}{'peak above base':>18}{'step':>10}{'memory ratio':>15}{'time ratio':>12}")
    for chunk, runs in results.items():
        peak = statistics.median(r["peak_above_base_mib"] for r in runs)
        step = statistics.median(r["step_s"] for r in runs)
        name = "whole (today)" if chunk == 0 else f"chunked, {chunk} tokens"
        print(f"{name:<22}{peak:>14.0f} MiB{step:>9.2f}s{whole_peak / peak:>14.1f}x{step / whole_step:>12.2f}")
    print("\nper run:", json.dumps({str(k): v for k, v in results.items()}))


if __name__ == "__main__":
    main()
