"""Delta weight pushes (``rollout.weight_sync: {name: shm, delta: true}``) against real engine servers on 127.0.0.1:
engines served by a thread of this process (so that a test can read and corrupt their weights) and ``miles engine
serve`` processes (so that a test can kill and restart them).

A delta push must leave an engine with bit for bit the weights a full push gives, or its old weights, never a
mix; an engine that cannot take the delta (it missed a push, restarted, holds other bytes) gets the whole
weights, counted in ``full_catch_ups``. Pushes are interrupted at moments a seeded RNG picks, held there by gates.
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

import miles.weights.delta_transports as delta_transports
from miles.engine import LocalEngine
from miles.engine.router import Router
from miles.errors import ConfigError, EngineRequestError
from miles.run.runner import prepare
from miles.rollout.plane import RolloutPlane
from miles.testing import free_port, serve_in_thread
from miles.weights.delta import block_checksums, encode_blocks, set_checksum, weights_checksum
from miles.weights.delta_transports import (
    DeltaSharedMemoryTransport, DeltaTensorTransport, auto_transport, shm_transport, tensor_transport,
)
from miles.weights.shm import SHM_DTYPES
from miles.weights.transports import SharedMemoryTransport, TensorTransport

SHM = "/update_weights_from_shm"
KIB = 1024
DELTA = {"shm": DeltaSharedMemoryTransport, "tensor": DeltaTensorTransport}  # by transport: with delta: true
FULL = {"shm": SharedMemoryTransport, "tensor": TensorTransport}


def call(base, path, body=None):
    """(status, JSON answer)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class Weights:
    """A backend that exports fixed weights."""

    def __init__(self, weights):
        self.weights = weights

    def export_weights(self):
        return self.weights


def next_weights(weights, rng):
    """The weights after a step that changes some of them, as training does: whole tensors, a few rows of the
    embedding, one element of the last block of a tensor, or nothing at all."""
    new = {name: t.clone() for name, t in weights.items()}
    names = sorted(new)
    for name in rng.sample(names, rng.randint(0, 3)):  # whole tensors
        new[name] += torch.randn(new[name].shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))
                                 ).to(new[name].dtype) * 1e-2
    embedding = new["model.embed_tokens.weight"]
    for row in rng.sample(range(embedding.shape[0]), rng.randint(0, 2)):
        embedding[row] *= 1.5
    name = rng.choice(names)
    new[name].view(-1)[-1] += 1.0
    return tie(new)


def tie(weights):
    """The LM head is the embedding (the tiny models tie them), as a trainer's export has it."""
    if "lm_head.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


@contextlib.contextmanager
def engines_in_threads(model_dir, count, dtype="float32"):
    """``count`` engines, each served over HTTP by a thread of this process; yields (engines, urls)."""
    engines = []
    with contextlib.ExitStack() as stack:
        for _ in range(count):
            engine = LocalEngine(background=True, dtype=dtype)
            engine.load_model(str(model_dir))
            stack.callback(engine.close)
            engines.append(engine)
        urls = [stack.enter_context(serve_in_thread(engine)) for engine in engines]
        yield engines, urls


def fleet(urls, transport):
    """A rollout plane over ``urls`` whose router catches a returning engine up with ``transport``."""
    plane = RolloutPlane(router=Router(urls, health_interval_s=3600,
                                       on_readmit=lambda engine: transport.catch_up(plane, engine)))
    return plane


def assert_holds(engine, weights):
    """Bit for bit: every tensor of the engine is ``weights``'s."""
    held = engine.model.state_dict()
    assert set(held) == set(weights)
    different = [name for name, t in weights.items() if not torch.equal(held[name], t.to(held[name].dtype))]
    assert different == []


def first_weights(engine, dtype=torch.float32, seed=0):
    """Weights unlike the model's own, to push first."""
    rng = torch.Generator().manual_seed(seed)
    return tie({name: (t.float() + torch.randn(t.shape, generator=rng) * 1e-2).to(dtype).contiguous()
                for name, t in engine.model.state_dict().items()})


# -- the checksums --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(SHM_DTYPES))
@pytest.mark.parametrize("numel", [0, 1, 3, 257, 1031])
def test_a_block_checksum_sees_every_byte_and_not_the_address(dtype, numel):
    rng = random.Random(f"{dtype}-{numel}")
    tensor = (torch.arange(numel) * 7 % 11).to(SHM_DTYPES[dtype])
    block_bytes = 64
    sums = block_checksums(tensor, block_bytes)
    assert sums.numel() == max(1, -(-numel * tensor.element_size() // block_bytes))
    unaligned = torch.empty(numel + 1, dtype=tensor.dtype)[1:]  # one element on: not 4-byte aligned
    unaligned.copy_(tensor)
    assert torch.equal(block_checksums(unaligned, block_bytes), sums)
    for _ in range(8 if numel else 0):
        changed = tensor.clone()
        raw = changed.view(-1).view(torch.uint8)
        position = rng.randrange(raw.numel())
        raw[position] ^= 1 << rng.randrange(8)
        after = block_checksums(changed, block_bytes)
        differs = (after != sums).nonzero().flatten().tolist()
        assert differs == [position // block_bytes]


def test_a_set_checksum_sees_names_and_the_order_of_blocks():
    a, b = torch.randn(64), torch.randn(64)
    base = set_checksum({"a": block_checksums(a, 64), "b": block_checksums(b, 64)})
    assert set_checksum({"b": block_checksums(b, 64), "a": block_checksums(a, 64)}) == base  # any order of names
    assert set_checksum({"a": block_checksums(b, 64), "b": block_checksums(a, 64)}) != base  # swapped contents
    swapped = torch.cat([a[32:], a[:32]])  # two blocks of 128 bytes in the other order
    assert set_checksum({"a": block_checksums(swapped, 128), "b": block_checksums(b, 128)}) != set_checksum(
        {"a": block_checksums(a, 128), "b": block_checksums(b, 128)})


# -- delta pushes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(DELTA))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_kib", [1, 16, 1024])
def test_delta_pushes_give_the_engine_bit_for_bit_what_full_pushes_give(tiny_model_dir, kind, dtype, block_kib):
    """One engine takes delta pushes, another full pushes of the same weights, step after step."""
    rng = random.Random(block_kib)
    delta, full = DELTA[kind](block_kib, 1.0), FULL[kind]()
    with engines_in_threads(tiny_model_dir, 2, dtype) as ((engine, reference), (url, reference_url)):
        plane, reference_plane = fleet([url], delta), fleet([reference_url], full)
        try:
            weights = first_weights(engine, getattr(torch, dtype))
            for version in range(1, 7):
                delta.push(Weights(weights), plane, version)
                full.push(Weights(weights), reference_plane, version)
                assert engine.weight_version == reference.weight_version == version
                assert_holds(engine, weights)
                assert_holds(reference, weights)
                status, answer = call(url, f"/weights_checksum?block_bytes={block_kib * KIB}")
                assert status == 200 and answer == {"weight_version": version, "block_bytes": block_kib * KIB,
                                                    "checksum": weights_checksum(weights, block_kib * KIB)}
                weights = next_weights(weights, rng)
            assert delta.stats["full_posts"] == 1 and delta.stats["delta_posts"] == 5
            assert delta.stats["full_catch_ups"] == 0
            assert 0 < delta.stats["changed_bytes"] < delta.stats["total_bytes"]
        finally:
            delta.close(), getattr(full, "close", lambda: None)(), plane.close(), reference_plane.close()


@pytest.mark.parametrize("kind", sorted(DELTA))
def test_a_push_that_changes_more_than_full_above_of_the_bytes_goes_whole(tiny_model_dir, kind):
    """Above ``full_above`` a delta would cost more than it saves (the engine reads all its weights to check
    them): every engine gets the whole weights, counted in ``full_posts``, and the next small change is a delta."""
    transport = DELTA[kind](1, 0.5)
    with engines_in_threads(tiny_model_dir, 1) as ([engine], [url]):
        plane = fleet([url], transport)
        try:
            weights = first_weights(engine)
            transport.push(Weights(weights), plane, 1)
            weights = tie({name: t + 1 for name, t in weights.items()})  # every byte
            transport.push(Weights(weights), plane, 2)
            assert transport.stats["full_posts"] == 2 and transport.stats["delta_posts"] == 0
            assert_holds(engine, weights)
            weights = dict(weights, **{"model.norm.weight": weights["model.norm.weight"] * 2})
            transport.push(Weights(weights), plane, 3)
            assert transport.stats["delta_posts"] == 1 and transport.stats["full_catch_ups"] == 0
            assert_holds(engine, weights)
        finally:
            transport.close(), plane.close()


@pytest.mark.parametrize("kind", sorted(DELTA))
def test_weights_of_another_dtype_than_the_engines_go_whole_every_time(tiny_model_dir, kind):
    """float32 weights into a bfloat16 engine: its bytes are never the delta's base, so each push is full (cast)."""
    transport = DELTA[kind](1, 1.0)
    with engines_in_threads(tiny_model_dir, 1, "bfloat16") as ([engine], [url]):
        plane = fleet([url], transport)
        try:
            weights = first_weights(engine)
            for version in range(1, 4):
                transport.push(Weights(weights), plane, version)
                assert_holds(engine, weights)
                weights = next_weights(weights, random.Random(version))
            assert transport.stats["delta_posts"] == 0 and transport.stats["full_catch_ups"] == 2
        finally:
            transport.close(), plane.close()


def quarantine(plane, endpoint):
    async def out():
        await plane.router.wait_healthy()  # the health check's own first look is over
        endpoint.quarantined = True

    plane.run(out())


@pytest.mark.parametrize("kind", sorted(DELTA))
@pytest.mark.parametrize("router_knows", [True, False])
def test_an_engine_that_missed_a_push_gets_the_whole_weights(tiny_model_dir, router_knows, kind):
    """The engine is out of service during push 2. The router either knows it holds version 1 (no delta is
    posted to it), or believes it holds 2 (the engine refuses the delta: 409, full_push_needed)."""
    transport = DELTA[kind](1, 1.0)
    rng = random.Random(7)
    with engines_in_threads(tiny_model_dir, 2) as ((engine, other), urls):
        plane = fleet(urls, transport)
        try:
            weights = [first_weights(engine)]
            for _ in range(2):
                weights.append(next_weights(weights[-1], rng))
            transport.push(Weights(weights[0]), plane, 1)
            endpoint = plane.router.engines[0]
            quarantine(plane, endpoint)
            transport.push(Weights(weights[1]), plane, 2)
            assert engine.weight_version == 1 and other.weight_version == 2
            endpoint.quarantined = False  # back in service without a catch-up
            if not router_knows:
                endpoint.weight_version = 2
            transport.push(Weights(weights[2]), plane, 3)
            assert engine.weight_version == other.weight_version == 3
            assert_holds(engine, weights[2])
            assert_holds(other, weights[2])
            assert transport.stats["full_catch_ups"] == 1 and transport.stats["delta_posts"] == 2
            metrics = transport.metrics()  # a step's: the counts since the last call
            assert metrics["weight_sync/full_catch_ups"] == 1 and metrics["weight_sync/full_posts"] == 2
            assert 0 < metrics["weight_sync/changed_frac"] < 1
            assert transport.metrics()["weight_sync/full_catch_ups"] == 0
        finally:
            transport.close(), plane.close()


@pytest.mark.parametrize("kind", sorted(DELTA))
@pytest.mark.parametrize("seed", range(3))
def test_corrupted_engine_weights_fail_the_checksum_and_get_the_whole_weights(tiny_model_dir, seed, kind):
    """One element of one tensor of the engine changes behind the trainer's back (a random one, seeded)."""
    rng = random.Random(seed)
    transport = DELTA[kind](1, 1.0)
    with engines_in_threads(tiny_model_dir, 1) as ([engine], [url]):
        plane = fleet([url], transport)
        try:
            weights = first_weights(engine)
            transport.push(Weights(weights), plane, 1)
            name = rng.choice(sorted(weights))
            with torch.no_grad():
                engine.model.state_dict()[name].view(-1)[rng.randrange(weights[name].numel())] += 0.5
            status, answer = call(url, "/weights_checksum?block_bytes=1024")
            assert answer["checksum"] != weights_checksum(weights, 1024)
            weights = next_weights(weights, rng)
            transport.push(Weights(weights), plane, 2)
            assert_holds(engine, weights)
            assert transport.stats["full_catch_ups"] == 1 and transport.stats["delta_posts"] == 0
        finally:
            transport.close(), plane.close()


@pytest.mark.parametrize("kind", sorted(DELTA))
def test_non_finite_values_in_a_delta_are_refused_and_nothing_is_applied(tiny_model_dir, kind):
    transport = DELTA[kind](1, 1.0)
    with engines_in_threads(tiny_model_dir, 1) as ([engine], [url]):
        plane = fleet([url], transport)
        try:
            weights = first_weights(engine)
            transport.push(Weights(weights), plane, 1)
            broken = dict(weights)
            broken["model.norm.weight"] = broken["model.norm.weight"].clone()
            broken["model.norm.weight"][3] = float("nan")
            with pytest.raises(EngineRequestError, match="NaN or inf values: model.norm.weight"):
                transport.push(Weights(broken), plane, 2)
            assert engine.weight_version == 1
            assert_holds(engine, weights)
        finally:
            transport.close(), plane.close()


@pytest.mark.parametrize("change, field", [
    (lambda d: d.pop("checksum"), "delta: missing field(s): checksum"),
    (lambda d: d.update(base_version=-1), "delta.base_version"),
    (lambda d: d.update(base_checksum="XYZ"), "delta.base_checksum"),
    (lambda d: d.update(block_bytes=100), "delta.block_bytes"),
    (lambda d: d.update(block_bytes=1 << 40), "delta.block_bytes: expected a multiple of 64 from 64 to 67108864"),
    (lambda d: d.update(blocks={"nope": [[0, 1]]}), "delta.blocks: 'nope'"),
    (lambda d: d.update(blocks={"model.norm.weight": [[1, 1]]}), "delta.blocks.model.norm.weight"),
    (lambda d: d.update(blocks={"model.norm.weight": [[0, 99]]}), "goes past its 1 block"),
    (lambda d: d.update(blocks=[1]), "delta.blocks: expected an object"),
])
def test_malformed_delta_sections_get_400_naming_the_field_and_apply_nothing(tiny_model_dir, change, field):
    transport = DeltaSharedMemoryTransport(1, 1.0)
    with engines_in_threads(tiny_model_dir, 1) as ([engine], [url]):
        plane = fleet([url], transport)
        try:
            weights = first_weights(engine)
            transport.push(Weights(weights), plane, 1)
            transport._write(next_weights(weights, random.Random(0)), 2)  # in the file, not posted
            delta = json.loads(json.dumps(transport._delta))
            change(delta)
            status, answer = call(url, SHM, {**transport._last, "delta": delta})
            assert status == 400 and field in answer["error"], answer
            assert engine.weight_version == 1
            assert_holds(engine, weights)
        finally:
            transport.close(), plane.close()


@pytest.mark.parametrize("block_bytes", ["100", "0", "abc", str(1 << 40), "-64", "99999999999999999999"])
def test_the_checksum_endpoint_names_a_bad_block_size(tiny_model_dir, block_bytes):
    with engines_in_threads(tiny_model_dir, 1) as (_, [url]):
        status, answer = call(url, f"/weights_checksum?block_bytes={block_bytes}")
        assert status == 400 and answer["error"].startswith("block_bytes: expected a multiple of 64"), answer


def tensor_delta_body(weights, section, change):
    """The body of a ``tensor`` delta push for ``section``, its runs' tensors changed by ``change`` (which may
    return other metadata)."""
    from safetensors.torch import load, save

    payload = load(encode_blocks(weights, section))
    metadata = change(payload)
    return save(payload, metadata=metadata if isinstance(metadata, dict) else {"miles_delta": json.dumps(section)})


@pytest.mark.parametrize("change, field", [
    (lambda p: p.pop("0"), "needs tensor '0' of"),
    (lambda p: p.update({"0": p["0"][1:]}), "needs tensor '0' of"),
    (lambda p: p.update({"0": p["0"].float()}), "(uint8) in the body, got torch.float32"),
    (lambda p: p.update({"99": p["0"].clone()}), "tensors for the"),
    (lambda p: {"miles_delta": "{not json"}, "the safetensors metadata miles_delta is not JSON"),
])
def test_malformed_tensor_delta_bodies_get_400_naming_what_is_wrong(tiny_model_dir, change, field):
    transport = DeltaTensorTransport(1, 1.0)
    with engines_in_threads(tiny_model_dir, 1) as ([engine], [url]):
        plane = fleet([url], transport)
        try:
            weights = first_weights(engine)
            transport.push(Weights(weights), plane, 1)
            new = next_weights(weights, random.Random(1))
            new["model.norm.weight"] = new["model.norm.weight"] + 1  # one run at least
            section = {"base_version": 1, "base_checksum": weights_checksum(weights, KIB),
                       "checksum": weights_checksum(new, KIB), "block_bytes": KIB,
                       "blocks": {"model.norm.weight": [[0, 1]]}}
            request = urllib.request.Request(url + "/update_weights_from_tensor?weight_version=2",
                                             data=tensor_delta_body(new, section, change),
                                             headers={"Content-Type": "application/octet-stream"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=60)
            answer = json.loads(refused.value.read())
            assert refused.value.code == 400 and field in answer["error"], answer
            assert engine.weight_version == 1
            assert_holds(engine, weights)
        finally:
            transport.close(), plane.close()


@pytest.mark.parametrize("kind", sorted(DELTA))
def test_delta_pushes_refuse_sglang_servers_as_shm_and_tensor_do(tiny_model_dir, kind):
    transport = DELTA[kind](1, 1.0)
    with engines_in_threads(tiny_model_dir, 1) as ([engine], [url]):
        plane = fleet([url], transport)
        try:
            plane.router.engines[0].meta["protocol"] = "sglang"  # as launch_engines marks an SGLang server
            with pytest.raises(ConfigError, match="cannot update SGLang servers"):
                transport.push(Weights(first_weights(engine)), plane, 1)
            assert engine.weight_version == 0
        finally:
            transport.close(), plane.close()


@pytest.mark.parametrize("where", ["this machine", "another machine"])
def test_auto_with_delta_sends_deltas_by_shm_here_and_by_tensor_elsewhere(tiny_model_dir, miles_registry,
                                                                         monkeypatch, where):
    import miles.weights.transports as weight_sync

    if where == "another machine":  # as the trainer's patched host_id makes it look
        monkeypatch.setattr(weight_sync, "host_id", lambda: "another-boot-id/another-host")
    node = {"name": "auto", "delta": True, "block_kib": 1, "full_above": 1.0}
    transport = miles_registry.build("weight_transport", node, "rollout.weight_sync")
    with engines_in_threads(tiny_model_dir, 1) as ([engine], [url]):
        plane = fleet([url], transport)
        try:
            weights = first_weights(engine)
            for version in (1, 2, 3):
                transport.push(Weights(weights), plane, version)
                assert_holds(engine, weights)
                weights = next_weights(weights, random.Random(version))
            used, unused = (transport._shm, transport._tensor)[:: 1 if where == "this machine" else -1]
            assert used.stats["delta_posts"] == 2 and unused.stats["total_bytes"] == 0
            metrics = transport.metrics()
            assert metrics["weight_sync/delta_posts"] == 2 and metrics["weight_sync/full_posts"] == 1
        finally:
            transport.close(), plane.close()


def test_the_option_selects_delta_pushes_and_checks_its_values(miles_registry):
    node = {"name": "shm", "delta": True, "block_kib": 4}
    transport = miles_registry.build("weight_transport", node, "rollout.weight_sync")
    assert isinstance(transport, DeltaSharedMemoryTransport) and transport.block_bytes == 4 * KIB
    plain = miles_registry.build("weight_transport", {"name": "shm"}, "rollout.weight_sync")
    assert type(plain) is SharedMemoryTransport
    node = {"name": "tensor", "delta": True}
    assert isinstance(miles_registry.build("weight_transport", node, "rollout.weight_sync"), DeltaTensorTransport)
    assert type(miles_registry.build("weight_transport", {"name": "tensor"}, "rollout.weight_sync")) is TensorTransport
    for bad, field in (({"delta": "yes"}, "delta: expected true or false"),
                       ({"delta": True, "block_kib": 0}, "block_kib: expected a whole number"),
                       ({"delta": True, "block_kib": 1 << 20}, "block_kib: expected a whole number of KiB from 1"),
                       ({"delta": True, "full_above": 1.5}, "full_above: expected a share")):
        for factory in (shm_transport, tensor_transport, auto_transport):
            with pytest.raises(ConfigError, match=field):
                factory(**bad)


@pytest.mark.parametrize("override, field", [("block_kib=0", "block_kib: expected a whole number"),
                                             ("full_above=1.5", "full_above: expected a share"),
                                             ("delta=maybe", "delta")])
def test_bad_delta_options_stop_the_config_check_before_the_run_directory_changes(tmp_path, override, field):
    with pytest.raises(ConfigError, match=field):
        prepare("configs/quickstart.yaml", [f"run.dir={tmp_path / 'run'}", "rollout.weight_sync.name=shm",
                                            "rollout.weight_sync.delta=true", f"rollout.weight_sync.{override}"])
    assert not (tmp_path / "run").exists()


# -- engines that restart or are killed during a push -----------------------------------------------------


def start_engine(model_dir, port, log_path):
    """``miles engine serve`` on ``port``; returns the process once /health answers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "miles", "engine", "serve", "--model", str(model_dir),
                                 "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    while True:
        if proc.poll() is not None:
            pytest.fail(f"engine server exited: {open(log_path).read()}")
        try:
            if call(f"http://127.0.0.1:{port}", "/health")[0] == 200:
                return proc
        except OSError:
            time.sleep(0.05)  # not listening yet: poll again


def kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def served_checksum(url):
    status, answer = call(url, "/weights_checksum?block_bytes=1024")
    assert status == 200, answer
    return answer["weight_version"], answer["checksum"]


@pytest.mark.parametrize("kind", sorted(DELTA))
def test_a_restarted_engine_refuses_the_delta_and_gets_the_whole_weights(tiny_model_dir, tmp_path, kind):
    """The engine restarts between two pushes, unseen by the router, which still believes it holds version 1."""
    port, log = free_port(), tmp_path / "engine.log"
    proc = start_engine(tiny_model_dir, port, log)
    transport = DELTA[kind](1, 1.0)
    plane = fleet([f"http://127.0.0.1:{port}"], transport)
    try:
        model = LocalEngine()
        model.load_model(str(tiny_model_dir))
        weights = first_weights(model)
        transport.push(Weights(weights), plane, 1)
        kill(proc)
        proc = start_engine(tiny_model_dir, port, log)
        weights = next_weights(weights, random.Random(3))
        transport.push(Weights(weights), plane, 2)
        assert served_checksum(plane.router.engines[0].url) == (2, weights_checksum(weights, 1024))
        assert transport.stats["full_catch_ups"] == 1 and transport.stats["delta_posts"] == 0
    finally:
        transport.close(), plane.close()
        kill(proc)


MOMENTS = ["while the push is written (shm: its file; tensor: its body)", "before the delta is posted",
           "after the engine applied the delta"]


@pytest.mark.parametrize("kind", sorted(DELTA))
def test_a_push_interrupted_by_killing_the_engine_leaves_old_or_new_weights_and_the_next_push_catches_up(
        tiny_model_dir, tmp_path, monkeypatch, kind):
    """Each moment of a push in turn, in an order and at a block a seeded RNG picks: the push is held there by
    a gate, the engine process is killed, then restarted (as its launcher would). It holds the weights of the
    version it reports (the model's own, version 0: a killed process keeps nothing), the router re-admits it
    with a full catch-up, and the next push, a delta, gives it the trainer's weights bit for bit."""
    rng = random.Random(f"26-{kind}")
    port, log = free_port(), tmp_path / "engine.log"
    proc = start_engine(tiny_model_dir, port, log)
    transport = DELTA[kind](1, 1.0)
    plane = fleet([f"http://127.0.0.1:{port}"], transport)
    endpoint = plane.router.engines[0]
    model = LocalEngine()
    model.load_model(str(tiny_model_dir))
    by_version = {0: weights_checksum(model.model.state_dict(), 1024)}
    weights, version = first_weights(model), 1
    write_blocks, encode_blocks = delta_transports.DeltaWeightFile.write_blocks, delta_transports.encode_blocks
    post_delta = delta_transports._post_delta
    try:
        transport.push(Weights(weights), plane, version)
        by_version[version] = weights_checksum(weights, 1024)
        for moment in rng.sample(MOMENTS, len(MOMENTS)):
            held, gate = threading.Event(), threading.Event()

            def hold():
                held.set()
                assert gate.wait(60)

            def held_write(self, new, descriptor, changed, block_bytes, stop_after=rng.randint(0, 3)):
                if moment == MOMENTS[0]:  # stop after some of the changed tensors are written
                    changed = dict(changed)
                    first = dict(list(changed.items())[:stop_after])
                    write_blocks(self, new, descriptor, first, block_bytes)
                    hold()
                write_blocks(self, new, descriptor, changed, block_bytes)

            def held_encode(new, section):
                if moment == MOMENTS[0]:
                    hold()
                return encode_blocks(new, section)

            async def held_post(*args, **kwargs):
                if moment == MOMENTS[1]:
                    await plane.aio.loop.run_in_executor(None, hold)
                applied = await post_delta(*args, **kwargs)
                if moment == MOMENTS[2]:
                    assert applied
                    await plane.aio.loop.run_in_executor(None, hold)
                return applied

            monkeypatch.setattr(delta_transports.DeltaWeightFile, "write_blocks", held_write)
            monkeypatch.setattr(delta_transports, "encode_blocks", held_encode)
            monkeypatch.setattr(delta_transports, "_post_delta", held_post)
            weights, version = next_weights(weights, rng), version + 1
            by_version[version] = weights_checksum(weights, 1024)
            pushing = threading.Thread(target=transport.push, args=(Weights(weights), plane, version))
            pushing.start()
            assert held.wait(60), moment
            kill(proc)
            gate.set()
            pushing.join(60)
            assert not pushing.is_alive()
            monkeypatch.undo()
            proc = start_engine(tiny_model_dir, port, log)
            held_version, checksum = served_checksum(endpoint.url)
            assert by_version[held_version] == checksum, moment  # old or new, never a mix
            assert plane.run(plane.router.check(endpoint)), moment  # back in service (caught up if quarantined)
            weights, version = next_weights(weights, rng), version + 1
            by_version[version] = weights_checksum(weights, 1024)
            transport.push(Weights(weights), plane, version)
            assert served_checksum(endpoint.url) == (version, by_version[version]), moment
        assert transport.stats["full_catch_ups"] >= len(MOMENTS)
    finally:
        transport.close(), plane.close()
        kill(proc)
