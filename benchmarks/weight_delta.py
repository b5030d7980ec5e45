"""Delta weight pushes (``rollout.weight_sync: {name: shm or tensor, delta: true}``) against full ones: the
share of the weights' bytes that a training step changes, and the time of a push, for full fine-tuning and LoRA
(``merged``: the merged weights are pushed; ``adapters``: only the adapters), on the quickstart's and the ReTool
recipe's model shapes and a 30M-parameter one. The delta transports run with ``full_above: 1.0`` (a delta
however much changed: the default, 0.5, sends a push that changes more than half of the bytes whole).

Each configuration trains a few real steps with the torch backend (AdamW and the learning rate of the recipe's
config, on a small GRPO batch); after each step the weights are pushed four times, each to a ``miles engine
serve`` process of its own on 127.0.0.1: by ``shm`` and ``tensor`` (safetensors bytes over HTTP, what engines on
other machines get), each with ``delta: true`` and without. The changed share
is given at four granularities: whole tensors, blocks of 1 MiB and of 64 KiB (``block_kib``), single elements;
and for the weights cast to bfloat16 (what a GPU engine holds; 1 MiB blocks and elements), where a small update
often rounds to no change.
``verify`` is what the engine spends checking its weights' checksum before it applies a delta (a read of every
weight), timed in this process.

    python benchmarks/weight_delta.py [--steps 4] [--block-kib 1024] [--models quickstart,retool,30M]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from miles.engine.router import Router
from miles.rollout.plane import RolloutPlane
from miles.testing import build_tiny_model, make_train_batch
from miles.train.losses import ppo_clip
from miles.train.torch_backend import TorchBackend
from miles.weights.delta import changed_blocks, weights_checksum
from miles.weights.delta_transports import DeltaSharedMemoryTransport, DeltaTensorTransport
from miles.weights.transports import SharedMemoryTransport, TensorTransport

from weight_sync import start_server  # noqa: E402  (benchmarks/ is the script's folder)

ROOT = Path(__file__).resolve().parent.parent
LARGE = {"hidden_size": 640, "num_layers": 6, "num_heads": 10, "num_kv_heads": 5, "head_dim": 64,
         "intermediate_size": 1920}  # 30M, as in weight_sync.py


def recipe(name: str) -> tuple[dict, dict, float]:
    """The model build, tokenizer and backend learning rate of ``configs/<name>.yaml`` (30M: the quickstart's
    tokenizer and learning rate, a larger model)."""
    cfg = OmegaConf.load(ROOT / "configs" / f"{'quickstart' if name == '30M' else name}.yaml")
    build = OmegaConf.to_container(cfg.model.build)
    tokenizer = OmegaConf.to_container(cfg.model.tokenizer)
    return ({**build, **LARGE} if name == "30M" else build), tokenizer, float(cfg.backend.lr)


def share(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], block_bytes: int | None) -> float:
    """The share of the bytes in changed blocks of ``block_bytes`` (None: whole tensors; 0: single elements)."""
    total = changed = 0
    for name, tensor in new.items():
        nbytes = tensor.numel() * tensor.element_size()
        total += nbytes
        if block_bytes == 0:
            changed += int((tensor.view(-1) != old[name].view(-1)).sum()) * tensor.element_size()
        elif block_bytes is None:
            changed += nbytes if not torch.equal(tensor, old[name]) else 0
        else:
            blocks = changed_blocks(tensor, old[name], block_bytes)
            changed += sum(min(block_bytes, nbytes - i * block_bytes) for i in blocks)
    return changed / total if total else 0.0


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def snapshot(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone().contiguous() for name, t in weights.items()}


def run(model: str, mode: str, options: dict, args: argparse.Namespace) -> None:
    build, tokenizer, lr = recipe(model)
    alphabet = tokenizer.pop("alphabet")
    tokenizer.pop("kind", None)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "m", alphabet=alphabet, tokenizer=tokenizer, **build)
        transports = [DeltaSharedMemoryTransport(args.block_kib, 1.0), SharedMemoryTransport(),
                      DeltaTensorTransport(args.block_kib, 1.0), TensorTransport()]
        servers = [start_server(model_dir) for _ in transports]
        planes = [RolloutPlane(router=Router([url])) for _, url in servers]
        backend = TorchBackend(lr=lr, **options)
        backend.setup(str(model_dir), seed=0)
        try:
            weights = snapshot(backend.export_weights())
            for transport, plane in zip(transports, planes):  # the first push is whole for all
                transport.push(backend, plane, 1)
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())
            rows = []
            for step in range(1, args.steps + 1):
                backend.train_step(make_train_batch(seed=step, rows=6), ppo_clip)
                new = snapshot(backend.export_weights())
                bf16_old = {n: t.bfloat16() if t.is_floating_point() else t for n, t in weights.items()}
                bf16_new = {n: t.bfloat16() if t.is_floating_point() else t for n, t in new.items()}
                times = [timed(lambda t=t, p=p: t.push(backend, p, step + 1)) for t, p in zip(transports, planes)]
                rows.append((share(weights, new, None), share(weights, new, 1 << 20), share(weights, new, 64 << 10),
                             share(weights, new, 0), share(bf16_old, bf16_new, 1 << 20), share(bf16_old, bf16_new, 0),
                             *times))
                weights = new
            verify_s = statistics.median(timed(lambda: weights_checksum(weights, args.block_kib << 10))
                                         for _ in range(3))
            assert transports[0].stats["full_catch_ups"] == transports[2].stats["full_catch_ups"] == 0
            for step, (tensor, mib, kib64, element, bf16_mib, bf16, *times) in enumerate(rows, 1):
                print(f"{model:>10} {mode:>9} {nbytes / 1e6:8.2f} {step:>4} | {100 * tensor:6.1f} {100 * mib:6.1f} "
                      f"{100 * kib64:6.1f} {100 * element:7.1f} {100 * bf16_mib:9.1f} {100 * bf16:9.1f} | "
                      + " ".join(f"{1000 * t:8.1f}" for t in times) + f" {1000 * verify_s:7.1f}", flush=True)
        finally:
            backend.shutdown()
            for transport in transports:
                getattr(transport, "close", lambda: None)()
            for plane in planes:
                plane.close()
            for proc, _ in servers:
                proc.terminate()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--block-kib", type=int, default=1024, help="the delta transport's block_kib")
    parser.add_argument("--models", default="quickstart,retool,30M")
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modes = {"full": {}, "lora-all": {"lora": {"rank": args.rank, "target_modules": "all-linear"}},
             "lora-qv": {"lora": {"rank": args.rank, "target_modules": ["q_proj", "v_proj"]}},
             "adapters": {"lora": {"rank": args.rank, "target_modules": "all-linear", "sync": "adapters"}}}
    print(f"changed share of the pushed bytes (%) per step: whole tensors, 1 MiB blocks, 64 KiB blocks, elements; "
          f"in bf16: 1 MiB blocks, elements;\npush time (ms): shm and tensor, with delta: true (block_kib "
          f"{args.block_kib}) and without; verify: the engine's checksum of every weight. One torch thread; LoRA rank "
          f"{args.rank}.")
    print(f"{'model':>10} {'mode':>9} {'MB':>8} {'step':>4} | {'tensor':>6} {'1MiB':>6} {'64KiB':>6} {'element':>7} "
          f"{'bf16 1MiB':>9} {'bf16 elem':>9} | {'shm d':>8} {'shm':>8} {'tensor d':>8} {'tensor':>8} {'verify':>7}")
    for model in args.models.split(","):
        for mode, options in modes.items():
            run(model, mode, options, args)


if __name__ == "__main__":
    main()
