"""``SandboxConformance``: the contract every sandbox keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.testing.fixtures import pytest


# Ways a process a command starts may try to outlive it; {} is a command line no other process has.
ESCAPES = {
    "background": "{} >/dev/null 2>&1 &",
    "nohup": "nohup {} >/dev/null 2>&1 &",
    "setsid": "setsid {} &",  # its own session, and it keeps the run's output pipes open
    # its own process group, as job control makes one
    "process group": "python3 -c 'import os, sys; os.setpgid(0, 0); os.execvp(\"sleep\", sys.argv[1:])' {} &",
    "double fork": "( ({} >/dev/null 2>&1 &) & )",  # an orphan
    "daemon": "python3 daemon.py {}",  # all of it, and it ignores SIGTERM, SIGHUP and SIGINT
}
# The "daemon" escape: fork, new session, fork again, no inherited files, deaf to the polite signals.
DAEMON = b"""import os, signal, sys
for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN)
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.execvp(sys.argv[1], sys.argv[1:])
"""


class SandboxConformance:
    """The contract every sandbox keeps. Subclass it in a test module of your sandbox plugin:

        class TestMySandbox(SandboxConformance):
            isolated = True  # False skips the network and filesystem isolation checks

            def make_sandbox(self):
                return MySandbox(...)

    Each check opens a fresh sandbox, runs commands in it with ``asyncio.run`` and closes it. The checks
    that look for leftover processes look at this machine's ``/proc``: for a remote sandbox
    ``test_nothing_is_left_running_after_close`` passes trivially, and the checks of ``ESCAPES`` (processes
    that leave their command's process group, session or parent) skip.
    """

    isolated: bool = True

    def make_sandbox(self) -> Any:
        raise NotImplementedError

    @staticmethod
    def pids_running(marker: str) -> list[int]:
        """Processes on this machine whose command line contains ``marker`` (zombies have none)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if marker in cmdline:
                    pids.append(int(entry.name))
        return pids

    @staticmethod
    def pids_of(command: str) -> list[int]:
        """Processes on this machine whose command line is ``command`` (not the shells that mention it)."""
        return [pid for pid in SandboxConformance.pids_running(command) if _command_line(pid) == command]

    @staticmethod
    def wait_until_gone(marker: str, timeout_s: float = 30.0) -> list[int]:
        """Poll until no process on this machine has ``marker`` in its command line; what is left then."""
        import time

        deadline = time.monotonic() + timeout_s
        while (left := SandboxConformance.pids_running(marker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    @staticmethod
    def unique_sleep() -> str:
        """A ``sleep`` command line no other process has, to find its process by (``sleep 1000.<digits>``)."""
        import random

        return f"sleep 1000.{random.randrange(10**8):08d}"

    def _with_sandbox(self, body: Any) -> Any:
        """``await body(sandbox)`` on a fresh sandbox, closed afterwards."""
        import asyncio

        async def main() -> Any:
            sandbox = self.make_sandbox()
            try:
                return await body(sandbox)
            finally:
                await sandbox.close()

        return asyncio.run(main())

    def _run(self, command: str, timeout_s: float = 30, **kwargs: Any) -> Any:
        return self._with_sandbox(lambda sandbox: sandbox.run(command, timeout_s=timeout_s, **kwargs))

    def _skip_unless_isolated(self) -> None:
        if not self.isolated:
            pytest.skip("this sandbox declares no isolation (isolated = False)")

    def test_echo(self) -> None:
        result = self._run("echo hello sandbox")
        assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == ("hello sandbox\n", "", 0, False)
        assert result.duration_s >= 0

    def test_stderr_is_captured(self) -> None:
        result = self._run("echo oops >&2; echo out")
        assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "oops\n", 0)

    def test_exit_codes(self) -> None:
        async def body(sandbox: Any) -> list[int]:
            return [(await sandbox.run(command, timeout_s=30)).exit_code for command in ("true", "exit 3", "false")]

        assert self._with_sandbox(body) == [0, 3, 1]

    def test_files_are_written_into_the_workspace_and_kept_between_runs(self) -> None:
        blob = bytes(range(256)) * 4

        async def body(sandbox: Any) -> tuple[Any, Any]:
            first = await sandbox.run("cat a.txt; wc -c < data/blob.bin; echo made > made.txt", timeout_s=30,
                                      files={"a.txt": b"hi\n", "data/blob.bin": blob})
            second = await sandbox.run("cat made.txt a.txt; cmp data/blob.bin data/copy.bin && echo same", timeout_s=30,
                                       files={"data/copy.bin": blob})
            return first, second

        first, second = self._with_sandbox(body)
        assert (first.stdout.split(), first.exit_code) == (["hi", "1024"], 0)
        assert (second.stdout, second.exit_code) == ("made\nhi\nsame\n", 0)

    def test_a_timeout_kills_the_command(self) -> None:
        import time

        started = time.monotonic()
        result = self._run("sleep 30", timeout_s=1)
        assert result.timed_out and result.exit_code is None
        assert time.monotonic() - started < 20

    def test_output_is_capped(self) -> None:
        result = self._run("head -c 10000000 /dev/zero | tr '\\0' x")
        assert result.exit_code == 0 and not result.timed_out
        assert len(result.stdout) < 10_000_000 and result.stdout.startswith("xxxx")
        assert not result.stdout.endswith("x"), "a cut output ends with a marker saying how much was cut"

    def test_no_network(self) -> None:
        import socket

        self._skip_unless_isolated()
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            port = listener.getsockname()[1]
            script = ("import socket\n"
                      f"for address in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
                      "    try:\n"
                      "        socket.create_connection(address, timeout=3).close()\n"
                      "        print('connected', address)\n"
                      "    except OSError:\n"
                      "        pass\n")
            result = self._run("python3 net.py", files={"net.py": script.encode()})
        assert result.exit_code == 0, result.stderr
        assert "connected" not in result.stdout

    def test_no_writes_outside_the_workspace(self) -> None:
        import os
        import shlex

        self._skip_unless_isolated()
        name = f"miles-sandbox-conformance-{os.getpid()}"
        targets = [f"/etc/{name}", f"/usr/{name}", os.path.join(os.path.expanduser("~"), name)]
        try:
            paths = " ".join(shlex.quote(target) for target in targets)
            result = self._run(f'for p in {paths}; do touch "$p" 2>/dev/null && echo "wrote $p"; done; true')
            assert result.stdout == ""
            assert not [target for target in targets if os.path.exists(target)]
        finally:
            for target in targets:
                if os.path.exists(target):
                    os.remove(target)

    def test_concurrent_runs(self) -> None:
        import asyncio

        async def body(sandbox: Any) -> list[Any]:
            return await asyncio.gather(*(sandbox.run(f"sleep 0.2; cat in{i}.txt; echo {i} >&2", timeout_s=60,
                                                      files={f"in{i}.txt": f"run {i}\n".encode()}) for i in range(16)))

        results = self._with_sandbox(body)
        assert [(r.stdout, r.stderr, r.exit_code) for r in results] == [(f"run {i}\n", f"{i}\n", 0) for i in range(16)]

    def test_nothing_is_left_running_after_close(self) -> None:
        import asyncio

        background, foreground = self.unique_sleep(), self.unique_sleep()

        async def body(sandbox: Any) -> Any:
            first = await sandbox.run(f"{background} >/dev/null 2>&1 & echo started", timeout_s=30)
            assert first.stdout == "started\n"
            running = asyncio.ensure_future(sandbox.run(foreground, timeout_s=120))
            for _ in range(100):  # a local sandbox's process shows up here; a remote one's never does
                if self.pids_running(foreground) or running.done():
                    break
                await asyncio.sleep(0.05)
            await sandbox.close()
            done, _ = await asyncio.wait({running}, timeout=60)  # it returns or raises, but does not hang
            return running in done

        assert self._with_sandbox(body), "a run still going when the sandbox closed did not end"
        assert self.wait_until_gone(background) == [] and self.wait_until_gone(foreground) == []

    def _with_escapees(self, end: str) -> tuple[dict[str, str], bool]:
        """A run starts one process of each of ``ESCAPES`` and holds on a FIFO; once they all run, the run is
        let go (``end="run"``) or the sandbox closed under it (``end="close"``). The escapees' command lines,
        and whether the held run ended."""
        import asyncio

        markers = {name: self.unique_sleep() for name in ESCAPES}
        escapes = "\n".join(template.format(markers[name]) for name, template in ESCAPES.items())

        async def body(sandbox: Any) -> bool:
            made = await sandbox.run("mkfifo gate", timeout_s=30)
            assert made.exit_code == 0, made.stderr
            held = asyncio.ensure_future(sandbox.run(f"{escapes}\nread x < gate; echo released", timeout_s=120,
                                                     files={"daemon.py": DAEMON}))
            started = await asyncio.to_thread(self._wait_until_running, list(markers.values()), held)
            if end == "run" or not started:
                await sandbox.run("echo go > gate", timeout_s=60)
            else:
                await sandbox.close()
            done, _ = await asyncio.wait({held}, timeout=60)  # it returns or raises, but does not hang
            if not started:
                pytest.skip("this sandbox's processes do not run on this machine: no leftovers to look for")
            if end == "run" and held in done:
                result = held.result()
                assert (result.stdout, result.exit_code) == ("released\n", 0), result
            return held in done

        return markers, self._with_sandbox(body)

    def _wait_until_running(self, markers: list[str], run: Any, timeout_s: float = 30.0) -> bool:
        """Poll until every marker's process runs here (True), or none does by the deadline while the run
        still holds (False: the sandbox's processes run elsewhere)."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            running = [marker for marker in markers if self.pids_of(marker)]
            if len(running) == len(markers):
                return True
            assert not run.done(), f"the run ended before it started every escapee: {run.result()}"
            if time.monotonic() > deadline:
                assert not running, f"only some escapees started: {running} of {markers}"
                return False
            time.sleep(0.05)

    def test_processes_a_command_leaves_behind_end_with_its_run(self) -> None:
        markers, ended = self._with_escapees(end="run")
        assert ended, "the run did not end"
        assert {name: self.wait_until_gone(marker) for name, marker in markers.items()} == dict.fromkeys(markers, [])

    def test_processes_that_left_their_command_end_at_close(self) -> None:
        markers, ended = self._with_escapees(end="close")
        assert ended, "a run still going when the sandbox closed did not end"
        assert {name: self.wait_until_gone(marker) for name, marker in markers.items()} == dict.fromkeys(markers, [])


def _command_line(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None  # it ended meanwhile
