"""Latency of the builtin ``local`` sandbox: ``python3 -c 'print(1)'`` run through LocalSandbox, one at a
time and 16 at once, in bwrap and subprocess mode, next to the same command started bare (bwrap with the
same mounts and namespaces, or a plain process) with asyncio. Target: sandbox / bare <= 1.3.

    python benchmarks/sandbox_latency.py [--runs 30] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

from miles.agentic.sandboxes.local import LocalSandbox, bwrap_problem, describe_isolation

COMMAND = "python3 -c 'print(1)'"
BATCH = 16


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def bare(argv: list[str], workspace: str) -> None:
    """The command started plainly, with the environment and working directory the sandbox gives it."""
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": workspace, "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                cwd=workspace, env=env)
    out, _ = await proc.communicate()
    assert out == b"1\n", out


async def timed(awaitable: Awaitable) -> float:
    started = time.perf_counter()
    await awaitable
    return time.perf_counter() - started


async def measure(ways: list[Callable[[], Awaitable[None]]], runs: int,
                  repeats: int) -> list[tuple[list[float], list[float]]]:
    """For each way of running the command: seconds per run one at a time, and per batch of 16 at once.
    The ways take turns, so that a change in the machine's load falls on all of them alike."""
    times = [([], []) for _ in ways]
    for _ in range(3):  # warm up
        for one in ways:
            await one()
    for _ in range(runs):
        for one, (single, _) in zip(ways, times):
            single.append(await timed(one()))
    for _ in range(repeats):
        for one, (_, batches) in zip(ways, times):
            batches.append(await timed(asyncio.gather(*(one() for _ in range(BATCH)))))
    return times


async def main(runs: int, repeats: int) -> None:
    print(describe_isolation("auto"))
    rows = []
    with tempfile.TemporaryDirectory() as workspace:
        bwrap_argv = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                      "--bind", workspace, workspace, "--chdir", workspace, "--unshare-all", "--die-with-parent",
                      "python3", "-c", "print(1)"]
        modes = [("subprocess", ["python3", "-c", "print(1)"])]
        if bwrap_problem() is None:
            modes.insert(0, ("bwrap", bwrap_argv))
        for mode, bare_argv in modes:
            sandbox = LocalSandbox(isolation=mode)

            async def through_sandbox() -> None:
                result = await sandbox.run(COMMAND, timeout_s=60)
                assert result.stdout == "1\n", result

            try:
                ours, theirs = await measure([through_sandbox, lambda: bare(bare_argv, workspace)], runs, repeats)
            finally:
                await sandbox.close()
            rows.append((mode, ours, theirs))

    print(f"{'mode':<11} {'what':<24} {'sandbox ms':>11} {'bare ms':>9} {'ratio':>6}")
    for mode, (single, batch), (bare_single, bare_batch) in rows:
        for what, mine, base in (
            ("1 run p50", statistics.median(single), statistics.median(bare_single)),
            ("1 run p99", percentile(single, 0.99), percentile(bare_single, 0.99)),
            (f"{BATCH} at once p50 (wall)", statistics.median(batch), statistics.median(bare_batch)),
            (f"{BATCH} at once max (wall)", max(batch), max(bare_batch)),
        ):
            print(f"{mode:<11} {what:<24} {mine * 1e3:>11.1f} {base * 1e3:>9.1f} {mine / base:>6.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.repeats))
