"""The builtin ``local`` sandbox: the conformance suite in both isolation modes, and what a command
may do to it (loop forever, fork bomb, eat memory, flood output, escape the workspace, be orphaned)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from miles.agentic.sandboxes import local as sandboxes
from miles.agentic.sandboxes import processes
from miles.agentic.sandboxes.local import LocalSandbox, describe_isolation
from miles.testing import SandboxConformance, make_registry

needs_bwrap = pytest.mark.skipif(sandboxes.bwrap_problem() is not None,
                                 reason=f"bwrap does not work here: {sandboxes.bwrap_problem()}")
MODES = [pytest.param("bwrap", marks=needs_bwrap), "subprocess"]
gone, unique_sleep = SandboxConformance.wait_until_gone, SandboxConformance.unique_sleep
sleeping = SandboxConformance.pids_of  # the pids of a command itself, not of the shells that mention it


@needs_bwrap
class TestBwrapSandbox(SandboxConformance):
    def make_sandbox(self) -> LocalSandbox:
        return LocalSandbox(isolation="bwrap")


class TestSubprocessSandbox(SandboxConformance):
    isolated = False

    def make_sandbox(self) -> LocalSandbox:
        return LocalSandbox(isolation="subprocess")


@pytest.fixture
def workspace_root():
    """A directory for workspaces that uid nobody can reach (pytest's tmp_path is private to root)."""
    with tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o711)
        yield root


def run(command: str, timeout_s: float = 30, files: dict | None = None, **config) -> tuple:
    """``command`` in a fresh sandbox, then ``echo ok`` in it (the sandbox still works); both results."""
    async def main():
        sandbox = LocalSandbox(**config)
        try:
            return (await sandbox.run(command, timeout_s=timeout_s, files=files),
                    await sandbox.run("echo ok", timeout_s=30))
        finally:
            await sandbox.close()

    return asyncio.run(main())


# -- what a command may do --------------------------------------------------------------------------------

@pytest.mark.parametrize("isolation", MODES)
def test_an_infinite_loop_is_killed_at_the_timeout(isolation: str) -> None:
    started = time.monotonic()
    result, after = run("python3 -c 'while True: pass'", timeout_s=1, isolation=isolation)
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - started < 20
    assert after.stdout == "ok\n"


@pytest.mark.parametrize("isolation", MODES)
def test_an_infinite_loop_is_killed_by_the_cpu_limit(isolation: str) -> None:
    result, _ = run("python3 -c 'while True: pass'", timeout_s=120, isolation=isolation, cpu_s=1)
    assert not result.timed_out
    assert result.exit_code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL)


FORK_COUNT = """
import os, signal, time
children = []
for _ in range(500):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    children.append(pid)
print(len(children))
for pid in children:
    os.kill(pid, signal.SIGKILL)
"""

FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


@needs_bwrap  # subprocess mode has no process limit (see miles.agentic.sandboxes.local)
def test_the_process_limit_holds_per_run() -> None:
    async def main():
        sandbox = LocalSandbox(isolation="bwrap", max_procs=32)
        try:
            files = {"fork.py": FORK_COUNT.encode()}
            return await asyncio.gather(*(sandbox.run("python3 fork.py", timeout_s=60, files=files) for _ in range(3)))
        finally:
            await sandbox.close()

    for result in asyncio.run(main()):  # each run may start its own 32, at the same time
        assert result.exit_code == 0, result.stderr
        assert 25 < int(result.stdout) < 32


@needs_bwrap
def test_a_fork_bomb_is_contained() -> None:
    marker = f"bomb{os.getpid()}{time.monotonic_ns()}.py"
    result, after = run(f"python3 {marker}", timeout_s=3, files={marker: FORK_BOMB.encode()}, isolation="bwrap")
    assert result.timed_out
    assert after.stdout == "ok\n"
    assert gone(marker) == []
    assert subprocess.run(["true"], timeout=30).returncode == 0  # this machine can still start processes


@pytest.mark.parametrize("isolation", MODES)
def test_allocating_4_gb_fails_inside(isolation: str) -> None:
    result, after = run("python3 -c 'b = bytearray(4 << 30)'", isolation=isolation, memory_mb=512)
    assert result.exit_code not in (0, None) and not result.timed_out
    assert "MemoryError" in result.stderr
    assert after.stdout == "ok\n"


@pytest.mark.parametrize("isolation", MODES)
def test_10_mb_of_output_is_cut_with_a_marker(isolation: str) -> None:
    result, _ = run("head -c 10000000 /dev/zero | tr '\\0' x; head -c 5000 /dev/zero | tr '\\0' y >&2",
                    isolation=isolation, output_bytes=1000)
    assert result.stdout == "x" * 1000 + "\n[... 9999000 more bytes cut]"
    assert result.stderr == "y" * 1000 + "\n[... 4000 more bytes cut]"


@pytest.mark.parametrize("isolation", MODES)
def test_a_background_process_ends_with_its_run(isolation: str) -> None:
    sleep = unique_sleep()
    result, _ = run(f"{sleep} & echo started", isolation=isolation)
    assert result.stdout == "started\n" and result.duration_s < 20
    assert gone(sleep) == []


@needs_bwrap
def test_bwrap_isolates_network_and_filesystem() -> None:
    home = os.path.expanduser("~")
    result, _ = run(f"touch /etc/miles-x; touch {home}/miles-x; python3 -c \"import socket; "
                    f"socket.create_connection(('1.1.1.1', 53), timeout=3)\"", isolation="bwrap")
    assert "Read-only file system" in result.stderr and "Network is unreachable" in result.stderr
    assert not os.path.exists("/etc/miles-x") and not os.path.exists(f"{home}/miles-x")


def test_files_never_follow_a_symlink_out_of_the_workspace(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()

    async def main():
        sandbox = LocalSandbox(isolation="subprocess")
        try:
            await sandbox.run(f"ln -s {outside} link; ln -s {outside}/f.txt f.txt", timeout_s=30)
            for path in ("link/f.txt", "f.txt", "../f.txt", "/tmp/f.txt", ""):
                with pytest.raises(ValueError, match="files"):
                    await sandbox.run("true", timeout_s=30, files={path: b"x"})
        finally:
            await sandbox.close()

    asyncio.run(main())
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("isolation", MODES)
def test_no_sandbox_process_outlives_a_killed_rollout(isolation: str, workspace_root: str) -> None:
    sleep = unique_sleep()
    script = textwrap.dedent(f"""
        import asyncio
        from miles.agentic.sandboxes.local import LocalSandbox
        sandbox = LocalSandbox(isolation={isolation!r}, workspace_root={workspace_root!r})
        asyncio.run(sandbox.run({sleep!r} + "; true", timeout_s=600))  # sleep is a grandchild: sh forks it
    """)
    rollout = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not sleeping(sleep) and time.monotonic() < deadline:
            assert rollout.poll() is None, "the rollout process ended by itself"
            time.sleep(0.05)
        assert sleeping(sleep), "the sandboxed sleep never started"
    finally:
        rollout.send_signal(signal.SIGKILL)
        rollout.wait()
    assert gone(sleep) == []  # bwrap, sh and sleep: their command lines all hold the marker


@pytest.mark.parametrize("isolation", MODES)
def test_close_while_a_run_is_starting_ends_it(isolation: str) -> None:
    sleep = unique_sleep()

    async def main():
        sandbox = LocalSandbox(isolation=isolation)
        running = asyncio.ensure_future(sandbox.run(sleep, timeout_s=120))
        await asyncio.sleep(0)  # the run has forked and waits for its pipes to connect
        await sandbox.close()
        done, _ = await asyncio.wait({running}, timeout=60)
        if running in done:
            running.exception()  # ending with an error is fine too
        return running in done

    for _ in range(10):  # bwrap is still setting up: its --die-with-parent is not in place yet
        assert asyncio.run(main())
    assert gone(sleep) == []


@pytest.mark.parametrize("isolation", MODES)
def test_stdin_is_empty(isolation: str) -> None:
    result, _ = run("cat; echo done", timeout_s=20, isolation=isolation)
    assert (result.stdout, result.timed_out) == ("done\n", False)


@pytest.mark.parametrize("isolation", MODES)
def test_no_sandbox_process_outlives_a_rollout_killed_at_any_moment_of_its_start(isolation: str,
                                                                                 workspace_root: str) -> None:
    """The rollout SIGKILLed at every fork and exec of the run's processes, each held there (see
    tests/start_up_moments.py). The moment that once left a process behind: bwrap killed right after it
    made its namespace child and before it released it (the child then waited forever on an eventfd)."""
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("start_up_moments.py")), isolation,
                           workspace_root], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    if "error" in report:
        pytest.skip(report["error"])
    left = {trial["moment"]: gone(trial["sleep"]) for trial in report["trials"]}
    try:
        assert left == dict.fromkeys(report["moments"], [])
        assert all(trial["reached"] for trial in report["trials"]), report["trials"]
    finally:
        for pid in {pid for pids in left.values() for pid in pids}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert report["moments"][-1].endswith("exec sleep"), report["moments"]  # up to the command itself
    made = "fork bwrap" if isolation == "bwrap" else "fork python"  # bwrap's namespace child; the reaper's command
    # the program's name as the kernel has it: python, python3.11, ...
    assert any(m.startswith("rollout.") and made in m for m in report["moments"]), report["moments"]


# -- the disk quota ---------------------------------------------------------------------------------------

# Ways a command may write without end (the sandboxes below have disk_mb=10).
WRITE_FOREVER = {
    "one big file": "cat /dev/zero > big",
    "many small files": "i=0; while true; do i=$((i+1)); head -c 100000 /dev/zero > f$i; done",
    "appending": "while true; do head -c 100000 /dev/zero >> log; done",
    "temporary files": 'i=0; while true; do i=$((i+1)); head -c 100000 /dev/zero > "$TMPDIR/f$i"; done',
    "in python": "python3 -c \"import os\nwhile True: open(os.urandom(8).hex(), 'wb').write(bytes(100000))\"",
}
QUOTA_EXCEEDED = r"\n\[sandbox: disk quota exceeded: the sandbox held \d+\.\d MiB, more than disk_mb=10; " \
                 r"the command was stopped. Remove files to go on\]$"


@pytest.mark.parametrize("isolation", MODES)
@pytest.mark.parametrize("how", WRITE_FOREVER)
def test_a_command_that_writes_past_the_disk_quota_is_stopped_and_the_sandbox_goes_on(isolation: str,
                                                                                       how: str) -> None:
    """The writes never end by themselves (but for one file, which stops at the largest file the quota
    allows): only the quota ends the command, with exit code 1 and a line saying why."""
    async def main():
        sandbox = LocalSandbox(isolation=isolation, disk_mb=10)
        try:
            over = await sandbox.run(WRITE_FOREVER[how], timeout_s=120)
            more = await sandbox.run("echo more >> more.txt", timeout_s=30)  # grows a sandbox over its quota
            look = await sandbox.run("ls > /dev/null && echo looked", timeout_s=30)  # writes nothing
            clean = await sandbox.run("rm -rf ./* && echo small > small.txt && cat small.txt", timeout_s=30)
            return over, more, look, clean
        finally:
            await sandbox.close()

    over, more, look, clean = asyncio.run(main())
    assert (over.exit_code, over.timed_out) == (sandboxes.QUOTA_EXIT_CODE, False), over
    assert re.search(QUOTA_EXCEEDED, over.stderr), over.stderr
    if how != "temporary files":  # a run's temporary folder goes with it: the sandbox is back under its quota
        assert more.exit_code == sandboxes.QUOTA_EXIT_CODE and re.search(QUOTA_EXCEEDED, more.stderr), more
        assert (look.stdout, look.exit_code) == ("looked\n", 0)
    assert (clean.stdout, clean.stderr, clean.exit_code) == ("small\n", "", 0)


def test_no_file_grows_past_the_disk_quota() -> None:
    """The file-size limit is the smaller of file_mb and disk_mb: one file can never take the sandbox far
    past its quota, however fast it is written."""
    result, after = run("head -c 30000000 /dev/zero > big; wc -c < big", disk_mb=10, file_mb=64)
    assert result.stdout == f"{10 << 20}\n" and "File size limit exceeded" in result.stderr
    result, _ = run("head -c 30000000 /dev/zero > big; wc -c < big", disk_mb=100, file_mb=5)
    assert result.stdout == f"{5 << 20}\n" and "disk quota" not in result.stderr


@pytest.mark.parametrize("isolation", MODES)
def test_files_that_would_not_fit_in_the_disk_quota_are_refused(isolation: str) -> None:
    async def main():
        sandbox = LocalSandbox(isolation=isolation, disk_mb=10)
        try:
            six = bytes(6 << 20)
            first = await sandbox.run("wc -c < a.bin", timeout_s=30, files={"a.bin": six})
            again = await sandbox.run("wc -c < a.bin", timeout_s=30, files={"a.bin": six})  # replaces it: fits
            with pytest.raises(ValueError, match=r"files: writing them would take the sandbox to 12\.\d MiB, more "
                                                 r"than its disk quota disk_mb=10; raise disk_mb or write less"):
                await sandbox.run("true", timeout_s=30, files={"b.bin": six})
            return first, again, await sandbox.run("ls", timeout_s=30)
        finally:
            await sandbox.close()

    first, again, listing = asyncio.run(main())
    assert first.stdout == again.stdout == f"{6 << 20}\n"
    assert listing.stdout == "a.bin\n"  # nothing of the refused files was written


@pytest.mark.parametrize("isolation", MODES)
def test_each_run_has_a_fresh_temporary_folder_that_goes_with_it(isolation: str, workspace_root: str) -> None:
    async def main():
        sandbox = LocalSandbox(isolation=isolation, workspace_root=workspace_root)
        try:
            first = await sandbox.run('echo x > "$TMPDIR/x"; ls "$TMPDIR" | grep -c "^x$"; echo "$TMPDIR"',
                                      timeout_s=30)
            second = await sandbox.run('ls "$TMPDIR" | grep -c "^x$"', timeout_s=30)
            return first, second
        finally:
            await sandbox.close()

    first, second = asyncio.run(main())
    assert first.stdout.startswith("1\n") and second.stdout == "0\n"
    assert not os.path.exists(first.stdout.split()[-1]) or isolation == "bwrap"  # bwrap: /tmp is the run's own


@pytest.mark.skipif(os.geteuid() != 0, reason="commands run as nobody only when Miles runs as root")
def test_a_command_cannot_kill_or_stop_its_reaper() -> None:
    """Subprocess mode: the reaper (the command's parent) runs as root, the command as nobody."""
    sleep = unique_sleep()
    result, after = run(f"setsid {sleep} & kill -KILL $PPID; kill -STOP $PPID; echo tried", isolation="subprocess")
    assert result.stdout == "tried\n" and result.stderr.count("Operation not permitted") == 2, result
    assert after.stdout == "ok\n"
    assert gone(sleep) == []


def test_close_is_idempotent_and_removes_the_workspace(workspace_root: str) -> None:
    async def main():
        sandbox = LocalSandbox(isolation="subprocess", workspace_root=workspace_root)
        await sandbox.run("mkdir -p locked/in && touch locked/in/f && chmod 500 locked/in locked", timeout_s=30)
        await sandbox.close()
        await sandbox.close()
        with pytest.raises(RuntimeError, match="closed"):
            await sandbox.run("true", timeout_s=30)

    asyncio.run(main())
    assert os.listdir(workspace_root) == []


# -- configuration --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "named"), [
    ({"isolation": "docker"}, "isolation"), ({"cpu_s": 0}, "cpu_s"), ({"memory_mb": "1G"}, "memory_mb"),
    ({"max_procs": True}, "max_procs"), ({"output_bytes": -1}, "output_bytes"), ({"disk_mb": 0}, "disk_mb"),
    ({"disk_mb": 1.5}, "disk_mb"),
    ({"workspace_root": "/no/such/dir"}, "workspace_root"),
    ({"isolation": "subprocess", "mounts": ["/app"]}, "mounts: need isolation bwrap"),
    ({"isolation": "bwrap", "mounts": ["app"]}, "mounts: expected absolute"),
    ({"isolation": "bwrap", "mounts": ["/usr/app"]}, "/usr exists on this machine"),
    ({"isolation": "bwrap", "mounts": ["/app"], "cwd": "/elsewhere"}, "cwd: expected one of the mounts"),
])
def test_bad_arguments_are_named(args: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        LocalSandbox(**args)


@needs_bwrap
def test_mounts_hold_files_at_fixed_paths_for_a_task(tmp_path: Path) -> None:
    """A task that expects /app and /logs/verifier: files go in by absolute path, commands start in cwd,
    what they write there comes out with read_file, and the rest of the root stays read-only."""
    from miles.agentic import EnvContext

    async def main():
        ctx = EnvContext(sandbox_factory=functools.partial(LocalSandbox, isolation="bwrap"))
        sandbox = ctx.open_sandbox(mounts=["/app", "/logs/verifier"], cwd="/app")
        with pytest.raises(RuntimeError, match="open already"):
            ctx.open_sandbox()
        try:
            first = await sandbox.run("pwd; python3 main.py > /logs/verifier/reward.txt; touch /usr/x", timeout_s=30,
                                      files={"/app/main.py": b"print(0.5)"})
            second = await sandbox.run("cat /logs/verifier/reward.txt; ls", timeout_s=30)
            with pytest.raises(ValueError, match="inside a mount"):
                await sandbox.run("true", timeout_s=30, files={"/etc/passwd": b"x"})
            return first, second, await sandbox.read_file("/logs/verifier/reward.txt")
        finally:
            await ctx.close()

    first, second, reward = asyncio.run(main())
    assert first.stdout == "/app\n" and "Read-only file system" in first.stderr
    assert second.stdout == "0.5\nmain.py\n" and reward == b"0.5\n"
    assert not os.path.exists("/app") and not os.path.exists("/usr/x")


def test_local_is_registered() -> None:
    assert make_registry().get("sandbox", "local").obj is LocalSandbox


def test_auto_falls_back_to_subprocess_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(processes, "bwrap_problem", lambda: "bwrap is not installed")
    processes.resolve_isolation.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=sandboxes.__name__):
            assert LocalSandbox().isolation == "subprocess"
            assert LocalSandbox().isolation == "subprocess"
        warnings = [r.getMessage() for r in caplog.records if "NOT isolated" in r.getMessage()]
        assert len(warnings) == 1 and "install bubblewrap" in warnings[0]  # once per process
        assert "NOT isolated" in describe_isolation("auto")
        with pytest.raises(ValueError, match="isolation: 'bwrap' does not work here"):
            LocalSandbox(isolation="bwrap")
    finally:
        processes.resolve_isolation.cache_clear()


@needs_bwrap
def test_describe_isolation_says_what_auto_picks() -> None:
    assert describe_isolation("auto").startswith("local sandbox: bubblewrap")
    assert LocalSandbox.describe(cpu_s=5) == describe_isolation("auto")
    assert "NOT isolated" in LocalSandbox.describe(isolation="subprocess")
    with pytest.raises(ValueError, match="memory_mb"):
        LocalSandbox.describe(memory_mb=0)
