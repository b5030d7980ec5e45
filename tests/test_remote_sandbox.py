"""miles.agentic.RemoteSandbox, the base of the hosted-sandbox plugins, on a stand-in provider.

``StandInProvider`` is a test fixture standing in for a hosted service (E2B, Modal, Daytona: each plugin
tests its own SDK against a stand-in of that provider's API): it keeps "remote" sandboxes in memory,
each a local bubblewrap sandbox with the working folder mounted, and can fail or hold its calls.
"""

import asyncio
import os
import subprocess
import sys

import pytest

from miles.agentic import PermanentError, RemoteSandbox
from miles.agentic.sandboxes.local import LocalSandbox, bwrap_problem
from miles.testing import SandboxConformance

pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"bubblewrap: {bwrap_problem()}")


class StandInProvider:
    """The service's side: sandboxes by id with their labels, and knobs for failures and gates."""

    def __init__(self):
        self.sandboxes: dict[str, tuple[LocalSandbox, dict]] = {}
        self.creates = 0
        self.fail_creates = 0  # the next N creates answer with a transient error
        self.permanent = False
        self.create_gate: asyncio.Event | None = None  # creates wait for it (after registering the sandbox)
        self.create_started: asyncio.Event | None = None
        self.fail_exec = False
        self.hold_lists = 0  # the next N lists wait until cancelled
        self.list_held = asyncio.Event()
        self.fail_deletes = 0  # the next N deletes answer with a transient error

    async def create(self, labels):
        self.creates += 1
        if self.permanent:
            raise PermanentError("401: invalid API key")
        if self.fail_creates:
            self.fail_creates -= 1
            raise ConnectionError("503 Service Unavailable")
        sandbox_id = f"sb-{self.creates}"
        self.sandboxes[sandbox_id] = (LocalSandbox(isolation="bwrap", mounts=["/standin"], cwd="/standin"),
                                      dict(labels))
        if self.create_started is not None:
            self.create_started.set()
        if self.create_gate is not None:
            await self.create_gate.wait()
        return sandbox_id

    async def list(self, labels):
        if self.hold_lists:
            self.hold_lists -= 1
            self.list_held.set()
            await asyncio.Event().wait()
        return [i for i, (_, have) in self.sandboxes.items() if labels.items() <= have.items()]

    async def delete(self, sandbox_id):
        if self.fail_deletes:
            self.fail_deletes -= 1
            raise ConnectionError("503 Service Unavailable")
        sandbox, _ = self.sandboxes.pop(sandbox_id)
        await sandbox.close()


PROVIDER = StandInProvider()


class StandInSandbox(RemoteSandbox):
    provider = "standin"
    credentials = ("STANDIN_API_KEY",)
    default_workdir = "/standin"

    async def _create(self, labels, lifetime_s):
        return await PROVIDER.create(labels)

    async def _exec(self, handle, command, *, cwd, timeout_s):
        if PROVIDER.fail_exec:
            raise ConnectionError("500 Internal Server Error")
        result = await PROVIDER.sandboxes[handle][0].run(f"cd {cwd} && {command}", timeout_s=timeout_s)
        return result.stdout, result.stderr, result.exit_code, result.timed_out

    async def _write(self, handle, path, data):
        await PROVIDER.sandboxes[handle][0].run("true", timeout_s=30, files={path: data})

    async def _read(self, handle, path):
        return await PROVIDER.sandboxes[handle][0].read_file(path)

    async def _delete(self, handle):
        await PROVIDER.delete(handle)

    @classmethod
    async def _list(cls, labels):
        return await PROVIDER.list(labels)

    @classmethod
    async def _delete_id(cls, sandbox_id):
        await PROVIDER.delete(sandbox_id)

    @classmethod
    async def _probe(cls):
        await asyncio.Event().wait()  # a service that never answers


@pytest.fixture(autouse=True)
def provider():
    global PROVIDER
    PROVIDER = StandInProvider()
    yield PROVIDER
    assert not StandInSandbox._live, "a sandbox was left open"
    assert PROVIDER.sandboxes == {}, "the provider still holds sandboxes"


class TestStandInConformance(SandboxConformance):
    def make_sandbox(self):
        return StandInSandbox(backoff_s=0.01)


def test_creation_is_retried_with_backoff(provider):
    provider.fail_creates = 2

    async def main():
        sandbox = StandInSandbox(backoff_s=0.01)
        try:
            return await sandbox.run("echo up", timeout_s=10)
        finally:
            await sandbox.close()

    assert asyncio.run(main()).stdout == "up\n"
    assert provider.creates == 3


@pytest.mark.parametrize("permanent, attempts", [(False, 3), (True, 1)])
def test_a_create_that_keeps_failing_is_a_clear_error_and_leaves_nothing(provider, permanent, attempts):
    provider.fail_creates, provider.permanent = 100, permanent

    async def main():
        sandbox = StandInSandbox(create_retries=2, backoff_s=0.01)
        try:
            await sandbox.run("echo up", timeout_s=10)
        finally:
            await sandbox.close()

    with pytest.raises(RuntimeError, match=f"standin: could not create a sandbox in {attempts} attempt") as info:
        asyncio.run(main())
    assert ("401: invalid API key" if permanent else "503 Service Unavailable") in str(info.value)
    assert provider.creates == attempts


def test_a_failing_exec_fails_that_run_with_the_reason(provider):
    async def main():
        sandbox = StandInSandbox()
        try:
            await sandbox.run("true", timeout_s=10)
            provider.fail_exec = True
            with pytest.raises(ConnectionError, match="500"):
                await sandbox.run("echo x", timeout_s=10)
            provider.fail_exec = False
            return await sandbox.run("echo again", timeout_s=10)
        finally:
            await sandbox.close()

    assert asyncio.run(main()).stdout == "again\n"


def test_at_most_max_concurrent_sandboxes_live_at_once(provider):
    async def main():
        provider.create_gate = asyncio.Event()
        sandboxes = [StandInSandbox(max_concurrent=2) for _ in range(3)]
        runs = [asyncio.ensure_future(s.run("echo hi", timeout_s=10)) for s in sandboxes]
        while provider.creates < 2:
            await asyncio.sleep(0.01)
        for _ in range(20):  # the third may not start while two are live
            await asyncio.sleep(0)
        creates_while_full = provider.creates
        provider.create_gate.set()
        await asyncio.gather(runs[0], runs[1])
        assert not runs[2].done()
        await sandboxes[0].close()
        await runs[2]
        for s in sandboxes:
            await s.close()
        return creates_while_full

    assert asyncio.run(main()) == 2
    assert provider.creates == 3


def test_close_all_deletes_every_open_sandbox_and_a_create_under_way(provider):
    async def main():
        sandboxes = [StandInSandbox() for _ in range(3)]
        for s in sandboxes[:2]:
            await s.run("true", timeout_s=10)
        provider.create_gate, provider.create_started = asyncio.Event(), asyncio.Event()
        pending = asyncio.ensure_future(sandboxes[2].run("true", timeout_s=10))
        await provider.create_started.wait()  # created there, not yet answered here
        assert len(provider.sandboxes) == 3
        closed = await StandInSandbox.close_all()
        await asyncio.gather(pending, return_exceptions=True)
        return closed

    assert asyncio.run(main()) == 3
    assert provider.sandboxes == {}


def test_a_create_cut_short_whose_clean_up_is_cut_short_too_is_deleted_by_close_all(provider):
    """Ctrl-C while a create's answer is on its way: the trajectory's close cancels the create, whose clean-up
    (a delete by the sandbox's tags) is cancelled in turn when asyncio.run ends and cancels every task left;
    close_all, run afterwards on a new event loop as the runner does, deletes the sandbox by its tags."""
    provider.create_gate, provider.create_started = asyncio.Event(), asyncio.Event()
    provider.hold_lists = 1

    async def trajectory(sandbox):
        try:
            await sandbox.run("true", timeout_s=10)
        finally:
            await sandbox.close()

    async def main():
        task = asyncio.ensure_future(trajectory(StandInSandbox(run_id="cut-short")))
        await provider.create_started.wait()  # created there, not yet answered here
        task.cancel()
        await provider.list_held.wait()  # its clean-up is under way; returning cancels it

    asyncio.run(main())
    assert len(provider.sandboxes) == 1 and len(StandInSandbox._live) == 1
    assert asyncio.run(StandInSandbox.close_all(run_id="cut-short")) == 1


def test_close_all_of_a_run_ends_it_no_sandbox_of_it_is_created_afterwards(provider):
    async def main():
        first, waiting = (StandInSandbox(run_id="ending", max_concurrent=1) for _ in range(2))
        await first.run("true", timeout_s=10)
        blocked = asyncio.ensure_future(waiting.run("true", timeout_s=10))  # waits for first's slot
        for _ in range(20):
            await asyncio.sleep(0)
        assert await StandInSandbox.close_all(run_id="ending") == 1
        with pytest.raises(RuntimeError, match="run ending is closing"):
            await blocked  # it got the slot after close_all began
        with pytest.raises(RuntimeError, match="run ending is closing"):
            await StandInSandbox(run_id="ending").run("true", timeout_s=10)
        other = StandInSandbox(run_id="another")  # another run's sandboxes open as before
        try:
            return await other.run("echo other", timeout_s=10)
        finally:
            await other.close()
            await waiting.close()

    assert asyncio.run(main()).stdout == "other\n"
    assert provider.creates == 2


def test_a_delete_that_fails_is_reported_and_retried_by_the_next_close_all(provider):
    async def main():
        sandbox = StandInSandbox(run_id="failing-delete")
        await sandbox.run("true", timeout_s=10)
        provider.fail_deletes = 1
        with pytest.raises(RuntimeError, match=r"standin: could not delete 1 of 1 sandboxes \(ConnectionError: 503 "
                                               r"Service Unavailable\); `miles sandbox gc` finds them by their tag "
                                               r"miles-run=failing-delete"):
            await StandInSandbox.close_all()
        assert len(provider.sandboxes) == 1  # still recorded, so:
        return await StandInSandbox.close_all()

    assert asyncio.run(main()) == 1


def test_gc_deletes_what_a_killed_run_left_by_its_tags(provider):
    async def main():
        for run_id in ("run-a", "run-a", "run-b"):
            await StandInSandbox(run_id=run_id).run("true", timeout_s=10)  # never closed: a killed run
        StandInSandbox._live.clear()  # what dies with the process (the provider keeps the sandboxes)
        first = await StandInSandbox.gc(run_id="run-a")
        left = sorted(labels["miles-run"] for _, labels in provider.sandboxes.values())
        rest = await StandInSandbox.gc()
        return first, left, rest

    first, left, rest = asyncio.run(main())
    assert len(first) == 2 and left == ["run-b"] and len(rest) == 1


def test_outputs_are_capped_and_files_go_in_and_out():
    async def main():
        sandbox = StandInSandbox(output_bytes=100)
        try:
            result = await sandbox.run("head -c 1000 /dev/zero | tr '\\0' x; cat in/a.txt > out.txt", timeout_s=10,
                                       files={"in/a.txt": b"data"})
            return result, await sandbox.read_file("out.txt"), await sandbox.read_file("/standin/in/a.txt")
        finally:
            await sandbox.close()

    result, out, same = asyncio.run(main())
    assert result.stdout == "x" * 100 + "\n[... 900 more bytes cut]"
    assert out == same == b"data"


def test_an_unreachable_service_is_a_clear_error_in_bounded_time():
    with pytest.raises(TimeoutError, match=r"standin: could not reach the service within 0.2 s"):
        asyncio.run(StandInSandbox.preflight(connect_timeout_s=0.2))


def test_a_missing_credential_is_a_config_error_naming_the_variable(monkeypatch):
    monkeypatch.delenv("STANDIN_API_KEY", raising=False)
    with pytest.raises(ValueError, match="needs the environment variable STANDIN_API_KEY"):
        StandInSandbox.check_args({})
    monkeypatch.setenv("STANDIN_API_KEY", "k")
    with pytest.raises(ValueError, match="max_concurrent: expected a positive integer, got 0"):
        StandInSandbox.check_args({"max_concurrent": 0})


def test_sandbox_gc_on_the_command_line_names_what_is_wrong():
    def gc(*args):
        return subprocess.run([sys.executable, "-m", "miles", "sandbox", "gc", *args], capture_output=True, text=True,
                              env={**os.environ, "MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})

    unknown, local = gc("nope"), gc("local")
    assert unknown.returncode == 2 and "unknown sandbox 'nope'" in unknown.stderr and "local" in unknown.stderr
    assert local.returncode == 2 and "has no gc" in local.stderr


def test_a_run_whose_sandbox_service_cannot_be_reached_stops_at_start_naming_it(tmp_path):
    from tests.conftest import run_miles

    result = run_miles("train", "configs/retool.yaml", f"run.dir={tmp_path / 'run'}", "sft.steps=1", "run.steps=1",
                       "rollout.sandbox.name=tests.test_remote_sandbox:StandInSandbox",
                       "rollout.sandbox.connect_timeout_s=0.5", env={"STANDIN_API_KEY": "k"})
    assert result.returncode == 1, result.stderr
    assert "rollout.sandbox (tests.test_remote_sandbox:StandInSandbox): standin: could not reach the service " \
           "within 0.5 s" in result.stderr
    assert "Traceback" not in result.stderr
