"""``SandboxConformance``: the contract every sandbox keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.testing.fixtures import pytest


class SandboxConformance:
    """The contract every sandbox keeps. Subclass it in a test module of your sandbox plugin:

        class TestMySandbox(SandboxConformance):
            isolated = True  # False skips the network and filesystem isolation checks

            def make_sandbox(self):
                return MySandbox(...)

    Each check opens a fresh sandbox, runs commands in it with ``asyncio.run`` and closes it. The checks
    that look for leftover processes look at this machine's ``/proc``, so for a remote sandbox they pass
    trivially.
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
