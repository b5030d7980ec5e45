"""Weight sync with LoRA: what a push moves and costs with full fine-tuning (full), LoRA with merged weights
(``backend.lora.sync: merged``) and LoRA adapters only (``sync: adapters``, merged by the engine).

A push is the backend's export (with LoRA ``merged``: W + alpha/rank B A for every adapted layer) and the
transport; the engine copies what it gets, or merges the adapters into the base weights it keeps. ``in_process``
reaches an engine in this process; ``shm`` and ``tensor`` a real ``miles engine serve`` process on 127.0.0.1.

    python benchmarks/lora_sync.py [--repeats 5] [--rank 8] [--targets all-linear]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from miles.engine import LocalEngine
from miles.rollout.plane import RolloutPlane
from miles.engine.router import Router
from miles.testing import build_tiny_model, make_train_batch
from miles.train.losses import ppo_clip
from miles.train.torch_backend import TorchBackend
from miles.weights.transports import InProcessTransport, SharedMemoryTransport, TensorTransport

from weight_sync import start_server, timed  # noqa: E402  (benchmarks/ is the script's folder)

SIZES = {"4M": (256, 5), "30M": (640, 6)}  # hidden, layers (head_dim 64), as in weight_sync.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="all-linear", help="target_modules: all-linear or comma-separated names")
    args = parser.parse_args()
    torch.set_num_threads(1)
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    modes = {"full": {}, "merged": {"lora": {"rank": args.rank, "target_modules": targets}},
             "adapters": {"lora": {"rank": args.rank, "target_modules": targets, "sync": "adapters"}}}
    columns = (("export", 7), ("in_process", 10), ("shm", 7), ("tensor", 7))
    print(f"LoRA rank {args.rank} on {args.targets}; ms, median of {args.repeats}; one torch thread")
    print(f"{'model':>5} {'sync':>8} {'tensors':>7} {'bytes':>11} | " + " ".join(f"{k:>{w}}" for k, w in columns))
    for label, (hidden, layers) in SIZES.items():
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_tiny_model(Path(tmp) / "m", hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                                         num_kv_heads=max(1, hidden // 128), head_dim=64, intermediate_size=3 * hidden)
            proc, url = start_server(model_dir)
            plane = RolloutPlane(router=Router([url]))
            local = LocalEngine()
            local.load_model(str(model_dir))
            local_plane = RolloutPlane(local_engines=[local])
            version = iter(range(1, 100_000))
            try:
                for mode, options in modes.items():
                    backend = TorchBackend(lr=1e-2, **options)
                    backend.setup(str(model_dir), seed=0)
                    backend.train_step(make_train_batch(seed=0, rows=6), ppo_clip)  # B != 0: the merge does work
                    weights = backend.export_weights()
                    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
                    row = {"export": timed(backend.export_weights, args.repeats),
                           "in_process": timed(lambda: InProcessTransport().push(backend, local_plane, next(version)),
                                               args.repeats)}
                    shm = SharedMemoryTransport()
                    try:
                        for name, transport in (("shm", shm), ("tensor", TensorTransport())):
                            transport.push(backend, plane, next(version))  # warm-up (the file and its mapping)
                            row[name] = timed(lambda t=transport: t.push(backend, plane, next(version)), args.repeats)
                    finally:
                        shm.close()
                    print(f"{label:>5} {mode:>8} {len(weights):>7} {nbytes:>11,} | "
                          + " ".join(f"{1000 * row[k]:{w}.1f}" for k, w in columns), flush=True)
                    backend.shutdown()
            finally:
                local_plane.close()
                plane.close()
                proc.terminate()
                proc.wait()


if __name__ == "__main__":
    main()
