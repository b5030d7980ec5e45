"""The ``modal`` sandbox on Modal's real SDK (pinned), its calls answered by the STAND-IN for Modal's service in
``standin_modal.py`` (the ``standin`` fixture): the shared sandbox conformance suite, retries, limits, cleanup
(close, failures, ``close_all``, Ctrl-C, ``gc`` after SIGKILL), configuration and offline errors, and the ReTool
recipe with ``rollout.sandbox.name=modal``. The tests marked ``live`` run the conformance suite against Modal
itself when credentials are set.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import modal
import modal.container_process
import modal.exception
import modal.sandbox.sandbox
import pytest

from miles.testing import SandboxConformance
from miles_modal import ModalSandbox
from miles_modal.sdk import CUT_MARKER
from standin_modal import STANDIN_ENV, StandInFilesystem, StandInModal, StandInProcess, StandInSandbox

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parents[2]
STANDIN = [sys.executable, str(TESTS / "standin_modal.py")]  # `miles` with the stand-in in place of Modal
CREDENTIALS = {"MODAL_TOKEN_ID": "ak-standin", "MODAL_TOKEN_SECRET": "as-standin"}


def run(coro):
    return asyncio.run(coro)


async def closing(sandbox, body):
    try:
        return await body(sandbox)
    finally:
        await sandbox.close()


def child_env(standin: StandInModal) -> dict[str, str]:
    """The environment of a process started through ``standin_modal.py``: the stand-in's folder, made-up
    credentials and this folder on the path (for ``modal_holding_env``)."""
    return {**os.environ, **CREDENTIALS, STANDIN_ENV: str(standin.root), "PYTHONPATH": str(TESTS),
            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


# -- the stand-in is Modal's SDK, as far as the plugin can tell ------------------------------------------


def _parameters(fn) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]


@pytest.mark.parametrize("standin_fn, sdk_fn", [
    (StandInModal.app_lookup, modal.App.lookup.aio),
    (StandInModal.client_from_env, modal.Client.from_env.aio),
    (StandInModal.sandbox_create, modal.Sandbox.create.aio),
    (StandInModal.sandbox_list, modal.Sandbox.list.aio),
    (StandInModal.sandbox_from_id, modal.Sandbox.from_id.aio),
    (StandInSandbox._exec, modal.Sandbox.exec),
    (StandInSandbox._terminate, modal.Sandbox.terminate),
    (StandInFilesystem._write_bytes, modal.sandbox.sandbox.SandboxFilesystem.write_bytes),
    (StandInFilesystem._read_bytes, modal.sandbox.sandbox.SandboxFilesystem.read_bytes),
    (StandInProcess._wait, modal.container_process.ContainerProcess.wait),
], ids=lambda fn: getattr(fn, "__qualname__", ""))
def test_the_standin_keeps_the_sdk_signatures(standin_fn, sdk_fn):
    """Each stand-in takes a subset of the SDK's parameters, of the same kind and default, in the same order, and
    the SDK's others have defaults: a call the stand-in accepts is a valid call of the pinned SDK."""
    ours, theirs = _parameters(standin_fn), {p.name: p for p in _parameters(sdk_fn)}
    for parameter in ours:
        assert parameter.name in theirs, f"{parameter.name}: not a parameter of the SDK's {sdk_fn}"
        sdk_parameter = theirs[parameter.name]
        assert (parameter.kind, parameter.default) == (sdk_parameter.kind, sdk_parameter.default), parameter.name
    names = [p.name for p in ours]
    assert names == [n for n in theirs if n in names], "the parameters come in the SDK's order"
    assert all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for name, p in theirs.items() if name not in names), "the SDK requires a parameter the stand-in lacks"


def test_the_sdk_objects_the_standin_replaces_are_the_sdks_async_api():
    for owner, name in [(modal.App, "lookup"), (modal.Client, "from_env"), (modal.Sandbox, "create"),
                        (modal.Sandbox, "list"), (modal.Sandbox, "from_id")]:
        assert callable(getattr(getattr(owner, name), "aio", None)), f"modal.{owner.__name__}.{name}.aio"
    for name in ("exec", "terminate", "filesystem", "object_id"):
        assert hasattr(modal.Sandbox, name), name
    assert modal.__version__ == "1.6.4", "the pinned SDK (pyproject.toml); update the stand-in with the pin"


# -- the conformance suite -------------------------------------------------------------------------------


class TestModalOnTheStandIn(SandboxConformance):
    """The stand-in runs commands on this machine, so the isolation checks are skipped (isolated = False):
    a real Modal sandbox is a container of its own, with ``block_network`` on by default."""

    isolated = False

    @pytest.fixture(autouse=True)
    def _service(self, standin):
        self.standin = standin

    def make_sandbox(self):
        return ModalSandbox(backoff_s=0.01)


# -- what the plugin asks of Modal -----------------------------------------------------------------------


def test_a_sandbox_is_made_tagged_with_its_lifetime_and_deleted_on_close(standin):
    sandbox = ModalSandbox(run_id="run-7", lifetime_s=600.5, cpu=0.5, memory_mb=512)

    async def body(sandbox):
        first = await sandbox.run("pwd; cat in/a.txt", timeout_s=10, files={"in/a.txt": b"hi"})
        return first, await sandbox.read_file("/workspace/in/a.txt"), standin.live()

    result, data, (record,) = run(closing(sandbox, body))
    assert (result.stdout, result.exit_code, data) == ("/workspace\nhi", 0, b"hi")
    assert record["tags"]["miles"] == "1" and record["tags"]["miles-run"] == "run-7"
    assert set(record["tags"]) == {"miles", "miles-run", "miles-sandbox"}
    assert (record["timeout"], record["block_network"], record["cpu"], record["memory"]) == (601, True, 0.5, 512)
    assert record["app_id"] == (standin.root / "apps" / "miles-sandboxes").read_text()
    assert [r["terminated"] for r in standin.records()] == [True]


def test_outputs_are_cut_while_they_stream_in_with_the_count(standin):
    sandbox = ModalSandbox(output_bytes=100)

    async def body(sandbox):
        return await asyncio.gather(sandbox.run("head -c 1000 /dev/zero | tr '\\0' x", timeout_s=10),
                                    sandbox.run("printf 'é%.0s' $(seq 500)", timeout_s=10),  # 1000 bytes
                                    sandbox.run("head -c 100 /dev/zero | tr '\\0' y", timeout_s=10))

    ascii_cut, utf8_cut, whole = run(closing(sandbox, body))
    kept = 100 - len(CUT_MARKER.format(1000))
    assert ascii_cut.stdout == "x" * kept + CUT_MARKER.format(1000 - kept)
    shown = utf8_cut.stdout.split("\n[...")[0]
    assert shown == "é" * (kept // 2) and utf8_cut.stdout.endswith(CUT_MARKER.format(1000 - 2 * (kept // 2)))
    assert whole.stdout == "y" * 100


def test_a_missing_file_reads_as_file_not_found(standin):
    async def body(sandbox):
        await sandbox.run("true", timeout_s=10)
        return await sandbox.read_file("nope.txt")

    with pytest.raises(FileNotFoundError, match="nope.txt"):
        run(closing(ModalSandbox(), body))


# -- failures and retries --------------------------------------------------------------------------------


def test_creation_is_retried_with_backoff(standin):
    standin.fail["create"] = [modal.exception.InternalError("HTTP 500: internal error"),
                              modal.exception.ServiceError("HTTP 503: service unavailable")]
    result = run(closing(ModalSandbox(backoff_s=0.01), lambda s: s.run("echo up", timeout_s=10)))
    assert result.stdout == "up\n"
    assert standin.calls["create"] == 3 and len(standin.records()) == 1


def test_a_create_that_keeps_failing_is_a_clear_error_and_leaves_nothing(standin):
    standin.fail_always["create"] = modal.exception.InternalError("HTTP 500: internal error")
    with pytest.raises(RuntimeError, match=r"modal: could not create a sandbox in 3 attempt\(s\): "
                                           r"InternalError: HTTP 500: internal error"):
        run(closing(ModalSandbox(create_retries=2, backoff_s=0.01), lambda s: s.run("true", timeout_s=10)))
    assert standin.calls["create"] == 3 and standin.records() == []


def test_a_permanent_error_is_not_retried_and_names_the_server(standin):
    standin.fail_always["create"] = modal.exception.AuthError("Token is invalid")
    with pytest.raises(RuntimeError, match=r"in 1 attempt\(s\): AuthError: Token is invalid \(https://api.modal.com"):
        run(closing(ModalSandbox(backoff_s=0.01), lambda s: s.run("true", timeout_s=10)))
    assert standin.calls["create"] == 1


def test_a_create_made_there_but_never_answered_is_deleted(standin):
    async def main():
        standin.gates["create"] = asyncio.Event()  # never set: the service made it, the answer never comes
        await closing(ModalSandbox(create_retries=0, create_timeout_s=0.5), lambda s: s.run("true", timeout_s=10))

    with pytest.raises(RuntimeError, match="could not create a sandbox within 0.5 s"):
        run(main())
    (record,) = standin.records()
    assert record["terminated"]


def test_a_failing_exec_fails_that_run_with_the_reason_and_the_next_one_works(standin):
    async def body(sandbox):
        await sandbox.run("true", timeout_s=10)
        standin.fail["exec"] = [modal.exception.InternalError("HTTP 500: exec failed")]
        with pytest.raises(modal.exception.InternalError, match="HTTP 500: exec failed"):
            await sandbox.run("echo lost", timeout_s=10)
        return await sandbox.run("echo again", timeout_s=10)

    assert run(closing(ModalSandbox(), body)).stdout == "again\n"
    assert [r["terminated"] for r in standin.records()] == [True]


def test_in_a_rollout_a_failing_exec_is_the_tool_calls_error_and_the_sandbox_is_deleted(standin, chat_model_dir):
    """Through Miles' multi_turn rollout and tool_env: the model reads the reason; the episode goes on."""
    from transformers import AutoTokenizer

    from miles.agentic.tool_calls import PythonBlockParser
    from miles.agentic.tool_env import ToolEnv, execute_python_code
    from miles.rollout.context import RolloutContext
    from miles.rollout.generate import run_one
    from miles.rollout.multi_turn import MultiTurn
    from miles.testing import ScriptedPolicy
    from miles.types import Sample, SampleStatus

    seen = []

    def act(turn, observation):
        seen.append(observation)
        if turn == 2:  # the sandbox is up; its next command fails
            standin.fail["exec"] = [modal.exception.InternalError("HTTP 500: exec failed")]
        return "```python\nprint(6*7)\n```" if turn <= 2 else "42"

    tokenizer = AutoTokenizer.from_pretrained(str(chat_model_dir))
    ctx = RolloutContext(engine=ScriptedPolicy(tokenizer, act), tokenizer=tokenizer,
                         sampling_params={"max_new_tokens": 64}, env=lambda c: ToolEnv(c),
                         sandbox=lambda: ModalSandbox(backoff_s=0.01), tool_parser=PythonBlockParser(),
                         tool={"execute_python_code": execute_python_code}.__getitem__)
    sample = Sample(prompt_ids=[0], prompt="6*7=")
    run(run_one(MultiTurn(tools_in_prompt=False), sample, ctx))
    assert (sample.status, sample.response_text) == (SampleStatus.COMPLETED, "42"), sample.reason
    assert "42" in seen[1] and "error: InternalError: HTTP 500: exec failed" in seen[2]
    assert [r["terminated"] for r in standin.records()] == [True]


# -- how many, and cleaning up ---------------------------------------------------------------------------


def test_at_most_max_concurrent_sandboxes_live_at_once(standin):
    async def main():
        standin.gates["create"] = asyncio.Event()
        sandboxes = [ModalSandbox(max_concurrent=2) for _ in range(5)]
        runs = [asyncio.ensure_future(closing(s, lambda s: s.run("echo hi", timeout_s=10))) for s in sandboxes]
        while standin.waiting["create"] < 2:
            await asyncio.sleep(0.01)
        for _ in range(50):  # a third may not even be asked for while two are live
            await asyncio.sleep(0)
        asked_while_full = standin.calls["create"]
        standin.gates["create"].set()
        results = await asyncio.gather(*runs)
        return asked_while_full, [r.stdout for r in results]

    asked_while_full, outputs = run(main())
    assert asked_while_full == 2 and outputs == ["hi\n"] * 5
    assert standin.peak_live == 2 and len(standin.records()) == 5


def test_close_all_deletes_every_open_sandbox_and_a_create_under_way(standin):
    async def main():
        sandboxes = [ModalSandbox() for _ in range(3)]
        for sandbox in sandboxes[:2]:
            await sandbox.run("true", timeout_s=10)
        standin.gates["create"] = asyncio.Event()
        pending = asyncio.ensure_future(sandboxes[2].run("true", timeout_s=10))
        while standin.waiting["create"] < 1:  # made there, not answered yet
            await asyncio.sleep(0.01)
        live = len(standin.live())
        closed = await ModalSandbox.close_all()
        await asyncio.gather(pending, return_exceptions=True)
        return live, closed

    assert run(main()) == (3, 3)
    assert standin.live() == [] and len(standin.records()) == 3


def _wait_for(condition, proc: subprocess.Popen, what: str, timeout_s: float = 300) -> None:
    """Poll until ``condition()`` (a safety-net deadline only); the process must still be running meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the process ended (exit code {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.1)


def test_ctrl_c_deletes_every_open_sandbox(standin, tmp_path):
    """`miles train` whose trajectories each hold a Modal sandbox (modal_holding_env runs `sleep 600` in it) gets
    SIGINT: it exits 130 and the service holds no sandbox."""
    with open(tmp_path / "log.txt", "w+") as log:
        proc = subprocess.Popen(
            [*STANDIN, "train", "configs/retool.yaml", f"run.dir={tmp_path / 'run'}", "run.progress=false",
             "sft.steps=1", "run.eval_size=0", "rollout.prompts_per_step=2", "rollout.n_samples=2",
             "rollout.env.name=modal_holding_env:HoldingEnv", "rollout.sandbox.name=modal"],
            cwd=REPO, env=child_env(standin), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_for(lambda: len([r for r in standin.live() if r["commands"] >= 2]) >= 4, proc,
                      "4 sandboxes running `sleep`")
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        output = (tmp_path / "log.txt").read_text()
    assert proc.returncode == 130, output
    assert "miles: interrupted" in output and "Traceback" not in output
    assert len(standin.records()) >= 4 and standin.live() == []
    assert not SandboxConformance.pids_running("sleep 600")


KILLED_RUN = """
import asyncio, os, sys
from standin_modal import STANDIN_ENV, StandInModal
StandInModal(os.environ[STANDIN_ENV]).install()
from miles_modal import ModalSandbox

async def main():
    sandboxes = [ModalSandbox(run_id=run_id) for run_id in sys.argv[1:]]
    for sandbox in sandboxes:
        await sandbox.run("true", timeout_s=30)
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_gc_deletes_what_a_sigkilled_run_left_by_its_tags(standin):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, "run-a", "run-a", "run-b"], env=child_env(standin),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout.readline() == "ready\n", proc.communicate()[0]
        proc.kill()
        proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(standin.live()) == 3  # the run is gone; its sandboxes are not

    assert len(run(ModalSandbox.gc(run_id="run-a"))) == 2  # what `miles sandbox gc modal --run run-a` calls
    assert [r["tags"]["miles-run"] for r in standin.live()] == ["run-b"]
    assert len(run(ModalSandbox.gc())) == 1  # every Miles run's leftovers
    assert standin.live() == []


# -- configuration and an unreachable service ------------------------------------------------------------


def _without_modal_settings(tmp_path: Path) -> dict[str, str]:
    """This environment without Modal's variables, and no ~/.modal.toml (HOME and MODAL_CONFIG_PATH in tmp_path)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}, "HOME": str(tmp_path),
            "MODAL_CONFIG_PATH": str(tmp_path / "modal.toml")}


def test_a_run_without_credentials_stops_at_config_validation_naming_them(monkeypatch):
    from miles.errors import ConfigError
    from miles.run.runner import prepare

    for name in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_OAUTH_REFRESH_TOKEN"):
        monkeypatch.setenv(name, "")  # set but empty: the SDK reads the environment before ~/.modal.toml
    with pytest.raises(ConfigError, match=r"rollout.sandbox: sandbox 'modal' rejected its arguments: the modal "
                                          r"sandbox needs Modal credentials: MODAL_TOKEN_ID and MODAL_TOKEN_SECRET "
                                          r"are not set"):
        prepare(str(REPO / "configs/retool.yaml"), ["rollout.sandbox.name=modal"])


CHECK_CREDENTIALS = """
import os
from miles_modal import ModalSandbox
ModalSandbox.check_args({})  # from ~/.modal.toml
print("from the file: ok")
os.environ["MODAL_TOKEN_SECRET"] = ""  # the environment comes first
try:
    ModalSandbox.check_args({})
except ValueError as exc:
    print(exc)
"""


def test_credentials_in_modal_toml_count(tmp_path):
    (tmp_path / "modal.toml").write_text('[default]\ntoken_id = "ak-1"\ntoken_secret = "as-1"\nactive = true\n')
    result = subprocess.run([sys.executable, "-c", CHECK_CREDENTIALS], capture_output=True, text=True, timeout=120,
                            env=_without_modal_settings(tmp_path))
    assert result.stdout.splitlines() == [
        "from the file: ok", "the modal sandbox needs Modal credentials: MODAL_TOKEN_SECRET is not set (set the "
        "environment variables, or run `modal token new`, which writes ~/.modal.toml)"], result.stderr


@pytest.mark.parametrize("args, message", [
    ({"lifetime_s": 90000}, "lifetime_s: Modal keeps a sandbox at most 86400 s"),
    ({"cpu": 0}, "cpu: expected a positive number of cores"),
    ({"memory_mb": 0.5}, "memory_mb: expected a positive integer"),
    ({"image": ""}, "image: expected a registry image"),
    ({"block_network": "no"}, "block_network: expected true or false"),
    ({"max_concurrent": 0}, "max_concurrent: expected a positive integer"),
    ({"workdir": "work"}, "workdir: expected an absolute path"),
])
def test_bad_arguments_are_config_errors_naming_them(monkeypatch, args, message):
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        ModalSandbox.check_args(args)


@pytest.fixture
def real_sdk(monkeypatch):
    """Modal's real SDK with made-up credentials and a fresh client (the SDK keeps one per process, made for
    the server of its first call; each test here points it elsewhere)."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    modal.Client._set_env_client(None)
    yield
    modal.Client._set_env_client(None)


class _Silent:
    """A server on 127.0.0.1 that accepts connections and never answers (a service that hangs)."""

    def __enter__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        return self

    def __exit__(self, *exc):
        self.listener.close()


def _closed_port_url() -> str:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        return f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["closed port", "silent server"])
def test_an_unreachable_service_fails_the_start_in_bounded_time_naming_it(real_sdk, monkeypatch, kind):
    """The real SDK, no stand-in: alone it retries for about a minute; preflight gives up after connect_timeout_s."""
    with _Silent() as silent:
        url = silent.url if kind == "silent server" else _closed_port_url()
        monkeypatch.setenv("MODAL_SERVER_URL", url)
        started = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            run(ModalSandbox.preflight(connect_timeout_s=1))
        elapsed = time.monotonic() - started
    assert str(info.value) == f"modal: {url} (MODAL_SERVER_URL) did not answer within 1 s"
    assert elapsed < 30, f"{elapsed:.1f} s"  # the bound is 1 s; the SDK by itself gives up after about 56 s


def test_a_first_create_against_an_unreachable_service_fails_in_bounded_time_naming_it(real_sdk, monkeypatch):
    with _Silent() as silent:
        monkeypatch.setenv("MODAL_SERVER_URL", silent.url)
        started = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            run(closing(ModalSandbox(create_retries=0, create_timeout_s=1, connect_timeout_s=1),
                        lambda s: s.run("true", timeout_s=10)))
        elapsed = time.monotonic() - started
    assert str(info.value).startswith("modal: could not create a sandbox in 1 attempt(s): TimeoutError: modal: "
                                      f"could not create a sandbox within 1 s ({silent.url}"), str(info.value)
    assert elapsed < 30, f"{elapsed:.1f} s"  # create (1 s), then looking for what it may have left (1 s)


def test_a_service_that_never_answers_is_named_by_its_default_address(standin, monkeypatch):
    monkeypatch.delenv("MODAL_SERVER_URL", raising=False)

    async def main():
        standin.gates["hello"] = asyncio.Event()  # never set
        await ModalSandbox.preflight(connect_timeout_s=0.2)

    with pytest.raises(TimeoutError, match=r"^modal: https://api.modal.com or https://api.modal2.com \(the SDK's "
                                           r"default server\) did not answer within 0.2 s$"):
        run(main())


def test_a_service_that_refuses_the_credentials_fails_the_start_naming_it(standin):
    standin.fail_always["hello"] = modal.exception.AuthError("Token is invalid")
    with pytest.raises(ConnectionError, match=r"^modal: cannot use https://api.modal.com or https://api.modal2.com: "
                                              r"AuthError: Token is invalid$"):
        run(ModalSandbox.preflight())


def test_describe_says_where_and_how(monkeypatch):
    monkeypatch.setenv("MODAL_SERVER_URL", "https://modal.example")
    assert ModalSandbox.describe(image="python:3.11-slim", max_concurrent=4) == (
        "modal sandboxes at https://modal.example (app 'miles-sandboxes', image python:3.11-slim, no network), "
        "at most 4 at "
        "once, deleted at the end of each trajectory and of the run")


# -- the ReTool recipe -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_retool_recipe_runs_unchanged_on_modal(standin, tmp_path):
    result = subprocess.run(
        [*STANDIN, "train", "configs/retool.yaml", f"run.dir={tmp_path / 'run'}", "rollout.sandbox.name=modal",
         "sft.steps=80", "data.generator.direct_fraction=0.0", "run.steps=1", "rollout.prompts_per_step=2",
         "rollout.n_samples=4", "run.eval_size=0", "run.progress=false"],
        cwd=REPO, env=child_env(standin), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "rollout.sandbox: modal sandboxes at" in result.stderr
    step = next(json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                if "reward/mean" in line)
    assert step["samples/failed"] == 0 and step["tools/calls"] > 0 and step["tools/success_rate"] > 0
    records = standin.records()
    assert records and sum(r["commands"] for r in records) > len(records)  # each ran its mkdir and code
    assert standin.live() == [], "every sandbox was deleted by the end of the run"
    assert len({r["tags"]["miles-run"] for r in records}) == 1


# -- live: Modal itself ----------------------------------------------------------------------------------


def _skip_unless_credentials() -> None:
    from miles_modal import sdk

    if sdk.missing_credentials():
        pytest.skip("MODAL_TOKEN_ID and MODAL_TOKEN_SECRET not set (nor ~/.modal.toml): the live tests run against "
                    "Modal itself")


@pytest.mark.live
class TestModalLive(SandboxConformance):
    """The conformance suite against Modal's service. A Modal sandbox is a container of its own with
    ``block_network`` on (the network check runs); writes outside the working folder land in that container,
    not on this machine, so that check does not apply."""

    isolated = True

    @pytest.fixture(autouse=True)
    def _credentials(self):
        _skip_unless_credentials()
        yield
        run(ModalSandbox.close_all())

    def make_sandbox(self):
        return ModalSandbox(app_name="miles-live-tests", run_id="miles-live-tests", lifetime_s=600)

    def test_no_writes_outside_the_workspace(self):
        pytest.skip("a Modal sandbox's filesystem is its own container's: writes there do not reach this machine")


@pytest.mark.live
def test_live_gc_leaves_nothing_tagged_by_the_live_tests():
    _skip_unless_credentials()
    run(ModalSandbox.gc(run_id="miles-live-tests"))
    assert run(ModalSandbox._list({"miles": "1", "miles-run": "miles-live-tests"})) == []
