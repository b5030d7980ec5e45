"""The router in front of real engine processes on 127.0.0.1.

An engine is SIGKILLed at each moment where it can fail (a request, a weight push, its catch-up, an
abort, a pause, a health check). The moment is held deterministically: a gated engine (this file run
as a script) leaves requests to one path unanswered and says so on stdout, and the test kills it then.

The gated engines are forked from one process of this file that has already imported the engine (a zygote),
so that the thirty engine processes these tests start and kill each start in a fraction of a second instead
of importing torch and transformers anew: each is still a process of its own, serving the real engine.
"""

import asyncio
import concurrent.futures
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from miles.engine.router import EngineGone, NoHealthyEngine, Router
from miles.errors import EngineRequestError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model_dir, port):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "miles", "engine", "serve", "--model", str(model_dir),
                             "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("engine did not start")


@pytest.fixture
def engines(tiny_model_dir):
    ports = [free_port(), free_port()]
    procs = [serving(p) for p in [spawn_gated_engine(tiny_model_dir, port) for port in ports]]  # both start at once
    yield ports, procs
    for p in procs:
        p.kill()
        p.wait()


LONG = {"max_new_tokens": 60, "ignore_eos": True}


def test_least_outstanding_routing_spreads_requests(engines):
    ports, _ = engines

    async def go():
        async with Router([f"http://127.0.0.1:{p}" for p in ports]) as router:
            answers = await asyncio.gather(*(router.generate([4, 13, 5, 14], LONG) for _ in range(16)))
            return answers, [e.served for e in router.engines]

    answers, served = asyncio.run(go())
    assert all(len(a["output_ids"]) == 60 for a in answers)
    assert sorted(served) == [8, 8]


def test_requests_on_a_killed_engine_are_retried_elsewhere_and_it_is_readmitted(engines, tiny_model_dir):
    ports, procs = engines
    readmitted = []

    async def readmit(endpoint):
        readmitted.append(endpoint.url)

    async def go():
        router = Router([f"http://127.0.0.1:{p}" for p in ports], health_interval_s=0.2, on_readmit=readmit)
        async with router:
            await router.post(router.engines[0], "/pause_generation", {})  # its requests will hang in flight
            tasks = [asyncio.ensure_future(router.generate([4, 13, 5, 14], {"max_new_tokens": 120, "ignore_eos": True}))
                     for _ in range(12)]
            while router.engines[0].outstanding < 6:
                await asyncio.sleep(0.01)
            procs[0].send_signal(signal.SIGKILL)
            answers = await asyncio.gather(*tasks)
            stats = dict(router.stats)
            assert router.engines[0].quarantined and not router.engines[1].quarantined
            procs[0].wait()
            procs[0] = start_engine(tiny_model_dir, ports[0])  # the engine comes back
            for _ in range(100):
                if not router.engines[0].quarantined:
                    break
                await asyncio.sleep(0.1)
            back = await router.generate([4, 13], {"max_new_tokens": 2})
            return answers, stats, router.engines[0].quarantined, back

    answers, stats, still_quarantined, back = asyncio.run(go())
    assert len(answers) == 12 and all(len(a["output_ids"]) == 120 for a in answers)  # none lost
    assert stats["engine_failures"] == 1 and stats["retries"] >= 1
    assert not still_quarantined and readmitted == [f"http://127.0.0.1:{ports[0]}"]
    assert back["meta_info"]["completion_tokens"] == 2


def test_bad_requests_are_not_retried(engines):
    ports, _ = engines

    async def go():
        async with Router([f"http://127.0.0.1:{p}" for p in ports]) as router:
            with pytest.raises(EngineRequestError, match="max_new_tokens"):
                await router.generate([4], {"max_new_tokens": -1})
            return dict(router.stats), [e.quarantined for e in router.engines]

    stats, quarantined = asyncio.run(go())
    assert stats["retries"] == 0 and quarantined == [False, False]


def test_an_engine_that_never_becomes_healthy_fails_within_the_timeout():
    async def go():
        async with Router([f"http://127.0.0.1:{free_port()}"], health_interval_s=0.1) as router:
            with pytest.raises(NoHealthyEngine, match="never became healthy within 1.0 s"):
                await router.wait_healthy(timeout_s=1.0)

    asyncio.run(go())


def test_standalone_router_serves_one_address(engines):
    import json

    ports, _ = engines
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "miles", "router", "serve", "--port", str(port),
                             *[arg for p in ports for arg in ("--engine", f"http://127.0.0.1:{p}")]],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.1)
        body = json.dumps({"input_ids": [[4, 13, 5, 14]] * 4,
                           "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
                           "return_logprob": True}).encode()
        request = urllib.request.Request(base + "/generate", data=body, headers={"Content-Type": "application/json"})
        answers = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert [len(a["output_ids"]) for a in answers] == [3, 3, 3, 3]
        listing = json.loads(urllib.request.urlopen(base + "/list_engines", timeout=10).read())
        assert sum(e["served"] for e in listing["engines"]) == 4
        bad = urllib.request.Request(base + "/generate", data=b'{"input_ids": [4], "sampling_params": {"n_tokens": 1}}',
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(bad, timeout=10)
        assert err.value.code == 400 and "n_tokens" in json.loads(err.value.read())["error"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# -- an engine killed at every moment ---------------------------------------------------------------


def spawn_gated_engine(model_dir, port, hold=""):
    """A real engine that leaves every request to ``hold`` unanswered (until POST /test_release) and
    prints "held PATH" for each; it prints "ready" once it serves."""
    return _zygote().fork(model_dir, port, hold)


class ForkedEngine:
    """A gated engine forked by the zygote, with the part of ``subprocess.Popen`` the tests use. It is not this
    process's child: its exit is watched through a pidfd, and its status is the kernel's to discard (the zygote
    ignores SIGCHLD), so ``returncode`` is -1 once it has exited."""

    def __init__(self, pid, stdout):
        self.pid, self.stdout, self.returncode = pid, stdout, None
        self._exited = os.pidfd_open(pid)

    def poll(self):
        if self.returncode is None and select.select([self._exited], [], [], 0)[0]:
            self.returncode = -1
            os.close(self._exited)
            self.stdout.close()
        return self.returncode

    def wait(self, timeout=60):
        if self.returncode is None:
            assert select.select([self._exited], [], [], timeout)[0], f"engine {self.pid} still runs"
        return self.poll()

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


class Zygote:
    """This file run with ``--zygote``: it imports the engine once, then forks a gated engine for each line
    ``FIFO MODEL_DIR PORT HOLD`` on its stdin (the engine's stdout is the FIFO) and answers with its pid."""

    def __init__(self, tmp_dir):
        self.tmp_dir, self.count = tmp_dir, 0
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, __file__, "--zygote"], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "zygote ready"

    def fork(self, model_dir, port, hold):
        self.count += 1
        fifo = self.tmp_dir / f"engine-{self.count}.out"
        os.mkfifo(fifo)
        self.proc.stdin.write(f"{fifo} {model_dir} {port} {hold or '-'}\n")
        self.proc.stdin.flush()
        pid = int(self.proc.stdout.readline())
        return ForkedEngine(pid, open(fifo))  # opens once the engine has opened its end

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _zygote_main():
    import miles.engine.local  # noqa: F401  (what makes an engine slow to start: imported once, here)
    import miles.engine.server  # noqa: F401
    import aiohttp.web  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the engines
    print("zygote ready", flush=True)
    for line in sys.stdin:
        fifo, model_dir, port, hold = line.split()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            out = os.open(fifo, os.O_WRONLY)
            os.dup2(out, 1)
            sys.stdout = open(1, "w", closefd=False)
            os.close(0)
            try:
                _serve_gated(model_dir, port, "" if hold == "-" else hold)
            finally:
                os._exit(1)
        print(pid, flush=True)


_ZYGOTE = []


def _zygote():
    return _ZYGOTE[0]


@pytest.fixture(scope="module", autouse=True)
def zygote(tmp_path_factory):
    _ZYGOTE.append(Zygote(tmp_path_factory.mktemp("zygote")))
    yield _ZYGOTE[0]
    _ZYGOTE.pop().close()


def serving(proc):
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _serve_gated(model_dir, port, hold):
    from aiohttp import web

    from miles.engine.local import LocalEngine
    from miles.engine.server import build_app

    async def main():
        released = asyncio.Event()

        @web.middleware
        async def gate(request, handler):
            if request.path == hold and not released.is_set():
                print("held", request.path, flush=True)
                await released.wait()
            return await handler(request)

        async def release(request):
            released.set()
            return web.json_response({"success": True})

        engine = LocalEngine(background=True)
        engine.load_model(model_dir)
        app = build_app(engine)
        app.middlewares.append(gate)
        app.router.add_post("/test_release", release)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", int(port)).start()
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    from miles.train.torch_backend import TorchBackend

    backend = TorchBackend()
    backend.setup(str(tiny_model_dir), seed=0)
    return backend


class Rig:
    """Engine 0 (the victim, gated at ``hold`` if given) and engine 1 behind a router on a rollout
    plane; a real backend's weights reach them through a weight transport (tensor unless given), which
    also catches up an engine that comes back."""

    def __init__(self, model_dir, backend, hold="", transport=None):
        from miles.rollout.plane import RolloutPlane
        from miles.weights.transports import TensorTransport

        self.model_dir, self.backend = model_dir, backend
        self.ports = [free_port(), free_port()]
        spawned = [spawn_gated_engine(model_dir, self.ports[0], hold), spawn_gated_engine(model_dir, self.ports[1])]
        self.procs = [serving(p) for p in spawned]  # both start at once
        self.router = Router([f"http://127.0.0.1:{p}" for p in self.ports], health_interval_s=0.2)
        self.plane = RolloutPlane(router=self.router)
        self.transport = transport or TensorTransport()
        self.router.on_readmit = lambda engine: self.transport.catch_up(self.plane, engine)
        self.version = 0
        self.background = concurrent.futures.ThreadPoolExecutor(1)

    def push(self):
        self.version += 1
        self.transport.push(self.backend, self.plane, self.version)

    def soon(self, fn, *args):
        """Run ``fn`` in a thread: the test holds a moment open meanwhile."""
        return self.background.submit(fn, *args)

    def held(self, path):
        assert self.procs[0].stdout.readline().split() == ["held", path]

    def kill(self, i=0):
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    def restart(self, hold=""):
        self.procs[0] = serving(spawn_gated_engine(self.model_dir, self.ports[0], hold))

    def wait_until(self, condition):
        for _ in range(2400):
            if condition():
                return
            time.sleep(0.05)
        pytest.fail(f"never happened; router stats {self.router.stats}, engines {self.router.engines}")

    def generate(self, count=8):
        async def burst():
            params = {"max_new_tokens": 3, "ignore_eos": True}
            return await asyncio.gather(*(self.router.generate([4, 13, 5, 14], params) for _ in range(count)))

        return self.plane.run(burst())

    def back_and_caught_up(self):
        """Engine 0 returns; it serves again only once it holds the last pushed weights."""
        victim = self.router.engines[0]
        self.wait_until(lambda: not victim.quarantined)
        served = victim.served
        answers = self.generate()
        assert {a["meta_info"]["weight_version"] for a in answers} == {self.version}
        assert victim.served > served and victim.weight_version == self.version

    def close(self):
        self.background.shutdown()
        self.plane.close()
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def rig(tiny_model_dir, backend):
    rigs = []

    def make(hold="", transport=None):
        rigs.append(Rig(tiny_model_dir, backend, hold, transport))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def test_engine_killed_during_generate(rig):
    r = rig("/generate")
    r.plane.run(r.router.wait_healthy())
    r.push()
    answers = r.soon(r.generate)
    r.held("/generate")
    r.kill()
    assert {a["meta_info"]["weight_version"] for a in answers.result()} == {1}  # every request answered, by engine 1
    assert r.router.engines[0].quarantined and r.router.stats["retries"] >= 1
    r.restart()
    r.back_and_caught_up()
    assert r.router.stats["engine_failures"] == 1 and r.router.stats["readmissions"] == 1


@pytest.mark.parametrize("name", ["tensor", "disk", "distributed", "shm"])
def test_engine_killed_during_a_weight_push(rig, tmp_path, name):
    from miles.weights.transports import DiskTransport, DistributedTransport, SharedMemoryTransport, TensorTransport

    transport = {"tensor": TensorTransport, "disk": lambda: DiskTransport(dir=str(tmp_path / "w")),
                 "distributed": lambda: DistributedTransport(timeout_s=60), "shm": SharedMemoryTransport}[name]()
    path = {"tensor": "/update_weights_from_tensor", "disk": "/update_weights_from_disk",
            "distributed": "/update_weights_from_distributed", "shm": "/update_weights_from_shm"}[name]
    r = rig(path, transport)
    r.plane.run(r.router.wait_healthy())
    pushed = r.soon(r.push)
    r.held(path)
    r.kill()
    pushed.result()  # the push went on with engine 1
    assert r.router.engines[0].quarantined and r.router.engines[1].weight_version == 1
    assert {a["meta_info"]["weight_version"] for a in r.generate()} == {1}
    r.restart()
    r.back_and_caught_up()
    r.push()  # both again (a distributed transport forms a new group with the restarted engine)
    assert [e.weight_version for e in r.router.engines] == [2, 2]
    assert r.router.stats["engine_failures"] == 1


def test_engine_killed_during_its_catch_up_stays_out_and_is_caught_up_later(rig):
    r = rig()
    r.plane.run(r.router.wait_healthy())
    r.push()
    r.kill()
    r.push()  # engine 0 fails this push: quarantined
    assert r.router.engines[0].quarantined and r.router.stats["engine_failures"] == 1
    r.restart(hold="/update_weights_from_tensor")
    r.held("/update_weights_from_tensor")  # its catch-up is in flight
    r.kill()
    r.wait_until(lambda: r.router.stats["engine_failures"] == 2)  # a second death, counted once
    assert r.router.engines[0].quarantined
    r.restart()
    r.back_and_caught_up()
    assert r.router.stats["engine_failures"] == 2 and r.router.stats["readmissions"] == 1


def test_a_push_that_lands_during_a_catch_up_reaches_the_engine(rig):
    r = rig()
    r.plane.run(r.router.wait_healthy())
    r.push()
    r.kill()
    r.push()
    r.restart(hold="/update_weights_from_tensor")
    r.held("/update_weights_from_tensor")  # catching up to version 2
    r.push()  # version 3 reaches engine 1 only: engine 0 is not in service yet
    assert r.router.engines[0].quarantined and r.router.engines[1].weight_version == 3
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{r.ports[0]}/test_release", data=b""), timeout=10)
    r.back_and_caught_up()  # version 3, not the 2 its catch-up started with
    assert r.router.stats["engine_failures"] == 1


def test_engine_killed_during_an_abort(rig):
    r = rig("/abort_request")
    r.plane.run(r.router.wait_healthy())
    r.push()
    aborted = r.soon(r.plane.run, r.router.abort())
    r.held("/abort_request")
    r.kill()
    assert aborted.result() == 0  # engine 1 answered; nothing was in flight
    assert r.router.engines[0].quarantined
    r.restart()
    r.back_and_caught_up()
    assert r.router.stats["engine_failures"] == 1


def test_engine_killed_during_a_pause_comes_back_paused(rig):
    r = rig("/pause_generation")
    r.plane.run(r.router.wait_healthy())
    r.push()
    paused = r.soon(r.plane.run, r.router.pause())
    r.held("/pause_generation")
    r.kill()
    paused.result()
    assert r.router.engines[0].quarantined
    r.restart()
    victim = r.router.engines[0]
    r.wait_until(lambda: not victim.quarantined)

    async def probe():
        """A request on the paused engine stays in flight with nothing generated until aborted."""
        request = asyncio.ensure_future(r.router.post(victim, "/generate", {
            "input_ids": [4, 13], "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}))
        while (await r.router.post(victim, "/abort_request", {"abort_all": True}))["aborted"] == 0:
            await asyncio.sleep(0.01)
        return await request

    answer = r.plane.run(probe())
    assert answer["meta_info"]["finish_reason"]["type"] == "abort" and answer["output_ids"] == []
    r.plane.run(r.router.resume())
    r.back_and_caught_up()
    assert r.router.stats["engine_failures"] == 1


def test_engine_killed_at_a_health_check(rig):
    r = rig("/health")  # its first health check is held (no request goes to it meanwhile)
    r.held("/health")
    r.kill()
    r.wait_until(lambda: r.router.engines[0].quarantined)  # after max_failures failed checks
    r.push()
    assert r.router.engines[1].weight_version == 1
    assert {a["meta_info"]["weight_version"] for a in r.generate()} == {1}
    r.restart()
    r.back_and_caught_up()
    assert r.router.stats["engine_failures"] == 1


def test_no_engine_left_fails_at_once_naming_the_engines(engines):
    ports, procs = engines

    def resolver(proc, url):
        async def resolve():
            if proc.poll() is not None:
                raise EngineGone("its process exited")
            return url

        return resolve

    async def go():
        router = Router([f"http://127.0.0.1:{p}" for p in ports], health_interval_s=0.2)
        for endpoint, proc in zip(router.engines, procs):
            endpoint.resolve = resolver(proc, endpoint.url)
        async with router:
            await router.wait_healthy()
            for proc in procs:
                proc.kill()
                proc.wait()
            with pytest.raises(NoHealthyEngine) as err:
                await router.generate([4, 13], {"max_new_tokens": 2})
            with pytest.raises(NoHealthyEngine, match="no engine left"):
                await router.post_all("/flush_cache", {})
            return str(err.value), dict(router.stats)

    message, stats = asyncio.run(go())
    assert message.startswith("no engine left: all 2 failed and none can come back")
    for port in ports:
        assert f"(http://127.0.0.1:{port}) cannot restart, last error: " in message
    assert stats["engine_failures"] == 2


if __name__ == "__main__":
    _zygote_main()
