"""The router in front of real engine processes on 127.0.0.1."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from miles.rollout.router import EngineRequestError, NoHealthyEngine, Router


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model_dir, port):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "miles", "engine", "serve", "--model", str(model_dir), "--port", str(port)],
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
    procs = [start_engine(tiny_model_dir, p) for p in ports]
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
        body = json.dumps({"input_ids": [[4, 13, 5, 14]] * 4, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
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
