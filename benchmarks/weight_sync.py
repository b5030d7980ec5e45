"""Weight sync time per transport, for models of about 1M, 4M and 30M parameters, against the time
to copy the same bytes in memory (memcpy: into new tensors, as a clone does; copy: into tensors written
before, without page faults). The engine is a real `miles engine serve` process on 127.0.0.1
(in_process copies into an engine in this process; shm writes a file in /dev/shm that the engine maps).

    python benchmarks/weight_sync.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from miles.engine import LocalEngine
from miles.rollout.plane import RolloutPlane
from miles.engine.router import Router
from miles.testing import build_tiny_model
from miles.train.torch_backend import TorchBackend
from miles.weights.transports import (
    DiskTransport, DistributedTransport, InProcessTransport, SharedMemoryTransport, TensorTransport,
)

SIZES = {"1M": (128, 4), "4M": (256, 5), "30M": (640, 6)}  # hidden, layers (head_dim 64)


def start_server(model_dir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "miles", "engine", "serve", "--model", str(model_dir),
                             "--port", str(port)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("engine did not start")


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    columns = (("memcpy", 8), ("copy", 6), ("in_process", 10), ("shm", 8), ("tensor", 8), ("disk", 8),
               ("distributed", 11))
    print(f"{'model':>6} {'params':>8} {'MB':>7} | " + " ".join(f"{k:>{w}}" for k, w in columns)
          + f"  (ms, median of {args.repeats}) | shm/memcpy shm/copy")
    for label, (hidden, layers) in SIZES.items():
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_tiny_model(Path(tmp) / "m", hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                                         num_kv_heads=max(1, hidden // 128), head_dim=64, intermediate_size=3 * hidden)
            backend = TorchBackend()
            backend.setup(str(model_dir), seed=0)
            weights = backend.export_weights()
            params = sum(t.numel() for name, t in weights.items() if name != "lm_head.weight")
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())
            row = {"memcpy": timed(lambda: {k: v.clone() for k, v in weights.items()}, args.repeats)}
            # the same bytes into memory written before: no page faults, the floor of any copy
            copies = {k: v.clone() for k, v in weights.items()}
            row["copy"] = timed(lambda: [copies[k].copy_(v) for k, v in weights.items()], args.repeats)

            local = LocalEngine()
            local.load_model(str(model_dir))
            local_plane = RolloutPlane(local_engines=[local])
            row["in_process"] = timed(lambda: InProcessTransport().push(backend, local_plane, 1), args.repeats)
            local_plane.close()

            proc, url = start_server(model_dir)
            plane = RolloutPlane(router=Router([url]))
            shm = SharedMemoryTransport()
            try:
                version = iter(range(1, 10_000))
                for name, transport in (("shm", shm), ("tensor", TensorTransport()),
                                        ("disk", DiskTransport(dir=str(Path(tmp) / "w"))),
                                        ("distributed", DistributedTransport())):
                    transport.push(backend, plane, next(version))  # warm-up (the file, the group, their mappings)
                    row[name] = timed(lambda t=transport: t.push(backend, plane, next(version)), args.repeats)
            finally:
                shm.close()
                plane.close()
                proc.terminate()
                proc.wait()
        print(f"{label:>6} {params / 1e6:7.2f}M {nbytes / 2**20:7.1f} | "
              + " ".join(f"{1000 * row[k]:{w}.1f}" for k, w in columns)
              + f"  | {row['shm'] / row['memcpy']:9.2f}x {row['shm'] / row['copy']:7.2f}x")


if __name__ == "__main__":
    main()
