"""Router overhead per request: the same small requests sent straight to an engine, through the
in-process router, and through the standalone router server (`miles router serve`), one at a time.

    python benchmarks/router_overhead.py [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from miles.engine.router import Router
from miles.testing import build_tiny_model

BODY = {"input_ids": [4, 13, 5, 14], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "miles", *args, "--port", str(port)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc


async def wait_up(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not start")


async def measure(n: int, engine_url: str, router_url: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "router (in process)": [], "router server": []}
    async with aiohttp.ClientSession() as session, Router([engine_url]) as router:
        async def direct(url: str) -> None:
            async with session.post(url + "/generate", json=BODY) as resp:
                await resp.json()

        calls = {"direct": lambda: direct(engine_url), "router (in process)": lambda: router.generate(**BODY),
                 "router server": lambda: direct(router_url)}
        for _ in range(10):  # warm-up
            for call in calls.values():
                await call()
        for _ in range(n):  # interleaved, so that drift on a busy machine hits all three alike
            for name, call in calls.items():
                start = time.perf_counter()
                await call()
                out[name].append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "m")
        engine_port, router_port = free_port(), free_port()
        engine_url, router_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{router_port}"
        procs = [start(["engine", "serve", "--model", str(model)], engine_port)]
        try:
            asyncio.run(wait_up(engine_url))
            procs.append(start(["router", "serve", "--engine", engine_url], router_port))
            asyncio.run(wait_up(router_url))
            results = asyncio.run(measure(args.requests, engine_url, router_url))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait()
    base = statistics.median(results["direct"])
    print(f"{args.requests} sequential requests of 1 new token, median latency:")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"  {name:20s} {1000 * median:7.2f} ms  (overhead {1000 * (median - base):+6.2f} ms)")


if __name__ == "__main__":
    main()
