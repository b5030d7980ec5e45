"""The ``shm`` weight transport against a real ``miles engine serve`` process on 127.0.0.1, and ``auto``'s choice
between shm and tensor.

Nothing here waits a fixed time: a push is held in the middle of writing the file by a gate (a
threading.Event), and the test opens it once the engine has answered the racing catch-up. A rewrite in the
middle of the engine's own copy is made by a server run in a thread of this process, whose header check is
patched to start one.
"""

import asyncio
import contextlib
import glob
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

import miles.weights.transports as weight_sync
from miles.engine import LocalEngine
from miles.weights.shm import (
    HEADER, MAGIC, WRITING, MappedWeightFile, WeightFile, host_id, parse_descriptor,
)
from miles.rollout.plane import RolloutPlane
from miles.testing import free_port, serve_in_thread
from miles.engine.router import Router
from miles.errors import EngineRequestError
from miles.testing import build_tiny_model
from miles.weights.transports import AutoTransport, SharedMemoryTransport, SharedMemoryUnavailable

SHM = "/update_weights_from_shm"
PROMPT = [5, 13, 2, 14]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def call(base, path, body=None, headers=None):
    """(status, JSON answer)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def start_engine(model_dir, log_path, *args):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "miles", "engine", "serve", "--model", str(model_dir),
                                 "--port", str(port), *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"engine server exited: {open(log_path).read()}")
        try:
            if call(base, "/health")[0] == 200:
                return proc, base
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the engine server did not answer /health")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc, base = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine") / "engine.log")
    yield base
    proc.terminate()
    proc.wait(timeout=10)


class Weights:
    """A backend that exports fixed weights."""

    def __init__(self, weights):
        self.weights = weights

    def export_weights(self):
        return self.weights


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """Two sets of weights for the served model's architecture, unlike its own (seed 0) and each other's."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("policies")
    return [Weights(AutoModelForCausalLM.from_pretrained(build_tiny_model(root / f"p{seed}", seed=seed)).state_dict())
            for seed in (21, 22)]


@pytest.fixture
def plane(server):
    plane = RolloutPlane(router=Router([server], health_interval_s=3600))
    yield plane
    plane.close()


def served(base):
    """The engine's greedy tokens and their log-probs for PROMPT."""
    status, answer = call(base, "/generate", {"input_ids": PROMPT, "return_logprob": True, "sampling_params": GREEDY})
    assert status == 200, answer
    return answer["output_ids"], [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]


def in_process(tiny_model_dir, weights):
    """What an in-process engine with ``weights`` answers for PROMPT."""
    engine = LocalEngine()
    engine.load_model(str(tiny_model_dir))
    engine.update_weights(weights, 1)
    answer = asyncio.run(engine.generate(PROMPT, GREEDY, return_logprob=True))
    engine.close()
    return answer["output_ids"], [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]


def version_of(base):
    return call(base, "/health")[1]["weight_version"]


_FOUND_BEFORE: set[str] = set()


@pytest.fixture(autouse=True)
def _files_of_earlier_tests():
    """Weight files this process made before the test (other tests' runs in the same pytest process)."""
    _FOUND_BEFORE.clear()
    _FOUND_BEFORE.update(glob.glob(f"/dev/shm/miles-weights-{os.getpid()}-*"))


def my_files():
    """The weight files this test's transports made and have not removed."""
    return sorted(set(glob.glob(f"/dev/shm/miles-weights-{os.getpid()}-*")) - _FOUND_BEFORE)


def test_a_push_serves_what_an_in_process_engine_serves_and_the_file_is_removed_on_close(
        server, plane, policies, tiny_model_dir):
    transport = SharedMemoryTransport()
    try:
        nbytes = sum(t.numel() * t.element_size() for t in policies[0].weights.values())
        assert transport.push(policies[0], plane, 7) == nbytes
        assert version_of(server) == 7 and plane.router.engines[0].weight_version == 7
        ids, logprobs = served(server)
        expected_ids, expected_logprobs = in_process(tiny_model_dir, policies[0].weights)
        assert ids == expected_ids
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-6)
        [path] = my_files()
        inode = os.stat(path).st_ino
        transport.push(policies[1], plane, 8)  # the same file, written again in place
        assert my_files() == [path] and os.stat(path).st_ino == inode
        assert version_of(server) == 8 and served(server)[0] == in_process(tiny_model_dir, policies[1].weights)[0]
    finally:
        transport.close()
    assert my_files() == []


def test_a_grown_model_gets_a_new_file_and_the_old_one_is_removed(server, plane, policies):
    transport = SharedMemoryTransport()
    try:
        transport.push(policies[0], plane, 9)
        [first] = my_files()
        bigger = Weights({**policies[0].weights, "extra": torch.zeros(1000)})  # refused by the engine, after writing
        with pytest.raises(EngineRequestError, match="1 unexpected: extra"):
            transport.push(bigger, plane, 10)
        [second] = my_files()
        assert second != first and version_of(server) == 9
    finally:
        transport.close()


def test_non_finite_weights_are_refused_and_nothing_is_applied(server, plane, policies):
    transport = SharedMemoryTransport()
    try:
        transport.push(policies[0], plane, 11)
        before = served(server)
        broken = dict(policies[1].weights)
        broken["model.norm.weight"] = broken["model.norm.weight"].clone()
        broken["model.norm.weight"][3] = float("nan")
        with pytest.raises(EngineRequestError, match="NaN or inf values: model.norm.weight"):
            transport.push(Weights(broken), plane, 12)
        ids, logprobs = served(server)
        assert version_of(server) == 11 and ids == before[0]
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(before[1]), atol=1e-5)  # the prefix cache rounds
    finally:
        transport.close()


def test_the_file_is_removed_when_the_trainer_exits_with_an_exception(tmp_path):
    script = ("import torch; from miles.weights.transports import SharedMemoryTransport\n"
              "t = SharedMemoryTransport(); t._write({'w': torch.ones(4)}, 1); print(t._last['path'], flush=True)\n"
              "raise SystemExit('the trainer failed')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    path = done.stdout.strip()
    assert done.returncode == 1 and path.startswith("/dev/shm/miles-weights-"), done.stderr
    assert not os.path.exists(path)


def quarantined(plane):
    """The engine as it is while it catches up: out of service (pushes do not reach it)."""
    endpoint = plane.router.engines[0]

    async def quarantine():
        await plane.router.wait_healthy()  # the health check's own first look is over: no re-admission behind us
        endpoint.quarantined = True

    plane.run(quarantine())
    return endpoint


def test_a_catch_up_racing_a_push_is_answered_409_and_ends_at_the_last_version(
        server, plane, policies, tiny_model_dir, monkeypatch):
    transport = SharedMemoryTransport()
    try:
        transport.push(policies[0], plane, 20)
        endpoint = quarantined(plane)
        # The next push stops with the file's header saying "being written", until the gate opens.
        header_written, gate = threading.Event(), threading.Event()
        write = transport._file.write

        def held_write(weights, descriptor):
            HEADER.pack_into(transport._file._mmap, 0, MAGIC, descriptor["sequence"] - 1, WRITING)
            header_written.set()
            assert gate.wait(60)
            write(weights, descriptor)

        monkeypatch.setattr(transport._file, "write", held_write)
        statuses, conflict = [], threading.Event()
        post = weight_sync._post_json

        async def recording_post(plane, engine, path, body):
            status, answer = await post(plane, engine, path, body)
            statuses.append(status)
            if status == 409:
                assert "rewritten while reading" in answer["error"]
                conflict.set()
            return status, answer

        monkeypatch.setattr(weight_sync, "_post_json", recording_post)
        pushing = threading.Thread(target=transport.push, args=(policies[1], plane, 21))
        pushing.start()
        assert header_written.wait(60)
        catching_up = asyncio.run_coroutine_threadsafe(transport.catch_up(plane, endpoint), plane.aio.loop)
        assert conflict.wait(60)
        assert version_of(server) == 20  # the conflict applied nothing
        gate.set()
        pushing.join(60)
        catching_up.result(60)
        assert statuses[0] == 409 and statuses[-1] == 200
        assert endpoint.weight_version == version_of(server) == 21
        assert served(server)[0] == in_process(tiny_model_dir, policies[1].weights)[0]
    finally:
        transport.close()


def test_the_engine_refuses_a_file_that_is_being_written(server, plane, policies):
    transport = SharedMemoryTransport()
    try:
        transport.push(policies[0], plane, 30)
        last = transport._last
        HEADER.pack_into(transport._file._mmap, 0, MAGIC, last["sequence"] + 1, WRITING)
        for snapshot in (False, True):
            status, answer = call(server, SHM, {**last, "weight_version": 31, "snapshot": snapshot})
            assert status == 409 and "being written" in answer["error"], answer
        assert version_of(server) == 30
    finally:
        transport.close()


@pytest.mark.parametrize("path", [
    "/tmp/miles-weights-x", "/dev/shm/other-weights", "/dev/shm/../dev/shm/miles-weights-x",
    "/dev/shm/sub/miles-weights-x", "miles-weights-x", 7,
])
def test_paths_other_than_miles_files_directly_under_dev_shm_are_refused(server, path):
    status, answer = call(server, SHM, {"path": path, "names": [], "dtypes": [], "shapes": [], "offsets": [],
                                        "sequence": 2, "weight_version": 1})
    assert status == 400 and answer["error"].startswith("path: expected a file directly under /dev/shm"), answer


def test_links_directories_and_missing_files_are_refused(server, tmp_path):
    stem = f"/dev/shm/miles-weights-test-{os.getpid()}"
    target = tmp_path / "target"
    target.write_bytes(MAGIC + bytes(4096))
    os.symlink(target, stem + "-link")
    os.mkdir(stem + "-dir")
    try:
        for path, expected in ((stem + "-link", "path: cannot open"), (stem + "-dir", "is not a regular file"),
                               (stem + "-missing", "path: cannot open")):
            status, answer = call(server, SHM, {"path": path, "names": [], "dtypes": [], "shapes": [], "offsets": [],
                                                "sequence": 2, "weight_version": 1})
            assert status == 400 and expected in answer["error"], (path, answer)
    finally:
        os.unlink(stem + "-link")
        os.rmdir(stem + "-dir")


@pytest.mark.parametrize("change, field", [
    (lambda d: d.pop("offsets"), "missing field(s): offsets"),
    (lambda d: d["names"].pop(), "names, dtypes, shapes, offsets: expected lists of the same length"),
    (lambda d: d.update(dtypes=["int4"] + d["dtypes"][1:]), "dtypes: expected names among"),
    (lambda d: d.update(shapes=[[-1]] + d["shapes"][1:]), "shapes: expected lists of sizes >= 0"),
    (lambda d: d.update(offsets=[66] + d["offsets"][1:]), "offsets: expected byte offsets from 64 on"),
    (lambda d: d.update(offsets=[8] + d["offsets"][1:]), "offsets: expected byte offsets from 64 on"),
    (lambda d: d.update(offsets=d["offsets"][:-1] + [d["offsets"][-1] + 64]), "goes past the end"),
    (lambda d: d.update(shapes=[[10**6]] + d["shapes"][1:]), "goes past the end"),
    (lambda d: d.update(names=["model.norm.weight"] * len(d["names"])), "names: expected distinct tensor names"),
    (lambda d: d.update(weight_version="x"), "weight_version: expected an integer"),
    (lambda d: d.update(sequence=None), "sequence: expected an integer"),
    (lambda d: d.update(snapshot="yes"), "snapshot: expected true or false"),
    (lambda d: d.update(allow_non_finite="yes"), "allow_non_finite: expected true or false"),
])
def test_malformed_descriptors_get_400_naming_the_field_and_apply_nothing(server, plane, policies, change, field):
    transport = SharedMemoryTransport()
    try:
        transport.push(policies[0], plane, 40)
        descriptor = json.loads(json.dumps(transport._last))
        change(descriptor)
        status, answer = call(server, SHM, {**descriptor, "weight_version": 41} if field[:6] != "weight"
                              else descriptor)
        assert status == 400 and field in answer["error"], answer
        assert version_of(server) == 40
    finally:
        transport.close()


def test_the_endpoint_needs_the_admin_token_and_server_info_names_the_host(tiny_model_dir, tmp_path, policies):
    proc, base = start_engine(tiny_model_dir, tmp_path / "engine.log", "--admin-token", "s3cret")
    transport = SharedMemoryTransport()
    plane = RolloutPlane(router=Router([base], admin_token="s3cret", health_interval_s=3600))
    try:
        assert call(base, "/server_info")[1]["host_id"] == host_id() is not None
        transport.push(policies[0], plane, 50)
        assert version_of(base) == 50
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, answer = call(base, SHM, {**transport._last, "weight_version": 51}, headers)
            assert status == 401 and "Authorization: Bearer" in answer["error"]
        assert version_of(base) == 50
    finally:
        transport.close()
        plane.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_in_process_engines_get_a_plain_copy(tiny_model_dir, policies):
    engine = LocalEngine()
    engine.load_model(str(tiny_model_dir))
    plane = RolloutPlane(local_engines=[engine])
    transport = SharedMemoryTransport()
    try:
        transport.push(policies[0], plane, 3)
        assert engine.weight_version == 3 and my_files() == []
        assert torch.equal(engine.model.state_dict()["model.norm.weight"], policies[0].weights["model.norm.weight"])
    finally:
        transport.close()
        plane.close()


def recorded_posts(plane, monkeypatch):
    """The paths the router posts to, in order."""
    paths = []
    post = plane.router.post

    async def recording(engine, path, *args, **kwargs):
        paths.append(path)
        return await post(engine, path, *args, **kwargs)

    monkeypatch.setattr(plane.router, "post", recording)
    return paths


@pytest.mark.parametrize("where", ["this machine", "another machine", "no host_id"])
def test_auto_uses_shm_only_for_engines_on_this_machine(server, plane, policies, tiny_model_dir, monkeypatch, where):
    """The engine runs on this machine; the trainer is made to look elsewhere by patching its ``host_id`` (in this
    process), or the engine to report none by patching the ``/server_info`` answer the transport reads."""
    if where == "another machine":
        monkeypatch.setattr(weight_sync, "host_id", lambda: "another-boot-id/another-host")
    if where == "no host_id":
        server_info = weight_sync._server_info

        async def without_host_id(plane, engine):
            return {k: v for k, v in (await server_info(plane, engine)).items() if k != "host_id"}

        monkeypatch.setattr(weight_sync, "_server_info", without_host_id)
    transport = AutoTransport()
    paths = recorded_posts(plane, monkeypatch)
    try:
        for version in (60, 61):
            transport.push(policies[version - 60], plane, version)
            assert version_of(server) == version
        expected = SHM if where == "this machine" else "/update_weights_from_tensor"
        assert paths == [expected, expected]
        assert (my_files() != []) == (where == "this machine")
        assert served(server)[0] == in_process(tiny_model_dir, policies[1].weights)[0]
    finally:
        transport.close()
    assert my_files() == []


def test_auto_falls_back_to_tensor_for_an_engine_that_cannot_open_the_file(server, plane, policies, monkeypatch):
    """As with an engine in a container with a /dev/shm of its own: the file is unlinked before the post."""
    transport = AutoTransport()
    write = transport._shm._file.write

    def write_and_hide(weights, descriptor):
        write(weights, descriptor)
        os.unlink(descriptor["path"])

    monkeypatch.setattr(transport._shm._file, "write", write_and_hide)
    paths = recorded_posts(plane, monkeypatch)
    try:
        transport.push(policies[0], plane, 70)
        assert paths == [SHM, "/update_weights_from_tensor"] and version_of(server) == 70
        transport.push(policies[1], plane, 71)  # that engine gets tensors from now on
        assert paths[2:] == ["/update_weights_from_tensor"] and version_of(server) == 71
    finally:
        transport.close()


def test_plain_shm_names_the_engine_that_cannot_open_the_file(server, plane, policies, monkeypatch):
    transport = SharedMemoryTransport()
    write = transport._file.write
    monkeypatch.setattr(transport._file, "write", lambda w, d: (write(w, d), os.unlink(d["path"])))
    try:
        expected = f"needs every engine on this machine.*{server}.*path: cannot open"
        with pytest.raises(SharedMemoryUnavailable, match=expected):
            transport.push(policies[0], plane, 80)
    finally:
        transport.close()


@contextlib.contextmanager
def server_in_a_thread(model_dir):
    """The engine's HTTP application served by a thread of this process (so that a test can patch it)."""
    engine = LocalEngine(background=True)
    engine.load_model(str(model_dir))
    try:
        with serve_in_thread(engine) as url:
            yield url
    finally:
        engine.close()


@pytest.mark.parametrize("snapshot", [True, False])
def test_a_rewrite_during_the_engines_copy_is_answered_409(tiny_model_dir, policies, monkeypatch, snapshot):
    """With ``snapshot`` (what a catch-up sends) nothing is applied; without (a push, which never races a
    rewrite) the engine still says that what it applied may mix two versions."""
    with server_in_a_thread(tiny_model_dir) as base:
        plane = RolloutPlane(router=Router([base], health_interval_s=3600))
        transport = SharedMemoryTransport()
        try:
            transport.push(policies[0], plane, 100)
            transport._write(policies[1].weights, 101)  # complete in the file, not posted
            rewritten, checks = MappedWeightFile.rewritten, []

            def rewrite_after_the_first_check(self, d):
                why = rewritten(self, d)
                checks.append(why)
                if len(checks) == 1:  # another push starts writing the file
                    HEADER.pack_into(transport._file._mmap, 0, MAGIC, transport._last["sequence"] + 1, WRITING)
                return why

            monkeypatch.setattr(MappedWeightFile, "rewritten", rewrite_after_the_first_check)
            status, answer = call(base, SHM, {**transport._last, "snapshot": snapshot})
            assert status == 409 and checks[0] is None and "being written" in checks[1], answer
            if snapshot:
                assert version_of(base) == 100 and "may mix" not in answer["error"]
            else:
                assert version_of(base) == 101 and "may mix two versions" in answer["error"]
        finally:
            transport.close()
            plane.close()


@pytest.mark.parametrize("where", ["this machine", "another machine"])
def test_auto_catches_an_engine_up_with_shm_here_and_tensors_elsewhere(
        server, plane, policies, tiny_model_dir, monkeypatch, where):
    """The last push went by shm; the engine comes back (a new incarnation) with the model's first weights,
    on this machine or, as the trainer's patched ``host_id`` makes it look, on another."""
    transport = AutoTransport()
    try:
        transport.push(policies[1], plane, 90)
        endpoint = quarantined(plane)
        status, _ = call(server, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": 0})
        assert status == 200
        endpoint.weight_version, endpoint.incarnation = 0, endpoint.incarnation + 1
        if where == "another machine":
            monkeypatch.setattr(weight_sync, "host_id", lambda: "another-boot-id/another-host")
        paths = recorded_posts(plane, monkeypatch)
        shm_posts = []
        post_json = weight_sync._post_json

        async def recording(plane, engine, path, body):
            shm_posts.append(path)
            return await post_json(plane, engine, path, body)

        monkeypatch.setattr(weight_sync, "_post_json", recording)
        plane.run(transport.catch_up(plane, endpoint))
        assert endpoint.weight_version == version_of(server) == 90
        if where == "this machine":
            assert shm_posts == [SHM] and paths == []
        else:
            assert shm_posts == [] and paths == ["/update_weights_from_tensor"]
        assert served(server)[0] == in_process(tiny_model_dir, policies[1].weights)[0]
    finally:
        transport.close()


def test_the_file_carries_every_dtype_and_shape_a_state_dict_holds():
    weights = {"bf16": torch.randn(3, 5).bfloat16(), "f16": torch.randn(7).half(), "f64": torch.randn(2, 2).double(),
               "i64": torch.arange(7), "bool": torch.tensor([True, False, True]),
               "u8": torch.arange(5, dtype=torch.uint8), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
               "transposed": torch.randn(4, 6).t()}
    file = WeightFile()
    try:
        descriptor = file.prepare(weights, 3)
        file.write(weights, descriptor)
        assert all(offset % 64 == 0 for offset in descriptor["offsets"])
        views = MappedWeightFile.open(descriptor["path"]).tensors(parse_descriptor(descriptor))
        for name, tensor in weights.items():
            assert views[name].dtype == tensor.dtype and torch.equal(views[name], tensor), name
        with pytest.raises(ValueError, match="shm: c has dtype torch.complex64"):
            file.prepare({"c": torch.zeros(2, dtype=torch.complex64)}, 4)
    finally:
        file.close()
    assert my_files() == []


@pytest.mark.parametrize("value, refused", [(float("inf"), True), (float("-inf"), True), (float("nan"), True),
                                            (torch.finfo(torch.float32).max, False)])
def test_the_engine_checks_every_value_is_finite(tiny_model_dir, value, refused):
    """The engine's check sums each tensor (a NaN or inf cannot sum to a finite value) and looks at every
    value only when the sum is not finite: largest finite values, whose sum overflows, still load."""
    engine = LocalEngine()
    engine.load_model(str(tiny_model_dir))
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    weights["model.norm.weight"][:] = torch.finfo(torch.float32).max
    weights["model.norm.weight"][5] = value
    try:
        if refused:
            with pytest.raises(ValueError, match="1 with NaN or inf values: model.norm.weight"):
                engine.update_weights(weights, 2)
            assert engine.weight_version == 0
        else:
            assert engine.update_weights(weights, 2) == 2
    finally:
        engine.close()
