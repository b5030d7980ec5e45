"""The ``daytona`` sandbox on the real Daytona SDK (``daytona==0.226.1``).

Daytona's service cannot be reached from here, so most tests point the SDK at a STAND-IN of it
(``standin_daytona.py``: Daytona's REST and toolbox APIs on 127.0.0.1, each sandbox a local bubblewrap
sandbox). The tests marked ``live`` run the same conformance suite against the real service when
``DAYTONA_API_KEY`` is set, and are skipped otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.agentic import PermanentError
from miles.agentic.sandboxes.local import bwrap_problem
from miles.testing import MILES_WITH_CTRL_C, SandboxConformance
from miles_daytona import DaytonaSandbox
from miles_daytona import client as clients

ROOT = Path(__file__).resolve().parents[3]  # the Miles checkout: the recipe and `python -m miles` run from there
RECIPE = ["configs/retool.yaml", "rollout.sandbox.name=daytona", "run.progress=false", "run.eval_size=0",
          "rollout.prompts_per_step=4", "rollout.n_samples=4"]

needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None,
                                 reason=f"the stand-in needs bubblewrap: {bwrap_problem()}")


@pytest.fixture
def standin(standin_service, monkeypatch):
    """The stand-in, reset, with the SDK's environment pointing at it; every sandbox is deleted by the end."""
    standin_service.reset()
    for name, value in standin_service.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DAYTONA_TARGET", raising=False)
    yield standin_service
    assert standin_service.sandboxes == {}, "the service still holds sandboxes after the test"


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 120))  # a safety net, not a measurement


async def used(sandbox: DaytonaSandbox, command: str = "true", timeout_s: float = 30, **kwargs):
    """Run ``command`` in ``sandbox`` and close it whatever happens."""
    try:
        return await sandbox.run(command, timeout_s=timeout_s, **kwargs)
    finally:
        await sandbox.close()


def miles(*args: str, env: dict[str, str], ctrl_c: bool = False, **popen) -> subprocess.Popen:
    command = [*MILES_WITH_CTRL_C] if ctrl_c else [sys.executable, "-m", "miles"]
    return subprocess.Popen([*command, *args], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


@needs_bwrap
@pytest.mark.usefixtures("standin")
class TestDaytonaOnTheStandIn(SandboxConformance):
    isolated = False  # the stand-in runs commands on this machine; Daytona isolates its sandboxes on its side

    def make_sandbox(self):
        return DaytonaSandbox(backoff_s=0.01)


@pytest.mark.live
class TestDaytonaLive(SandboxConformance):
    """The conformance suite against Daytona itself (network blocked, commands as the sandbox's user)."""

    isolated = True

    @pytest.fixture(autouse=True)
    def _credentials(self):
        if not os.environ.get("DAYTONA_API_KEY"):
            pytest.skip("DAYTONA_API_KEY not set: the live tests run the conformance suite against the real "
                        "Daytona service (DAYTONA_API_URL and DAYTONA_TARGET are read too)")

    def make_sandbox(self):
        return DaytonaSandbox()


@needs_bwrap
def test_a_sandbox_is_made_as_asked_and_deleted_on_close(standin):
    async def main():
        result = await used(DaytonaSandbox(run_id="run-1", lifetime_s=600), "pwd; echo $X", files={"in/a.txt": b"a"})
        return result, clients._clients.get(asyncio.get_running_loop())

    result, client_left = run(main())
    assert (result.stdout, result.exit_code) == ("/daytona\n\n", 0)  # the sandbox's own working folder
    (body,) = standin.create_bodies
    assert {"miles": "1", "miles-run": "run-1"}.items() <= body["labels"].items()
    assert (body["ttlMinutes"], body["autoStopInterval"], body["autoDeleteInterval"]) == (10, 10, 0)
    assert body["networkBlockAll"] is True and "snapshot" not in body  # Daytona's default snapshot
    assert len(standin.deleted) == 1
    assert client_left is None, "the SDK client is closed with the last sandbox of its event loop"


@needs_bwrap
def test_a_timeout_is_ours_and_keeps_what_the_command_wrote(standin):
    result = run(used(DaytonaSandbox(), "echo before; echo oops >&2; sleep 60; echo after", timeout_s=1))
    assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == ("before\n", "oops\n", None, True)


@needs_bwrap
def test_files_go_in_and_out_and_a_missing_one_is_file_not_found(standin):
    async def main():
        sandbox = DaytonaSandbox(workdir="/daytona/work", env_vars={"X": "1"})
        try:
            await sandbox.run("cp in.bin out.bin", timeout_s=30, files={"in.bin": bytes(range(256))})
            with pytest.raises(FileNotFoundError, match="/daytona/work/nope: no such file"):
                await sandbox.read_file("nope")
            return await sandbox.read_file("out.bin"), await sandbox.read_file("/daytona/work/in.bin")
        finally:
            await sandbox.close()

    assert run(main()) == (bytes(range(256)),) * 2
    assert standin.create_bodies[0]["env"] == {"X": "1"}


@needs_bwrap
def test_a_long_output_is_cut_in_the_sandbox_with_the_count_of_what_was_cut(standin):
    result = run(used(DaytonaSandbox(output_bytes=100), "head -c 1000 /dev/zero | tr '\\0' x; echo err >&2"))
    assert result.stdout == "x" * 74 + "\n[... 926 more bytes cut]" and len(result.stdout) <= 100
    assert result.stderr == "err\n"


@needs_bwrap
def test_creation_is_retried_with_backoff(standin):
    standin.fail_creates, standin.fail_status = 2, 503
    assert run(used(DaytonaSandbox(backoff_s=0.01), "echo up")).stdout == "up\n"
    assert standin.creates == 3 and len(standin.deleted) == 1


@needs_bwrap
def test_a_create_that_keeps_failing_is_a_clear_error_and_leaves_nothing(standin):
    standin.fail_creates, standin.fail_status = 100, 500
    with pytest.raises(RuntimeError, match=r"daytona: could not create a sandbox in 3 attempt\(s\): "
                                           r"DaytonaInternalServerError: .*fails this create on purpose"):
        run(used(DaytonaSandbox(create_retries=2, backoff_s=0.01)))
    assert standin.creates == 3


@needs_bwrap
def test_a_wrong_api_key_is_not_retried_and_names_the_variable(standin, monkeypatch):
    monkeypatch.setenv("DAYTONA_API_KEY", "wrong")
    with pytest.raises(RuntimeError, match=r"in 1 attempt\(s\): HTTP 401: .*Invalid credentials.*DAYTONA_API_KEY"):
        run(used(DaytonaSandbox(backoff_s=0.01)))
    with pytest.raises(PermanentError, match="HTTP 401"):
        run(DaytonaSandbox.preflight())


@needs_bwrap
def test_a_service_failing_commands_fails_that_run_with_the_reason(standin):
    async def main():
        sandbox = DaytonaSandbox()
        try:
            await sandbox.run("true", timeout_s=30)
            standin.fail_exec = True
            with pytest.raises(Exception, match="fails this command on purpose"):
                await sandbox.run("echo lost", timeout_s=30)
            standin.fail_exec = False
            return await sandbox.run("echo again", timeout_s=30)
        finally:
            await sandbox.close()

    assert run(main()).stdout == "again\n"


@needs_bwrap
def test_a_sandbox_whose_setup_fails_is_deleted(standin):
    standin.fail_exec = True  # the working folder is made by a command right after the create
    with pytest.raises(Exception, match="fails this command on purpose"):
        run(used(DaytonaSandbox()))
    assert standin.creates == 1 and len(standin.deleted) == 1


@needs_bwrap
def test_at_most_max_concurrent_sandboxes_live_at_once(standin):
    async def main():
        standin.hold("create")
        runs = [asyncio.ensure_future(used(DaytonaSandbox(max_concurrent=2), "echo hi")) for _ in range(5)]
        await asyncio.to_thread(standin.wait_until, lambda s: s.held["create"] == 2)
        standin.release("create")
        return await asyncio.gather(*runs)

    assert [r.stdout for r in run(main())] == ["hi\n"] * 5
    assert standin.creates == 5 and standin.peak_live == 2


@needs_bwrap
def test_close_all_deletes_every_open_sandbox_and_a_create_under_way(standin):
    async def main():
        sandboxes = [DaytonaSandbox() for _ in range(4)]
        for sandbox in sandboxes[:3]:
            await sandbox.run("true", timeout_s=30)
        standin.hold("create")
        pending = asyncio.ensure_future(sandboxes[3].run("true", timeout_s=30))
        await asyncio.to_thread(standin.wait_until, lambda s: s.held["create"] == 1)  # made there, not answered here
        closed = await DaytonaSandbox.close_all()
        standin.release("create")
        await asyncio.gather(pending, return_exceptions=True)
        return closed

    assert run(main()) == 4
    assert len(standin.deleted) == 4


@needs_bwrap
def test_gc_deletes_what_a_killed_run_left_by_its_tags(standin, tmp_path):
    script = ("import asyncio, sys\n"
              "from miles_daytona import DaytonaSandbox\n"
              "async def main():\n"
              "    for run_id in ('killed-run', 'killed-run', 'other-run'):\n"
              "        await DaytonaSandbox(run_id=run_id).run('true', timeout_s=30)\n"
              "    print('ready', flush=True)\n"
              "    await asyncio.Event().wait()\n"
              "asyncio.run(main())\n")
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ}, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n", "the script did not open its sandboxes"
    finally:
        proc.kill()  # SIGKILL: nothing of Miles' runs to clean up
        proc.wait()
    assert sorted(labels["miles-run"] for labels in standin.labels()) == ["killed-run", "killed-run", "other-run"]
    assert len(run(DaytonaSandbox.gc(run_id="killed-run"))) == 2  # what `miles sandbox gc daytona --run ...` calls
    assert [labels["miles-run"] for labels in standin.labels()] == ["other-run"]
    assert len(run(DaytonaSandbox.gc())) == 1  # every Miles run's


def test_a_missing_credential_or_a_bad_argument_is_a_config_error_naming_it(monkeypatch):
    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    with pytest.raises(ValueError, match="needs the environment variable DAYTONA_API_KEY"):
        DaytonaSandbox.check_args({})
    monkeypatch.setenv("DAYTONA_API_KEY", "key")
    DaytonaSandbox.check_args({"snapshot": "my-snapshot", "max_concurrent": 4, "run_id": "r"})
    for args, message in [({"snapshott": "x"}, "snapshott: the daytona sandbox takes no argument 'snapshott'"),
                          ({"snapshot": "a", "image": "b"}, "snapshot and image: give one of them"),
                          ({"network_block_all": "no"}, "network_block_all: expected true or false"),
                          ({"env_vars": {"A": 1}}, "env_vars: expected a mapping of names to strings"),
                          ({"create_retries": -1}, "create_retries: expected an integer >= 0")]:
        with pytest.raises(ValueError, match=message):
            DaytonaSandbox.check_args(args)


def test_a_run_without_the_credential_stops_at_config_validation(monkeypatch, tmp_path):
    from miles.errors import ConfigError
    from miles.run.runner import prepare

    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match="rollout.sandbox: sandbox 'daytona' rejected its arguments: "
                                          ".*DAYTONA_API_KEY"):
        prepare(RECIPE[0], [*RECIPE[1:], f"run.dir={tmp_path}"])  # the command line exits 2 with this message


def test_a_closed_port_is_a_clear_error_naming_the_host_at_once(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once closed
    monkeypatch.setenv("DAYTONA_API_URL", f"http://127.0.0.1:{port}/api")
    monkeypatch.setenv("DAYTONA_API_KEY", "key")
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"cannot reach http://127.0.0.1:{port}/api \\(DAYTONA_API_URL\\)"):
        run(DaytonaSandbox.preflight())
    with pytest.raises(RuntimeError, match=f"in 1 attempt.*cannot reach http://127.0.0.1:{port}"):
        run(used(DaytonaSandbox(create_retries=0)))
    print(f"closed port: preflight and a create failed in {time.monotonic() - started:.2f} s")


def test_a_service_that_never_answers_fails_within_the_connect_timeout_naming_it(monkeypatch):
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/api"
        monkeypatch.setenv("DAYTONA_API_URL", url)
        monkeypatch.setenv("DAYTONA_API_KEY", "key")
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=f"daytona: could not reach the service within 0.5 s "
                                               f"\\({url}, from DAYTONA_API_URL\\)"):
            run(DaytonaSandbox.preflight(connect_timeout_s=0.5))
        preflight_s = time.monotonic() - started
        with pytest.raises(RuntimeError, match=f"could not create a sandbox in 1 attempt.*within 0.5 s "
                                               f"\\({url}, from DAYTONA_API_URL\\)"):
            run(used(DaytonaSandbox(create_retries=0, create_timeout_s=0.5, connect_timeout_s=0.5)))
    create_s = time.monotonic() - started - preflight_s
    print(f"silent service: preflight failed in {preflight_s:.2f} s, a create in {create_s:.2f} s")


@pytest.fixture(scope="module")
def retool_run(standin_service, tmp_path_factory):
    """configs/retool.yaml with ``rollout.sandbox.name=daytona`` against the stand-in: a short SFT warm-up on
    traces that all write code, then one GRPO step."""
    standin_service.reset()
    run_dir = tmp_path_factory.mktemp("retool") / "run"
    proc = miles("train", *RECIPE, f"run.dir={run_dir}", "sft.steps=40", "data.generator.direct_fraction=0.0",
                 "run.steps=1", env=standin_service.env)
    output = proc.communicate(timeout=600)[0]
    seen = {"creates": standin_service.creates, "commands": standin_service.commands,
            "deleted": len(standin_service.deleted), "live": len(standin_service.sandboxes)}
    return proc.returncode, output, run_dir, seen


@needs_bwrap
@pytest.mark.slow
def test_the_retool_recipe_runs_unchanged_on_daytona(retool_run):
    returncode, output, run_dir, seen = retool_run
    assert returncode == 0, output[-3000:]
    assert "rollout.sandbox: daytona sandboxes at http://127.0.0.1:" in output and "tagged miles-run=" in output
    (step,) = [row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "tools/calls" in row]
    assert step["tools/calls"] > 0 and step["tools/timeouts"] == 0 and step["samples/failed"] == 0
    assert seen["commands"] > seen["creates"] > 0  # each sandbox: its working folder, then the code
    assert seen["deleted"] == seen["creates"] and seen["live"] == 0


@needs_bwrap
@pytest.mark.slow
def test_ctrl_c_deletes_the_open_sandboxes(retool_run, standin, tmp_path):
    assert retool_run[0] == 0, "the ReTool run whose SFT model this run starts from failed"
    standin.hold("exec")  # sandboxes get made, and their commands wait there
    proc = miles("train", *RECIPE, f"run.dir={tmp_path / 'run'}", f"model.path={retool_run[2] / 'sft_model'}",
                 "sft.steps=0", "run.steps=3", env=standin.env, ctrl_c=True)
    try:
        standin.wait_until(lambda s: s.held["exec"] >= 1 or proc.poll() is not None)
        open_then = len(standin.sandboxes)
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        standin.release("exec")
    assert proc.returncode == 130 and "miles: interrupted" in output, output[-3000:]
    assert open_then >= 1 and standin.sandboxes == {} and len(standin.deleted) == standin.creates
