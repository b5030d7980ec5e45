"""The ``e2b`` sandbox: the real ``e2b`` SDK against a local STAND-IN of E2B's API and envd
(``standin_e2b.py``: E2B cannot be reached from the test machines), and against E2B itself when
``E2B_API_KEY`` is set (tests marked ``live``)."""

import asyncio
import inspect
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from e2b import AsyncSandbox

import miles
from miles.agentic import RemoteSandbox
from miles.testing import MILES_WITH_CTRL_C, SandboxConformance, make_registry
from miles_e2b import E2BError, E2BSandbox
from standin_e2b import MOUNT

WORKDIR = f"{MOUNT}/work"  # the stand-in's sandboxes keep their files below its mount
RETOOL = Path(miles.__file__).resolve().parents[1] / "configs" / "retool.yaml"
TESTS = Path(__file__).resolve().parent
# A run whose 4 trajectories each open their sandbox and then hold (held_env.py) until the run is stopped.
HELD_RUN = ["rollout.env.name=held_env:HeldEnv", "rollout.sandbox.name=e2b", f"rollout.sandbox.workdir={WORKDIR}",
            "sft.steps=0", "run.steps=1", "rollout.prompts_per_step=2", "rollout.n_samples=2", "run.eval_size=0",
            "run.progress=false", "run.plugins.allow=[e2b]"]
TRAJECTORIES = 4


def sandbox(**config) -> E2BSandbox:
    return E2BSandbox(workdir=WORKDIR, **config)


def run_once(box: E2BSandbox, command: str):
    """``command``'s result in ``box``, closed afterwards."""
    async def main():
        try:
            return await box.run(command, timeout_s=30)
        finally:
            await box.close()

    return asyncio.run(main())


def miles_env(standin) -> dict[str, str]:
    """The environment of a ``miles`` subprocess: the SDK pointed at the stand-in, this folder importable."""
    return {**os.environ, **standin.env(), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(TESTS)}


def needs_the_recipe() -> None:
    if not RETOOL.is_file():
        pytest.skip(f"configs/retool.yaml is not next to this Miles ({RETOOL}): run from a Miles checkout")


class TestE2BOnTheStandIn(SandboxConformance):
    """The sandbox contract through the real SDK. ``isolated = False``: the stand-in runs commands in a
    local sandbox, whose isolation would prove nothing about E2B's (a microVM per sandbox, and here no
    internet: ``internet`` is off by default); the live tests below check isolation on E2B itself."""

    isolated = False

    @pytest.fixture(autouse=True)
    def _on_the_standin(self, e2b):
        """Every check with the SDK pointed at the stand-in, leaving no sandbox there."""

    def make_sandbox(self):
        return sandbox()


def test_the_installed_plugin_registers_e2b():
    [entry] = [e for e in entry_points(group="miles") if e.name == "e2b"]
    assert make_registry(entry.load()).get("sandbox", "e2b").obj is E2BSandbox


def test_a_sandbox_is_created_with_the_tags_lifetime_and_template_and_without_internet(e2b):
    result = run_once(sandbox(run_id="run-1", lifetime_s=600, template="base"), "pwd")
    assert result.stdout == WORKDIR + "\n"
    [body] = e2b.create_bodies
    assert (body["templateID"], body["timeout"], body["allow_internet_access"]) == ("base", 600, False)
    assert body["metadata"]["miles"] == "1" and body["metadata"]["miles-run"] == "run-1"
    assert e2b.ran[-1] == f"cd {WORKDIR} && /bin/bash -l -c pwd"
    assert (e2b.created, e2b.deleted) == (1, 1)


@pytest.mark.parametrize("status", [500, 503])
def test_a_failed_create_is_retried_with_backoff(e2b, status):
    e2b.fail_creates, e2b.fail_status = 2, status
    assert run_once(sandbox(create_retries=3, backoff_s=0.01), "echo up").stdout == "up\n"
    assert (e2b.creates, e2b.created, e2b.deleted) == (3, 1, 1)  # Miles' retries alone: the SDK's are off


@pytest.mark.parametrize("status, error", [(500, "SandboxException: 500"), (503, "ServiceBusyException: 503")])
def test_a_create_failing_every_time_fails_clearly_after_the_retries_and_leaves_nothing(e2b, status, error):
    e2b.fail_creates, e2b.fail_status = 100, status
    with pytest.raises(RuntimeError, match=rf"e2b: could not create a sandbox in 3 attempt\(s\): E2BError: "
                                           rf"{error}: .*stand-in: injected failure of a create"):
        run_once(sandbox(create_retries=2, backoff_s=0.01), "true")
    assert (e2b.creates, e2b.created) == (3, 0)  # create_retries counts every try


def test_refused_credentials_fail_at_once_naming_the_variable(e2b, monkeypatch):
    monkeypatch.setenv("E2B_API_KEY", "e2b_wrong")
    with pytest.raises(RuntimeError, match=r"in 1 attempt\(s\): the service refused the credentials \(E2B_API_KEY\)"):
        run_once(sandbox(create_retries=3, backoff_s=0.01), "true")
    assert e2b.refused.count("POST /v2/sandboxes") == 1


def test_an_unknown_template_fails_at_once(e2b):
    with pytest.raises(RuntimeError, match=r"in 1 attempt\(s\): .*404: template 'no-such-template' not found"):
        run_once(sandbox(template="no-such-template", backoff_s=0.01), "true")
    assert e2b.creates == 1


def test_a_provider_error_on_exec_fails_that_run_with_the_reason(e2b):
    async def main():
        box = sandbox()
        try:
            assert (await box.run("echo first", timeout_s=30)).stdout == "first\n"
            e2b.fail_exec = True
            with pytest.raises(E2BError, match=r"could not run a command in E2B sandbox i\w+: .*"
                                               r"stand-in: injected failure of envd"):
                await box.run("echo second", timeout_s=30)
            e2b.fail_exec = False
            assert (await box.run("echo third", timeout_s=30)).stdout == "third\n"
        finally:
            await box.close()

    asyncio.run(main())
    assert (e2b.created, e2b.deleted) == (1, 1)


def test_a_command_past_its_timeout_is_killed_in_the_sandbox_at_once(e2b):
    """Not left running until the sandbox goes: Miles sends E2B the kill of that process."""
    command = SandboxConformance.unique_sleep()

    async def main():
        box = sandbox()
        try:
            result = await box.run(f"echo started; {command}", timeout_s=1)
            assert (result.timed_out, result.exit_code) == (True, None)
            assert await asyncio.to_thread(SandboxConformance.wait_until_gone, command) == []
            assert (await box.run("echo still usable", timeout_s=30)).stdout == "still usable\n"
        finally:
            await box.close()

    asyncio.run(main())
    assert [signal for _, signal in e2b.signals] == ["SIGNAL_SIGKILL"]


def test_read_file_returns_a_files_bytes_and_names_a_missing_one(e2b):
    async def main():
        box = sandbox()
        try:
            await box.run("printf 'a\\0b' > out.bin", timeout_s=30)
            assert await box.read_file("out.bin") == b"a\0b"
            assert await box.read_file(f"{WORKDIR}/out.bin") == b"a\0b"
            with pytest.raises(E2BError, match=r"could not read /sandbox/work/missing.txt in E2B sandbox"):
                await box.read_file("missing.txt")
        finally:
            await box.close()

    asyncio.run(main())


def test_no_more_than_max_concurrent_sandboxes_live_at_once(e2b):
    """Five trajectories, a limit of two: creates are held at the stand-in until both have arrived, then
    each trajectory keeps its sandbox open until the test lets it go; the other three wait for a slot."""
    async def main():
        boxes = [sandbox(max_concurrent=2) for _ in range(5)]
        release, parked = asyncio.Event(), asyncio.Queue()

        async def trajectory(box):
            assert (await box.run("echo in", timeout_s=60)).stdout == "in\n"
            parked.put_nowait(box)
            await release.wait()
            await box.close()

        e2b.hold_creates()
        tasks = [asyncio.ensure_future(trajectory(box)) for box in boxes]
        assert await asyncio.to_thread(e2b.wait_until, lambda: e2b.held == 2)
        e2b.release_creates()
        await parked.get(), await parked.get()
        assert await E2BSandbox.close_all() == 2  # only the two holding a slot; three wait for one
        release.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert (e2b.created, e2b.deleted, e2b.max_open) == (5, 5, 2)


def test_a_create_that_times_out_leaves_nothing_behind(e2b):
    e2b.hold_creates()
    with pytest.raises(RuntimeError, match=r"in 1 attempt\(s\): TimeoutError: e2b: could not create a sandbox "
                                           r"within 1 s"):
        run_once(sandbox(create_retries=0, create_timeout_s=1), "true")
    e2b.release_creates()
    assert e2b.wait_until(lambda: e2b.creating == 0)
    assert e2b.created == 0


def test_close_all_deletes_every_open_sandbox(e2b):
    async def main():
        boxes = [sandbox() for _ in range(3)]
        await asyncio.gather(*(box.run("true", timeout_s=30) for box in boxes))
        assert len(e2b.live()) == 3
        assert await E2BSandbox.close_all() == 3
        with pytest.raises(RuntimeError, match="closed"):
            await boxes[0].run("true", timeout_s=30)

    asyncio.run(main())
    assert e2b.live() == [] and e2b.deleted == 3


def test_ctrl_c_deletes_the_sandboxes_a_run_has_open(e2b, tmp_path):
    needs_the_recipe()
    proc = subprocess.Popen([*MILES_WITH_CTRL_C, "train", str(RETOOL), *HELD_RUN, f"run.dir={tmp_path / 'run'}"],
                            env=miles_env(e2b), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=lambda: (proc.wait(), e2b.poke()), daemon=True).start()
    try:
        e2b.wait_until(lambda: len(e2b.live()) == TRAJECTORIES or proc.poll() is not None)
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert e2b.live() == [] and e2b.deleted == TRAJECTORIES, output


def test_ctrl_c_while_the_creates_are_answered_deletes_those_whose_clean_up_was_cut_short(e2b, tmp_path):
    """Ctrl-C at the worst moment: each trajectory's create has made its sandbox at E2B, and no answer has
    come back, so each is known here by its tags only. The first trajectory to finish its clean-up (a list
    by its tags, then a delete) ends the rollouts' event loop, which cancels the clean-up of the three others
    while the stand-in holds their lists; the run's close_all deletes those three, by their tags."""
    needs_the_recipe()
    e2b.hold_answers()
    proc = subprocess.Popen([*MILES_WITH_CTRL_C, "train", str(RETOOL), *HELD_RUN, f"run.dir={tmp_path / 'run'}"],
                            env=miles_env(e2b), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=lambda: (proc.wait(), e2b.poke()), daemon=True).start()
    try:
        e2b.wait_until(lambda: e2b.held_answers == TRAJECTORIES or proc.poll() is not None)
        assert proc.poll() is None, proc.communicate()[0]
        assert len(e2b.live()) == TRAJECTORIES
        e2b.hold_lists(TRAJECTORIES - 1)  # after the run's start-up check, which lists too
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert e2b.live() == [] and e2b.deleted == TRAJECTORIES, output
    assert "warning" not in output, output


def test_gc_deletes_what_a_killed_run_left_and_nothing_else(e2b):
    run_id = f"killed-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, str(TESTS / "open_sandboxes.py"), run_id, "3", WORKDIR],
                            env=miles_env(e2b), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=lambda: (proc.wait(), e2b.poke()), daemon=True).start()
    try:
        e2b.wait_until(lambda: len(e2b.live()) == 3 or proc.poll() is not None)
        assert proc.poll() is None, proc.communicate()[0]
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = set(e2b.live())

    async def others():  # a sandbox of another (live) Miles run, and one that is not Miles'
        other = sandbox(run_id="another-run")
        await other.run("true", timeout_s=30)
        theirs = await AsyncSandbox.create(metadata={"owner": "someone else"})
        return other, theirs.sandbox_id

    other, theirs = asyncio.run(others())
    [other_id] = [box for box in e2b.live() if box not in left and box != theirs]
    gc = subprocess.run([sys.executable, "-m", "miles", "sandbox", "gc", "e2b", "--run", run_id], env=miles_env(e2b),
                        capture_output=True, text=True, timeout=120)
    assert gc.returncode == 0, gc.stderr
    assert gc.stdout.startswith(f"deleted {len(left)} e2b sandbox(es) tagged by run {run_id}")
    assert set(gc.stdout.split()[-len(left):]) == left
    assert set(e2b.live()) == {other_id, theirs}
    assert asyncio.run(E2BSandbox.gc()) == [other_id]  # every Miles run's sandboxes, not someone else's
    assert e2b.live() == [theirs]
    asyncio.run(other.close())  # its sandbox is gone already: closing it is a no-op
    asyncio.run(AsyncSandbox.kill(theirs))


def test_the_retool_recipe_runs_on_e2b(e2b, tmp_path):
    """configs/retool.yaml as it is, with its sandbox set to e2b (and a workdir in the stand-in's
    filesystem): a short SFT warm-up on the tool traces, one GRPO step whose code runs in E2B sandboxes."""
    needs_the_recipe()
    run = subprocess.run([sys.executable, "-m", "miles", "train", str(RETOOL), "rollout.sandbox.name=e2b",
                          f"rollout.sandbox.workdir={WORKDIR}", f"run.dir={tmp_path / 'run'}", "sft.steps=40",
                          "data.generator.direct_fraction=0.0", "run.steps=1", "rollout.prompts_per_step=2",
                          "rollout.n_samples=4", "run.eval_size=4", "run.progress=false", "run.plugins.allow=[e2b]"],
                         env=miles_env(e2b), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-5000:]
    assert "rollout.sandbox: e2b sandboxes from template 'base'" in run.stderr
    assert any(command.endswith("python3 -I main.py'") for command in e2b.ran), e2b.ran
    assert e2b.created > 0 and e2b.deleted == e2b.created and e2b.live() == []


# -- configuration and an unreachable service (no stand-in needed) ------------------------------------


@pytest.fixture
def no_e2b_settings(monkeypatch):
    for name in ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN", "E2B_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_check_args_names_a_missing_credential(no_e2b_settings):
    with pytest.raises(ValueError, match="E2B_API_KEY"):
        E2BSandbox.check_args({})


@pytest.mark.parametrize("args, named", [
    ({"template": ""}, "template"), ({"internet": "yes"}, "internet"), ({"user": ""}, "user"),
    ({"max_concurrent": 0}, "max_concurrent"), ({"workdir": "work"}, "workdir"),
    ({"templte": "base"}, "unknown argument templte"),
])
def test_check_args_names_a_bad_argument(no_e2b_settings, args, named):
    no_e2b_settings.setenv("E2B_API_KEY", "e2b_key")
    with pytest.raises(ValueError, match=named):
        E2BSandbox.check_args(args)
    E2BSandbox.check_args({"template": "base", "internet": True, "user": "root", "max_concurrent": 4})


def test_check_args_refuses_the_sdks_debug_mode(no_e2b_settings):
    no_e2b_settings.setenv("E2B_API_KEY", "e2b_key")
    no_e2b_settings.setenv("E2B_DEBUG", "true")
    with pytest.raises(ValueError, match="E2B_DEBUG"):
        E2BSandbox.check_args({})


def test_a_run_without_the_credential_stops_at_config_validation(no_e2b_settings):
    """What ``miles train`` reports before exiting with code 2."""
    from miles.errors import ConfigError
    from miles.run.runner import prepare

    needs_the_recipe()
    with pytest.raises(ConfigError, match=r"rollout.sandbox: sandbox 'e2b' rejected its arguments: .*E2B_API_KEY"):
        prepare(RETOOL, ["rollout.sandbox.name=e2b", "run.plugins.allow=[e2b]"])


@pytest.fixture
def unreachable(request):
    """The address of a service that cannot be used: nothing listens on the port, the name does not
    resolve, or a socket takes connections and never answers (a hung service)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if request.param == "nothing listening":
            listener.close()
            yield f"http://127.0.0.1:{port}"
        elif request.param == "unknown host":
            yield "http://no-such-host.invalid:3000"
        else:
            listener.listen(64)  # the kernel completes the connections; nobody reads them
            yield f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("unreachable", ["nothing listening", "unknown host", "never answers"], indirect=True)
def test_an_unreachable_service_fails_preflight_naming_it_in_bounded_time(no_e2b_settings, unreachable):
    no_e2b_settings.setenv("E2B_API_KEY", "e2b_key")
    no_e2b_settings.setenv("E2B_API_URL", unreachable)
    started = time.monotonic()
    with pytest.raises(Exception, match=re.escape(unreachable)) as failed:
        asyncio.run(E2BSandbox.preflight(connect_timeout_s=2))
    print(f"preflight failed in {time.monotonic() - started:.2f} s: {failed.value!r}")
    assert time.monotonic() - started < 30  # a safety bound far above the 2 s limit, not a measurement


@pytest.mark.parametrize("unreachable", ["nothing listening", "never answers"], indirect=True)
def test_an_unreachable_service_fails_the_first_create_naming_it_in_bounded_time(no_e2b_settings, unreachable):
    no_e2b_settings.setenv("E2B_API_KEY", "e2b_key")
    no_e2b_settings.setenv("E2B_API_URL", unreachable)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=re.escape(unreachable)) as failed:
        run_once(E2BSandbox(create_retries=0, create_timeout_s=2, connect_timeout_s=2), "true")
    print(f"create failed in {time.monotonic() - started:.2f} s: {failed.value!r}")
    assert time.monotonic() - started < 30  # a safety bound far above the 2 s limits, not a measurement


def test_describe_names_the_template_and_where_the_api_is(no_e2b_settings):
    no_e2b_settings.setenv("E2B_API_URL", "http://e2b.example:3000")
    line = E2BSandbox.describe(template="my-template", max_concurrent=8)
    assert "template 'my-template' without internet" in line and "http://e2b.example:3000 (E2B_API_URL)" in line
    assert "at most 8 at once" in line


def test_the_factory_takes_the_common_arguments_and_run_id_by_name():
    """The runner passes ``run_id`` to factories whose signature names it (and config validation checks
    the arguments a factory takes); every common argument of RemoteSandbox is accepted."""
    assert "run_id" in inspect.signature(E2BSandbox).parameters
    common = {p.name for p in inspect.signature(RemoteSandbox.__init__).parameters.values() if p.name != "self"}
    assert common <= E2BSandbox.argument_names()


# -- the real E2B service ------------------------------------------------------------------------------


def needs_e2b() -> None:
    if not os.environ.get("E2B_API_KEY"):
        pytest.skip("E2B_API_KEY not set: the live tests run against the real E2B service with that key")


LIVE_RUN = f"miles-e2b-live-{uuid.uuid4().hex[:8]}"


@pytest.mark.live
class TestE2BLive(SandboxConformance):
    """The same contract on E2B itself, isolation included (internet off, a VM of its own)."""

    isolated = True

    @pytest.fixture(autouse=True)
    def _live(self):
        needs_e2b()

    def make_sandbox(self):
        return E2BSandbox(run_id=LIVE_RUN)


@pytest.mark.live
def test_live_preflight_and_gc_find_a_runs_sandbox_by_its_tags():
    needs_e2b()

    async def main():
        await E2BSandbox.preflight()
        box = E2BSandbox(run_id=LIVE_RUN + "-gc")
        try:
            assert (await box.run("echo up", timeout_s=60)).stdout == "up\n"
            assert len(await E2BSandbox.gc(run_id=LIVE_RUN + "-gc")) == 1
        finally:
            await box.close()
        assert await E2BSandbox.gc(run_id=LIVE_RUN + "-gc") == []

    asyncio.run(main())
