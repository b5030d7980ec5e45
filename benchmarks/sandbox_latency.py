"""Latency of the builtin ``local`` sandbox: ``python3 -c 'print(1)'`` run through LocalSandbox, one at a
time and 16 at once, in bwrap and subprocess mode, next to the same command started bare (bwrap with the
same mounts and namespaces, or a plain process) with asyncio. Target: sandbox / bare <= 1.3.

Then cold against warm, per call: ``print(1)`` as a command in a fresh process (cold) and in the sandbox's
persistent interpreter (``warm: true``, ``run_python``), 1 and 16 sandboxes at once, each call's latency.
Target: warm p50 <= 5 ms and p99 <= 50 ms at 16 at once. Beside them (bwrap mode), the reset that lets a pool
lend a warm sandbox to the next trajectory (``LocalSandbox.reset``: its processes killed, its files put back and
verified, a new interpreter session), after a call that left a file, a process and a global: p50 and p99.

    python benchmarks/sandbox_latency.py [--runs 30] [--repeats 5] [--rounds 30]
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


async def per_call(isolation: str, warm: bool, at_once: int, rounds: int) -> list[float]:
    """Seconds per call of ``at_once`` sandboxes running ``print(1)`` together, ``rounds`` times (started sandboxes:
    what a pool hands out)."""
    sandboxes = [LocalSandbox(isolation=isolation, warm=warm) for _ in range(at_once)]
    await asyncio.gather(*(sandbox.start() for sandbox in sandboxes))

    async def one(sandbox: LocalSandbox) -> float:
        started = time.perf_counter()
        result = await (sandbox.run_python("print(1)", timeout_s=60) if warm else sandbox.run(COMMAND, timeout_s=60))
        assert result.stdout == "1\n", result
        return time.perf_counter() - started

    times: list[float] = []
    try:
        for round_ in range(3 + rounds):  # 3 to warm up
            latencies = await asyncio.gather(*(one(sandbox) for sandbox in sandboxes))
            times += latencies if round_ >= 3 else []
    finally:
        await asyncio.gather(*(sandbox.close() for sandbox in sandboxes))
    return times


LEAVE = "import subprocess\nleft = 1\nopen('left.txt', 'w').write('x')\nsubprocess.Popen(['sleep', '60'])"


async def per_reset(at_once: int, rounds: int) -> list[float]:
    """Seconds per reset of ``at_once`` warm bwrap sandboxes reset together, each after a call that left a global,
    a file and a process (the call's end kills the process; the reset checks that nothing is left)."""
    sandboxes = [LocalSandbox(isolation="bwrap", warm=True) for _ in range(at_once)]
    await asyncio.gather(*(sandbox.start() for sandbox in sandboxes))

    async def one(sandbox: LocalSandbox) -> float:
        assert (await sandbox.run_python(LEAVE, timeout_s=60)).exit_code == 0
        started = time.perf_counter()
        await sandbox.reset()
        return time.perf_counter() - started

    times: list[float] = []
    try:
        for round_ in range(3 + rounds):  # 3 to warm up
            latencies = await asyncio.gather(*(one(sandbox) for sandbox in sandboxes))
            times += latencies if round_ >= 3 else []
    finally:
        await asyncio.gather(*(sandbox.close() for sandbox in sandboxes))
    return times


async def cold_against_warm(modes: list[str], rounds: int) -> None:
    print(f"\n{'mode':<11} {'at once':>7} {'cold p50 ms':>12} {'cold p99 ms':>12} {'warm p50 ms':>12} "
          f"{'warm p99 ms':>12} {'p50 ratio':>10} {'reset p50 ms':>13} {'reset p99 ms':>13}")
    for mode in modes:
        for at_once in (1, BATCH):
            cold = await per_call(mode, False, at_once, rounds)
            warm = await per_call(mode, True, at_once, rounds)
            resets = await per_reset(at_once, rounds) if mode == "bwrap" else []  # subprocess mode: never reused
            cold_p50, warm_p50 = statistics.median(cold), statistics.median(warm)
            reset = (f"{statistics.median(resets) * 1e3:>13.2f} {percentile(resets, 0.99) * 1e3:>13.2f}" if resets
                     else f"{'-':>13} {'-':>13}")
            print(f"{mode:<11} {at_once:>7} {cold_p50 * 1e3:>12.1f} {percentile(cold, 0.99) * 1e3:>12.1f} "
                  f"{warm_p50 * 1e3:>12.2f} {percentile(warm, 0.99) * 1e3:>12.2f} "
                  f"{cold_p50 / warm_p50:>9.0f}x {reset}")


async def main(runs: int, repeats: int, rounds: int) -> None:
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
    await cold_against_warm([mode for mode, _, _ in rows], rounds)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=30, help="rounds of the cold/warm comparison")
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.repeats, args.rounds))
