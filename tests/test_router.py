"""The router in front of real engine processes on 127.0.0.1.

An engine is SIGKILLed at each moment where it can fail (a request, a weight push, its catch-up, an
abort, a pause, a health check). The moment is held deterministically: a gated engine (this file run
as a script) leaves requests to one path unanswered and says so on stdout, and the test kills it then.

The gated engines are forked from one process of this file that has already imported the engine (a zygote),
so that the thirty engine processes these tests start and kill each start in a fraction of a second instead
of importing torch and transformers anew: each is still a process of its own, serving the real engine.
"""

import asyncio
import random
import concurrent.futures
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request

import pytest

from miles.engine.router import EngineGone, NoHealthyEngine, Router
from miles.errors import EngineRequestError
from miles.testing import free_port


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
MIB = 1 << 20


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
            except BaseException:
                traceback.print_exc(file=sys.stdout)  # what `serving` shows when the engine does not start
                sys.stdout.flush()
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
    first = proc.stdout.readline()
    assert first.strip() == "ready", f"the engine did not start: {first}{proc.stdout.read()}"
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

    def __init__(self, model_dir, backend, hold="", transport=None, health_interval_s=0.2):
        from miles.rollout.plane import RolloutPlane
        from miles.weights.transports import TensorTransport

        self.model_dir, self.backend = model_dir, backend
        self.ports = [free_port(), free_port()]
        spawned = [spawn_gated_engine(model_dir, self.ports[0], hold), spawn_gated_engine(model_dir, self.ports[1])]
        self.procs = [serving(p) for p in spawned]  # both start at once
        self.router = Router([f"http://127.0.0.1:{p}" for p in self.ports], health_interval_s=health_interval_s)
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

    def make(hold="", transport=None, health_interval_s=0.2):
        rigs.append(Rig(tiny_model_dir, backend, hold, transport, health_interval_s))
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


def test_an_engine_that_joins_a_running_fleet_serves_only_once_caught_up(rig, tiny_model_dir):
    """Router.add_engine (an elastic fleet): the new engine is held in its catch-up while requests are served by
    the others at the fleet's version; released, it serves at that version."""
    r = rig()
    r.plane.run(r.router.wait_healthy())
    r.push()
    r.push()
    port = free_port()
    r.procs.append(serving(spawn_gated_engine(tiny_model_dir, port, "/update_weights_from_tensor")))
    joined = r.plane.run(_add(r.router, f"http://127.0.0.1:{port}"))
    assert joined.quarantined
    r.procs[-1].stdout.readline()  # held in its catch-up
    assert {a["meta_info"]["weight_version"] for a in r.generate(16)} == {2} and joined.served == 0
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/test_release", data=b""), timeout=10)
    r.wait_until(lambda: not joined.quarantined)
    assert joined.weight_version == 2
    assert {a["meta_info"]["weight_version"] for a in r.generate(16)} == {2} and joined.served > 0
    r.push()
    assert [e.weight_version for e in r.router.engines] == [3, 3, 3]


@pytest.mark.parametrize("end", ["its catch-up ends", "its process is killed"])
def test_an_engine_removed_during_its_catch_up_never_serves_and_is_no_failure(rig, tiny_model_dir, end):
    """An elastic fleet can ask an engine that is still joining to leave (a join and a leave two steps apart, while
    the engine catches up): it is removed at once, and neither the end of its catch-up (it was re-admitted: it
    served after it left) nor its process killed by the fleet mid catch-up (counted in engine_failures) changes
    that."""
    r = rig()
    r.plane.run(r.router.wait_healthy())
    r.push()
    port = free_port()
    r.procs.append(serving(spawn_gated_engine(tiny_model_dir, port, "/update_weights_from_tensor")))
    joining = r.plane.run(_add(r.router, f"http://127.0.0.1:{port}"))
    r.procs[-1].stdout.readline()  # held in its catch-up
    r.plane.run(r.router.remove_engine(joining))  # it holds no request: it is out at once
    if end == "its catch-up ends":
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/test_release", data=b""),
                               timeout=10)
    else:
        r.procs[-1].kill()
        r.procs[-1].wait()
    r.wait_until(lambda: not joining.lock.locked())  # the health check that ran the catch-up is over
    assert joining.weight_version == (1 if end == "its catch-up ends" else 0)
    assert joining.gone and joining.quarantined and r.router.healthy == r.router.engines[:2]
    assert {a["meta_info"]["weight_version"] for a in r.generate(16)} == {1} and joining.served == 0
    r.push()
    assert [e.weight_version for e in r.router.engines[:2]] == [2, 2] and joining.weight_version <= 1
    assert r.router.stats["engine_failures"] == 0 and r.router.stats["readmissions"] == 0


def test_an_engine_that_leaves_gets_no_new_request_and_finishes_its_own(rig):
    """Router.remove_engine: engine 0 holds its share of a burst when it is removed; new requests go to engine 1
    only; its own finish there once released; it is never used again (without draining, its requests are aborted:
    tests/test_simulate.py, where they are running inside the engine, not held in front of it)."""
    drain = True
    r = rig("/generate")
    r.plane.run(r.router.wait_healthy())
    r.push()
    leaving, staying = r.router.engines
    burst = r.soon(r.generate, 8)
    r.held("/generate")
    removed = r.plane.submit(r.router.remove_engine(leaving, drain=drain))
    later = r.generate(8)
    assert {a["meta_info"]["weight_version"] for a in later} == {1} and staying.served >= 8
    if drain:
        assert not removed.done() and leaving.outstanding > 0
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{r.ports[0]}/test_release", data=b""),
                               timeout=10)
    answers = burst.result()
    removed.result(timeout=60)
    finishes = [a["meta_info"]["finish_reason"]["type"] for a in answers]
    assert len(answers) == 8 and ("abort" in finishes) != drain
    assert leaving.outstanding == 0 and leaving.gone and r.router.healthy == [staying]
    served = leaving.served
    r.generate(8)
    r.push()
    assert leaving.served == served and staying.weight_version == 2


async def _add(router, url):
    return router.add_engine(url)


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


@pytest.mark.parametrize("seed", range(4))
def test_an_engine_restarted_in_place_never_answers_with_old_weights(rig, seed):
    """Engine 0 killed and started again at the same address, before or after the router noticed it down (the
    health checks are driven by the test: none runs unless it says so). Requests sent meanwhile are answered only
    with the last pushed weights: the answers of the new process, which holds none of them, are dropped and the
    requests served by engine 1; its next health check catches it up. One failure each time."""
    rng = random.Random(seed)
    r = rig(health_interval_s=3600)  # one health check at start, then only those the test runs
    victim = r.router.engines[0]
    r.plane.run(r.router.wait_healthy())
    for trial in range(3):
        r.push()
        assert {a["meta_info"]["weight_version"] for a in r.generate()} == {r.version}
        r.kill()
        noticed = rng.random() < 0.5
        if noticed:  # its health checks fail before it is back
            for _ in range(r.router.max_failures):
                r.plane.run(r.router.check(victim))
            assert victim.quarantined
        r.restart()
        for _ in range(rng.randrange(1, 4)):  # requests while it is back: none answered with old weights
            assert {a["meta_info"]["weight_version"] for a in r.generate()} == {r.version}
        assert victim.quarantined
        assert r.plane.run(r.router.check(victim))  # its next health check: caught up, in service again
        r.back_and_caught_up()
        assert r.router.stats["engine_failures"] == trial + 1


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


# -- the standalone router over HTTP ----------------------------------------------------------------


def http(base, path, body=None, *, data=None, headers=None, timeout=60):
    """(status, parsed JSON answer) of a POST of ``body`` as JSON (``data`` as it is), or a GET without either."""
    import json

    if body is not None:
        data = json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def router_serve(tmp_path):
    """Start ``miles router serve`` in front of engine ports with more flags; returns its base URL. Its log is
    checked for tracebacks when the test ends."""
    started = []

    def start(ports, *args):
        port, log = free_port(), tmp_path / f"router-{len(started)}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "miles", "router", "serve", "--port", str(port), *args,
                                     *[arg for p in ports for arg in ("--engine", f"http://127.0.0.1:{p}")]],
                                    env=env, stdout=out, stderr=subprocess.STDOUT)
        started.append((proc, log))
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            assert proc.poll() is None, log.read_text()
            try:
                http(base, "/health", timeout=5)  # 200, or 503 while no engine is in service
                return base
            except OSError:
                time.sleep(0.05)
        pytest.fail(f"the router never answered: {log.read_text()}")

    yield start
    for proc, log in started:
        proc.terminate()
        try:
            proc.wait(timeout=90)  # a request still in flight is given up to 60 s to end
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert "Traceback" not in log.read_text(), log.read_text()


def finished(port):
    return http(f"http://127.0.0.1:{port}", "/server_info")[1]["internal_states"][0]["requests_finished"]


GOOD = {"input_ids": [4, 13, 5, 14], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}


def test_the_standalone_router_refuses_what_the_engine_refuses(engines, router_serve):
    import json

    ports, _ = engines
    base = router_serve(ports, "--admin-token", "s3cret", "--max-request-mib", "1", "--allowed-host", "router.internal")
    port = base.rsplit(":", 1)[1]
    body = json.dumps(GOOD).encode()
    before = [finished(p) for p in ports]
    evil = {"Origin": "http://evil.example"}
    status, error = http(base, "/generate", data=body, headers={**evil, "Content-Type": "text/plain"})
    assert status == 403 and "Origin 'http://evil.example'" in error["error"] and "router" in error["error"]
    assert http(base, "/health", headers=evil)[0] == 403
    status, error = http(base, "/generate", data=body, headers={"Content-Type": "text/plain"})  # a form's post
    assert status == 415 and "expected application/json for /generate, got text/plain" in error["error"]
    status, error = http(base, "/generate", data=body, headers={"Host": f"evil.example:{port}"})  # DNS rebinding
    assert status == 421 and f"Host 'evil.example:{port}'" in error["error"] and "--allowed-host" in error["error"]
    assert http(base, "/health", headers={"Host": "router.internal"})[0] == 200
    status, error = http(base, "/generate", data=b" " * (MIB + 1))
    assert status == 413 and "(1 MiB) for /generate" in error["error"] and "--max-request-mib" in error["error"]
    status, error = http(base, "/generate", data=(b" " * (64 << 10) for _ in range(17)),
                         headers={"Transfer-Encoding": "chunked"})
    assert status == 413 and "--max-request-mib" in error["error"]
    for raw, why in ((b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
                     (b'{"input_ids": ' + b"[" * 65 + b"4" + b"]" * 65 + b"}", "more than 64 levels"),
                     (b'{"input_ids": [4', "body is not valid JSON"),
                     (b"\xff\xfe", "body is not valid JSON"),
                     (b"[4, 13]", "body must be a JSON object"),
                     (b'{"input_ids": []}', "input_ids: expected a non-empty list")):
        status, error = http(base, "/generate", data=raw)
        assert status == 400 and why in error["error"], (raw[:40], error)
    for path in ("/flush_cache", "/abort_request"):
        status, error = http(base, path, {})
        assert status == 401 and "Authorization: Bearer" in error["error"]
    assert [finished(p) for p in ports] == before  # none of it reached an engine
    token = {"Authorization": "Bearer s3cret"}
    status, flushed = http(base, "/flush_cache", {}, headers=token)
    assert status == 200 and flushed["engines"] == 2 and all(a["success"] for a in flushed["answers"])
    status, answer = http(base, "/generate", GOOD)  # generation needs no token
    assert status == 200 and len(answer["output_ids"]) == 2
    status, refused = http(base, "/generate", {**GOOD, "sampling_params": {"n_tokens": 1}})
    assert status == 400 and "n_tokens" in refused["error"]  # the engine's refusal, passed on


def test_with_every_engine_dead_a_request_is_answered_503_naming_each_engine(router_serve):
    ports = [free_port(), free_port()]  # nothing listens there
    base = router_serve(ports, "--no-engine-wait-s", "0")
    status, error = http(base, "/generate", GOOD)
    assert status == 503 and error["error"].startswith("no engine can serve the request: every engine has failed")
    assert "--no-engine-wait-s" in error["error"]
    for i, port in enumerate(ports):
        assert f"engine {i} (http://127.0.0.1:{port}), last error: ClientConnectorError" in error["error"], error
    status, error = http(base, "/generate", {**GOOD, "input_ids": [[4, 13], [5, 14]]})  # a batch as well
    assert status == 503 and "no engine can serve the request" in error["error"]
    status, health = http(base, "/health")
    assert status == 503 and f"(http://127.0.0.1:{ports[1]}), last error: " in health["error"]
    status, error = http(base, "/flush_cache", {})
    assert status == 503 and error["error"].startswith("no engine in service took /flush_cache")


def _restart(tiny_model_dir, procs, ports, i, base):
    """Engine ``i`` (killed) back on its port once the router has seen it down, and in the router's service again."""

    def wait_until(condition, what):
        for _ in range(1200):
            if condition(listing := http(base, "/list_engines")[1]["engines"][i]):
                return
            time.sleep(0.05)
        pytest.fail(f"engine {i} never {what}: {listing}")

    procs[i].wait()
    wait_until(lambda engine: engine["down"], "was seen down")
    procs[i] = serving(spawn_gated_engine(tiny_model_dir, ports[i]))
    wait_until(lambda engine: not engine["quarantined"], "came back into service")


def test_the_only_engine_killed_mid_request_at_a_random_moment_the_client_gets_an_answer(tiny_model_dir,
                                                                                         router_serve):
    """The first round kills the engine while it holds the request (surely mid-request); the others at a random
    moment around the request's life. Whatever the moment, the client is answered: the whole answer, or 503
    naming the engine and what broke; and the router serves again once the engine is back."""
    import random

    ports = [free_port()]
    procs = [serving(spawn_gated_engine(tiny_model_dir, ports[0], "/generate"))]
    base = router_serve(ports, "--no-engine-wait-s", "0", "--health-interval-s", "0.05", "--max-failures", "1")
    rng, pool = random.Random(42), concurrent.futures.ThreadPoolExecutor(1)
    long = {"input_ids": [4, 13, 5, 14], "sampling_params": {"max_new_tokens": 120, "ignore_eos": True}}
    answers = []
    try:
        for round_ in range(6):
            answer = pool.submit(http, base, "/generate", long)
            if round_ == 0:
                assert procs[0].stdout.readline().split() == ["held", "/generate"]
            else:
                time.sleep(rng.uniform(0, 0.4))
            procs[0].kill()
            procs[0].wait()
            status, out = answer.result(timeout=120)
            answers.append(status)
            if status == 200:
                assert len(out["output_ids"]) == 120
            else:
                assert status == 503, out
                assert f"engine 0 (http://127.0.0.1:{ports[0]}), last error: " in out["error"], out
            _restart(tiny_model_dir, procs, ports, 0, base)
            status, out = http(base, "/generate", GOOD)
            assert status == 200 and len(out["output_ids"]) == 2
    finally:
        pool.shutdown(wait=False)  # a request still waiting ends with the router
        procs[0].kill()
        procs[0].wait()
    assert answers[0] == 503


def test_one_of_two_engines_killed_mid_request_at_a_random_moment_every_request_is_answered(engines, tiny_model_dir,
                                                                                           router_serve):
    import random

    ports, procs = engines
    base = router_serve(ports, "--health-interval-s", "0.05")
    rng, pool = random.Random(7), concurrent.futures.ThreadPoolExecutor(1)
    batch = {"input_ids": [[4, 13, 5, 14]] * 8, "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    try:
        for _ in range(4):
            answer = pool.submit(http, base, "/generate", batch)
            time.sleep(rng.uniform(0, 0.3))
            victim = rng.randrange(2)
            procs[victim].kill()
            procs[victim].wait()
            status, out = answer.result(timeout=120)
            assert status == 200 and [len(a["output_ids"]) for a in out] == [60] * 8, out
            _restart(tiny_model_dir, procs, ports, victim, base)
    finally:
        pool.shutdown(wait=False)  # a request still waiting ends with the router


def test_a_request_waits_for_an_engine_that_answers_again_within_the_wait(tiny_model_dir, router_serve):
    ports = [free_port()]
    procs = [serving(spawn_gated_engine(tiny_model_dir, ports[0]))]
    base = router_serve(ports, "--no-engine-wait-s", "600", "--health-interval-s", "0.05", "--max-failures", "1")
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        procs[0].kill()
        procs[0].wait()
        answer = pool.submit(http, base, "/generate", GOOD, timeout=600)
        for _ in range(1200):
            if http(base, "/list_engines")[1]["waiting_for_engine"] == 1:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the request never waited for an engine")
        procs[0] = serving(spawn_gated_engine(tiny_model_dir, ports[0]))
        status, out = answer.result(timeout=120)
        assert status == 200 and len(out["output_ids"]) == 2
    finally:
        pool.shutdown(wait=False)  # a request still waiting ends with the router
        procs[0].kill()
        procs[0].wait()


def test_a_request_no_engine_answers_in_time_is_answered_503_at_its_timeout(tiny_model_dir, router_serve):
    ports = [free_port()]
    procs = [serving(spawn_gated_engine(tiny_model_dir, ports[0], "/generate"))]  # never answers /generate
    try:
        base = router_serve(ports, "--request-timeout-s", "1")
        status, error = http(base, "/generate", GOOD)
        assert status == 503 and error["error"].startswith(
            "request timed out after 1 s (--request-timeout-s) in 1 attempt(s); last error: TimeoutError: "), error
    finally:
        procs[0].kill()
        procs[0].wait()


@pytest.mark.parametrize("args, expected", [
    (["--engine", "127.0.0.1:30000"], "argument --engine: expected an engine's URL such as http://127.0.0.1:30000"),
    (["--request-timeout-s", "0"], "argument --request-timeout-s: expected a number above 0, got '0'"),
    (["--no-engine-wait-s", "-1"], "argument --no-engine-wait-s: expected a number at least 0"),
    (["--health-interval-s", "nan"], "argument --health-interval-s: expected a number above 0"),
    (["--max-failures", "0"], "argument --max-failures: expected an integer at least 1"),
    (["--port", "70000"], "argument --port: expected an integer at least 1 and at most 65535"),
    (["--max-request-mib", "0"], "argument --max-request-mib: expected a number above 0"),
    (["--host", "0.0.0.0"], "--host 0.0.0.0: serving beyond loopback needs an admin token"),
])
def test_router_serve_refuses_bad_flags_with_exit_2(miles_cli, args, expected):
    result = miles_cli("router", "serve", "--engine", "http://127.0.0.1:30000", *args, env={"MILES_ADMIN_TOKEN": ""})
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_router_serve_on_a_taken_port_exits_2_naming_it(miles_cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = miles_cli("router", "serve", "--engine", "http://127.0.0.1:30000", "--port", str(port))
    assert result.returncode == 2 and f"--port {port}: cannot listen there" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


if __name__ == "__main__":
    _zygote_main()
