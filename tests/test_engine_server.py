"""The embedded engine as a real HTTP server on 127.0.0.1, spoken to with SGLang's protocol.

Nothing here waits a fixed time: a request is held with /pause_generation, and a test waits (with a
deadline) until the engine reports it waiting before it looks.
"""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import save as save_safetensors
from transformers import AutoModelForCausalLM

from miles.testing import build_tiny_model, free_port

MIB = 1 << 20


def strict_json(raw):
    """Parse like a strict client: a bare NaN or Infinity is an error."""
    def refuse(constant):
        raise ValueError(f"invalid JSON constant {constant}")

    return json.loads(raw, parse_constant=refuse)


def call(base, path, body=None, *, data=None, headers=None, method=None):
    """(status, parsed JSON answer); ``body`` is sent as JSON, ``data`` as it is."""
    if body is not None:
        data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(base + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, strict_json(response.read())
    except urllib.error.HTTPError as err:
        return err.code, strict_json(err.read())


def wait_for(condition, what, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.02)


def engine_stats(base):
    return call(base, "/server_info")[1]["internal_states"][0]


def in_background(base, path, body):
    """Start a call in a thread; returns the thread and a dict that gets ``answer``."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(answer=call(base, path, body)))
    thread.start()
    return thread, out


def start_engine(model_dir, log_path, *args, env=None):
    """``miles engine serve`` on a free port, its output in ``log_path``; returns (process, base URL)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "miles", "engine", "serve", "--model", str(model_dir),
                                 "--port", str(port), *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def healthy():
        if proc.poll() is not None:
            pytest.fail(f"engine server exited: {open(log_path).read()}")
        try:
            return call(base, "/health")[0] == 200
        except OSError:
            return False

    wait_for(healthy, "the engine server to answer /health")
    return proc, base


def start_router(worker_urls, log_path, *args):
    """SGLang's router (``sglang-router``) in front of ``worker_urls`` on a free port, its output in ``log_path``;
    returns (process, base URL) once it counts every worker healthy."""
    port = free_port()
    with open(log_path, "w") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, "--host",
             "127.0.0.1", "--port", str(port), "--log-level", "warn", *args],
            env={**os.environ, "NO_COLOR": "1"}, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def all_workers_ready():
        if router.poll() is not None:
            pytest.fail(f"sglang-router exited: {open(log_path).read()}")
        try:
            status, listing = call(base, "/workers")
        except OSError:
            return False
        return status == 200 and sum(w["is_healthy"] for w in listing["workers"]) == len(worker_urls)

    wait_for(all_workers_ready, "sglang-router to register every engine")
    return router, base


@pytest.fixture(scope="module")
def engine_process(tiny_model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    # small body limits, so that the tests can pass them cheaply
    proc, base = start_engine(tiny_model_dir, log_path, "--max-request-mib", "1", "--max-weight-request-mib", "2")
    yield base, log_path
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def server(engine_process):
    return engine_process[0]


GREEDY = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}


def reference_logprobs(model, prompt, output_ids):
    """Log-probs of ``output_ids`` after ``prompt`` [T, V] by one transformers forward."""
    ids = torch.tensor([prompt + output_ids])
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0, :-1].float(), -1)


def test_generate_single_and_batch(server):
    params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    status, single = call(server, "/generate",
                          {"input_ids": [4, 13, 5, 14], "sampling_params": params, "return_logprob": True})
    assert status == 200
    assert len(single["output_ids"]) == 3 and single["meta_info"]["completion_tokens"] == 3
    assert [t for _, t, _ in single["meta_info"]["output_token_logprobs"]] == single["output_ids"]
    status, batch = call(server, "/generate",
                         {"input_ids": [[4, 13, 5, 14], [7, 13, 2, 14]], "sampling_params": params})
    assert status == 200 and len(batch) == 2
    assert batch[0]["output_ids"] == single["output_ids"]
    assert "output_token_logprobs" not in batch[0]["meta_info"]  # return_logprob defaults to false


def test_logprobs_match_transformers(server, tiny_model_dir):
    prompt = [3, 13, 9, 14]
    _, answer = call(server, "/generate", {"input_ids": prompt, "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([prompt + answer["output_ids"]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    expected = logprobs[len(prompt) - 1 :].gather(1, ids[0, len(prompt) :, None]).squeeze(1)
    got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, expected, atol=1e-4)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"input_ids": []}, "input_ids: expected a non-empty list"),
        ({"input_ids": [4], "sampling_params": {"max_new_tokens": -2}}, "max_new_tokens: expected an integer >= 0"),
        ({"input_ids": [4], "sampling_params": {"temp": 1}}, "unknown parameter(s) 'temp'"),
        ({"input_ids": [4] * 200}, "does not fit the context"),
        ({"input_ids": [4], "prompt": "x"}, "unknown field(s) 'prompt'"),
        ({"input_ids": [4], "stream": True}, "stream: the embedded engine cannot honour true"),
        ({"input_ids": [4], "return_hidden_states": True},
         "return_hidden_states: the embedded engine cannot honour true"),
        ({"input_ids": [4], "lora_path": "adapter"}, "lora_path: the embedded engine cannot honour \"adapter\""),
        ({"input_ids": [4], "token_ids_logprob": [3]}, "token_ids_logprob"),
        ({"input_ids": [4, 5], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len: expected -1"),
        ({"input_ids": [4], "top_logprobs_num": -1}, "top_logprobs_num: expected an integer in [0, 15]"),
        ({"input_ids": [4], "text": "1+2"}, "send exactly one of them"),
        ({"input_ids": [4], "sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty"),
        ({"input_ids": [[4], [5]], "rid": "one"}, "rid: a batch needs a list of rids"),
        ({"input_ids": [[4], [5]], "return_logprob": [True]}, "return_logprob: expected one entry per prompt (2)"),
    ],
)
def test_bad_requests_get_400_naming_the_field(server, body, expected):
    status, answer = call(server, "/generate", body)
    assert status == 400 and expected in answer["error"]
    assert call(server, "/health")[0] == 200  # still serving


def test_admin_endpoints(server):
    status, info = call(server, "/get_model_info")
    assert status == 200 and info["context_length"] == 128 and info["is_generation"]
    assert call(server, "/flush_cache", {})[1]["success"]
    assert call(server, "/pause_generation", {})[1]["success"]
    assert call(server, "/continue_generation", {})[1]["success"]
    assert call(server, "/generate", {"input_ids": [4], "sampling_params": {"max_new_tokens": 1}})[0] == 200


def test_update_weights_from_disk(server, tmp_path):
    params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    _, before = call(server, "/generate",
                     {"input_ids": [4, 13, 5, 14], "sampling_params": params, "return_logprob": True})
    other = build_tiny_model(tmp_path / "other", seed=123)
    status, result = call(server, "/update_weights_from_disk", {"model_path": str(other)})
    assert status == 200 and result["weight_version"] == before["meta_info"]["weight_version"] + 1
    _, after = call(server, "/generate",
                    {"input_ids": [4, 13, 5, 14], "sampling_params": params, "return_logprob": True})
    assert after["meta_info"]["weight_version"] == result["weight_version"]
    assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    status, error = call(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert status == 400 and "model_path" in error["error"]


def test_health_answers_while_a_generation_is_pending(server):
    assert call(server, "/pause_generation", {})[1]["success"]
    try:
        thread, out = in_background(server, "/generate", {
            "input_ids": [4, 13, 5, 14], "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}})
        wait_for(lambda: engine_stats(server)["waiting_requests"] == 1, "the request to wait in the engine")
        assert call(server, "/health")[0] == 200
        assert thread.is_alive()  # paused: nothing is generated, the request is still pending
    finally:
        assert call(server, "/continue_generation", {})[1]["success"]
    thread.join(timeout=60)
    status, answer = out["answer"]
    assert status == 200 and len(answer["output_ids"]) == 20


def test_update_weights_from_tensor(server, tmp_path):
    from miles.weights.wire import encode_named_tensors

    params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", seed=7))
    status, result = call(server, "/update_weights_from_tensor",
                          {"serialized_named_tensors": encode_named_tensors(model.state_dict())})
    assert status == 200
    _, answer = call(server, "/generate",
                     {"input_ids": [3, 13, 9, 14], "sampling_params": params, "return_logprob": True})
    assert answer["meta_info"]["weight_version"] == result["weight_version"]
    ids = torch.tensor([[3, 13, 9, 14] + answer["output_ids"]])
    with torch.no_grad():
        expected = torch.log_softmax(model(ids).logits[0, 3:-1], -1).gather(1, ids[0, 4:, None]).squeeze(1)
    got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, expected, atol=1e-4)  # the new weights serve, all of them

    bad = dict(model.state_dict())
    missing = next(iter(bad))
    bad.pop(missing)
    status, error = call(server, "/update_weights_from_tensor", {"serialized_named_tensors": encode_named_tensors(bad)})
    assert status == 400 and "weight update refused" in error["error"] and f"1 missing: {missing}" in error["error"]
    assert call(server, "/health")[1]["weight_version"] == result["weight_version"]  # old weights keep serving
    assert call(server, "/update_weights_from_tensor", {"serialized_named_tensors": "!!"})[0] == 400


def test_a_weight_update_names_every_offending_tensor_and_applies_nothing(server, tmp_path):
    from miles.weights.wire import encode_named_tensors

    state = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", seed=5)).state_dict()
    names = list(state)
    version = call(server, "/health")[1]["weight_version"]
    prompt = {"input_ids": [4, 13, 5, 14], "sampling_params": GREEDY, "return_logprob": True}
    before = call(server, "/generate", prompt)[1]

    bad = {k: v.clone() for k, v in state.items()}
    del bad[names[0]], bad[names[1]]  # missing
    bad["extra.weight"] = torch.zeros(2)  # unexpected
    bad[names[2]] = torch.zeros(3, 3)  # wrong shape
    bad[names[3]] = state[names[3]].long()  # an integer tensor for a float parameter: wrong dtype
    bad[names[4]] = torch.full_like(state[names[4]], float("nan"))  # non-finite
    bad[names[5]] = torch.full_like(state[names[5]], float("inf"))
    status, error = call(server, "/update_weights_from_tensor", {"serialized_named_tensors": encode_named_tensors(bad)})
    message = error["error"]
    assert status == 400 and "nothing was applied" in message
    assert f"2 missing: {names[0]}, {names[1]}" in message
    assert "1 unexpected: extra.weight" in message
    assert f"{names[2]} (got (3, 3), expected {tuple(state[names[2]].shape)})" in message
    assert f"{names[3]} (got int64, expected float32)" in message
    assert f"2 with NaN or inf values: {names[4]}, {names[5]}" in message and "allow_non_finite" in message
    assert call(server, "/health")[1]["weight_version"] == version  # all or nothing: the old weights keep serving
    assert call(server, "/flush_cache", {})[1]["success"]  # compute the prompt afresh, as the first time
    assert call(server, "/generate", prompt)[1]["meta_info"]["output_token_logprobs"] == \
        before["meta_info"]["output_token_logprobs"]

    many = {**{k: v.clone() for k, v in state.items()}, **{f"extra.{i}": torch.zeros(1) for i in range(60)}}
    many[names[2]] = torch.zeros(3, 3)
    status, error = call(server, "/update_weights_from_tensor",
                         {"serialized_named_tensors": encode_named_tensors(many)})
    assert status == 400 and "60 unexpected" in error["error"] and "... and 10 more" in error["error"]
    assert f"{names[2]} (got (3, 3)" in error["error"]  # never left out of a long message

    half = {k: v.to(torch.bfloat16) for k, v in state.items()}  # float into float, any precision: accepted
    assert call(server, "/update_weights_from_tensor",
                {"serialized_named_tensors": encode_named_tensors(half)})[0] == 200


def test_non_finite_weights_only_when_allowed_and_answers_stay_strict_json(server, tiny_model_dir):
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    nan = save_safetensors({k: torch.full_like(v, float("nan")) for k, v in state.items()})
    octet = {"Content-Type": "application/octet-stream"}
    status, error = call(server, "/update_weights_from_tensor", data=nan, headers=octet)
    assert status == 400 and "NaN or inf" in error["error"]
    status, _ = call(server, "/update_weights_from_tensor?allow_non_finite=true", data=nan, headers=octet)
    assert status == 200
    try:
        for body in ({"input_ids": [4, 13], "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2,
                      "logprob_start_len": 0, "return_entropy": True},
                     {"input_ids": [4, 13], "sampling_params": {"max_new_tokens": 2}}):
            status, answer = call(server, "/generate", body)  # strict_json: a bare NaN would fail here
            assert status == 200 and answer["output_ids"] == []
            assert answer["meta_info"]["finish_reason"]["type"] == "abort"
            assert "non-finite logits" in answer["meta_info"]["finish_reason"]["message"]
    finally:
        assert call(server, "/update_weights_from_disk", {"model_path": str(tiny_model_dir)})[0] == 200


def test_answers_are_strict_json_even_with_non_finite_floats():
    from miles.engine.http_guard import json_answer

    response = json_answer({"a": float("nan"), "b": [1.0, float("-inf")], "c": {"d": float("inf")}})
    assert strict_json(response.text) == {"a": None, "b": [1.0, None], "c": {"d": None}}


def test_update_weights_from_distributed(server, tmp_path):
    from miles.weights.wire import broadcast_tensors, open_weight_group

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", seed=11))
    state = model.state_dict()
    port = free_port()
    joined = {}
    thread = threading.Thread(target=lambda: joined.update(answer=call(server, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"})))
    thread.start()
    group = open_weight_group("127.0.0.1", port, 0, 2)
    thread.join()
    assert joined["answer"] == (200, {"success": True, "rank": 1})

    sent = {}
    thread = threading.Thread(target=lambda: sent.update(answer=call(server, "/update_weights_from_distributed", {
        "names": list(state), "dtypes": ["float32"] * len(state), "shapes": [list(t.shape) for t in state.values()]})))
    thread.start()
    broadcast_tensors(group, list(state.values()))
    thread.join()
    status, result = sent["answer"]
    assert status == 200
    _, answer = call(server, "/generate", {"input_ids": [5, 13, 2, 14], "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 2, "temperature": 0.0,
                                                               "ignore_eos": True}})
    ids = torch.tensor([[5, 13, 2, 14] + answer["output_ids"]])
    with torch.no_grad():
        expected = torch.log_softmax(model(ids).logits[0, 3:-1], -1).gather(1, ids[0, 4:, None]).squeeze(1)
    got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, expected, atol=1e-4)


def test_pause_holds_requests_and_abort_answers_them(server):
    assert call(server, "/pause_generation", {})[1]["success"]
    try:
        thread, out = in_background(server, "/generate", {
            "input_ids": [4, 13, 5, 14], "rid": "held-1",
            "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}})
        wait_for(lambda: engine_stats(server)["waiting_requests"] == 1, "the request to wait in the engine")
        assert thread.is_alive()  # paused: nothing is generated
        assert call(server, "/abort_request", {"rid": "held-1"}) == (200, {"success": True, "aborted": 1})
        thread.join(timeout=30)
    finally:
        assert call(server, "/continue_generation", {})[1]["success"]
    status, answer = out["answer"]
    assert status == 200 and answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert answer["output_ids"] == []
    assert call(server, "/abort_request", {})[0] == 400


def test_a_client_that_disconnects_has_its_request_aborted(server):
    """``miles engine serve``: a client that closes its connection while its request waits (held by the pause)
    has it aborted before it runs; the engine's counters say so."""
    before = engine_stats(server)
    port = int(server.rsplit(":", 1)[1])
    data = json.dumps({"input_ids": [4, 13, 5, 14], "sampling_params": GREEDY}).encode()
    assert call(server, "/pause_generation", {})[1]["success"]
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            wait_for(lambda: engine_stats(server)["waiting_requests"] == 1, "the request to wait in the engine")
        wait_for(lambda: engine_stats(server)["requests_cancelled"] == before["requests_cancelled"] + 1,
                 "the engine to hear of the disconnect")
    finally:
        assert call(server, "/continue_generation", {})[1]["success"]
    wait_for(lambda: engine_stats(server)["requests_aborted"] == before["requests_aborted"] + 1,
             "the request to be aborted")
    after = engine_stats(server)
    assert (after["prefill_batches"], after["decode_steps"]) == (before["prefill_batches"], before["decode_steps"])
    assert after["waiting_requests"] == after["running_requests"] == 0


@pytest.mark.parametrize("how", ["env", "flag"])
def test_admin_token_guards_admin_endpoints_on_loopback_too(tiny_model_dir, miles_cli, tmp_path, how):
    args, env = ((["--admin-token", "s3cret"], {"MILES_ADMIN_TOKEN": ""}) if how == "flag"
                 else ([], {"MILES_ADMIN_TOKEN": "s3cret"}))
    proc, base = start_engine(tiny_model_dir, tmp_path / "engine.log", *args, env=env)
    try:
        status, error = call(base, "/pause_generation", {})
        assert status == 401 and "Authorization: Bearer" in error["error"]
        assert call(base, "/pause_generation", {}, headers={"Authorization": "Bearer wrong"})[0] == 401
        assert call(base, "/update_weights_from_disk", {"model_path": str(tiny_model_dir)})[0] == 401
        assert (call(base, "/pause_generation", {}, headers={"Authorization": "Bearer s3cret"})
                == (200, {"success": True}))
        assert call(base, "/continue_generation", {}, headers={"Authorization": "Bearer s3cret"})[0] == 200
        assert call(base, "/generate", {"input_ids": [4], "sampling_params": {"max_new_tokens": 1}})[0] == 200
        assert call(base, "/health")[0] == 200  # generation and information need no token
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    refused = miles_cli("engine", "serve", "--model", str(tiny_model_dir), "--host", "0.0.0.0",
                        "--port", str(free_port()), env={"MILES_ADMIN_TOKEN": ""})
    assert refused.returncode == 2 and "needs an admin token" in refused.stderr


def test_n_samples_per_prompt(server):
    status, answers = call(server, "/generate", {"input_ids": [[4, 13, 5, 14], [7, 13, 2, 14]],
                                                 "sampling_params": {"n": 3, "max_new_tokens": 2, "temperature": 0.0}})
    assert status == 200 and len(answers) == 6
    assert answers[0]["output_ids"] == answers[1]["output_ids"] == answers[2]["output_ids"]  # greedy: same per prompt
    status, single = call(server, "/generate", {"input_ids": [4, 13], "sampling_params": {"n": 2, "max_new_tokens": 1}})
    assert status == 200 and isinstance(single, list) and len(single) == 2
    assert call(server, "/generate", {"input_ids": [4], "sampling_params": {"n": 0}})[0] == 400


@pytest.mark.parametrize("transport_name", ["tensor", "disk", "distributed"])
def test_weight_transports_reach_a_real_engine(server, tmp_path, transport_name):
    from miles.rollout.plane import RolloutPlane
    from miles.engine.router import Router
    from miles.train.torch_backend import TorchBackend
    from miles.weights.transports import DiskTransport, DistributedTransport, TensorTransport

    transport = {"tensor": TensorTransport, "disk": lambda: DiskTransport(dir=str(tmp_path / "w")),
                 "distributed": DistributedTransport}[transport_name]()
    backend = TorchBackend()
    backend.setup(str(build_tiny_model(tmp_path / "m", seed=21)), seed=0)
    plane = RolloutPlane(router=Router([server]))
    try:
        for version in (40, 41):  # twice: the distributed group is reused
            assert transport.push(backend, plane, version) > 0
            assert call(server, "/health")[1]["weight_version"] == version
    finally:
        plane.close()
    prompt = [5, 13, 2, 14]
    _, answer = call(server, "/generate", {"input_ids": prompt, "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 3, "temperature": 0.0,
                                                               "ignore_eos": True}})
    ids = torch.tensor([prompt + answer["output_ids"]])
    with torch.no_grad():
        expected = torch.log_softmax(backend.model(ids).logits[0, 3:-1], -1).gather(1, ids[0, 4:, None]).squeeze(1)
    got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, expected, atol=1e-4)


# -- requests from web pages ---------------------------------------------------------------------------


def test_cross_site_requests_are_refused(server):
    port = server.rsplit(":", 1)[1]
    evil = {"Origin": "http://evil.example"}
    for path in ("/pause_generation", "/update_weights_from_disk", "/generate"):  # a web page's "simple" POST
        status, error = call(server, path, data=b"{}", headers={**evil, "Content-Type": "text/plain"})
        assert status == 403 and "Origin 'http://evil.example'" in error["error"], path
    assert call(server, "/health", headers=evil)[0] == 403
    # without an Origin header (an old browser, a form), the content type still stops it
    status, error = call(server, "/pause_generation", data=b"{}", headers={"Content-Type": "text/plain"})
    assert status == 415 and "expected application/json" in error["error"] and "text/plain" in error["error"]
    status, error = call(server, "/update_weights_from_tensor", data=b"x", headers={"Content-Type": "text/plain"})
    assert status == 415 and "application/json or application/octet-stream" in error["error"]
    status, error = call(server, "/abort_request", data=b"",
                         headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415
    # DNS rebinding: the page's own name in Host
    status, error = call(server, "/pause_generation", {}, headers={"Host": f"evil.example:{port}"})
    assert status == 421 and f"Host 'evil.example:{port}'" in error["error"] and "--allowed-host" in error["error"]
    assert call(server, "/health", headers={"Host": f"127.0.0.1:{int(port) + 1}"})[0] == 421
    # the server's own names and origin pass; a POST without a body needs no Content-Type
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        assert call(server, "/health", headers={"Host": host, "Origin": f"http://{host}"})[0] == 200
    with socket.create_connection(("127.0.0.1", int(port))) as s:  # exactly what SGLang's router sends
        s.sendall((f"POST /flush_cache HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                   f"Accept: */*\r\nConnection: close\r\n\r\n").encode())
        assert recv_all(s).startswith(b"HTTP/1.1 200")


def test_miles_own_client_passes_the_checks(server):
    from miles.engine.router import Router

    async def go():
        async with Router([server]) as router:
            answer = await router.generate([4, 13, 5, 14], GREEDY)
            paused = await router.post(router.engines[0], "/pause_generation", {})
            resumed = await router.post(router.engines[0], "/continue_generation", {})
            return answer, paused, resumed

    answer, paused, resumed = asyncio.run(go())
    assert len(answer["output_ids"]) == 3 and paused == resumed == {"success": True}


def test_request_bodies_have_a_size_limit_per_endpoint(server):
    status, error = call(server, "/generate", data=b" " * (MIB + 1))
    assert (status == 413 and "1048576 bytes (1 MiB) for /generate" in error["error"]
            and "--max-request-mib" in error["error"])
    chunked = (b" " * (64 << 10) for _ in range(17))  # no Content-Length: counted while it is read
    status, error = call(server, "/generate", data=chunked, headers={"Transfer-Encoding": "chunked"})
    assert status == 413 and "--max-request-mib" in error["error"]
    octet = {"Content-Type": "application/octet-stream"}
    status, error = call(server, "/update_weights_from_tensor", data=b"x" * (2 * MIB + 1), headers=octet)
    assert status == 413 and "(2 MiB)" in error["error"] and "--max-weight-request-mib" in error["error"]
    status, error = call(server, "/update_weights_from_tensor", data=b"x" * (MIB + 10), headers=octet)
    assert status == 400 and "not safetensors bytes" in error["error"]  # over the small limit, within its own
    assert call(server, "/health")[0] == 200


def test_default_body_limits():
    from miles.cli import _parser
    from miles.engine.server import MAX_REQUEST_BYTES, MAX_WEIGHT_REQUEST_BYTES

    args = _parser().parse_args(["engine", "serve", "--model", "m"])
    assert args.max_request_mib * MIB == MAX_REQUEST_BYTES == 16 * MIB
    assert args.max_weight_request_mib * MIB == MAX_WEIGHT_REQUEST_BYTES == 1024 * MIB


# -- SGLang's clients ----------------------------------------------------------------------------------


def test_sglang_router_request_is_accepted(server):
    """The body sglang-router 0.3.2 forwards for a plain /generate."""
    body = {"model": None, "input_ids": [4, 13, 5, 14], "sampling_params": {"temperature": 0.0, "max_new_tokens": 3},
            "return_logprob": True, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
            "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
            "return_entropy": False}
    status, answer = call(server, "/generate", body)
    assert status == 200 and len(answer["output_ids"]) == 3
    assert all(text is None for _, _, text in answer["meta_info"]["output_token_logprobs"])
    status, answer = call(server, "/generate", {
        "input_ids": [4], "sampling_params": {"max_new_tokens": 1, "skip_special_tokens": True, "min_new_tokens": 0,
                                              "stop": [], "repetition_penalty": 1.0}})
    assert status == 200


def test_sglang_logprob_fields(server, tiny_model_dir):
    from miles.models.hf import load_tokenizer

    assert call(server, "/update_weights_from_disk", {"model_path": str(tiny_model_dir)})[0] == 200
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = load_tokenizer(tiny_model_dir)
    prompt = [3, 13, 9, 14]
    status, answer = call(server, "/generate", {
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}, "return_logprob": True,
        "return_text_in_logprobs": True, "top_logprobs_num": 3, "logprob_start_len": 1, "return_entropy": True})
    assert status == 200
    meta, output = answer["meta_info"], answer["output_ids"]
    logprobs = reference_logprobs(model, prompt, output)  # [T, V]: position t predicts token t + 1

    assert [t for _, t, _ in meta["output_token_logprobs"]] == output
    assert [text for _, _, text in meta["output_token_logprobs"]] == [tokenizer.decode([t]) for t in output]
    assert len(meta["output_top_logprobs"]) == len(output)
    for position, top in enumerate(meta["output_top_logprobs"]):
        values, ids = logprobs[len(prompt) - 1 + position].topk(3)
        assert [t for _, t, _ in top] == ids.tolist()
        assert torch.allclose(torch.tensor([lp for lp, _, _ in top]), values, atol=1e-4)
        assert [text for _, _, text in top] == [tokenizer.decode([t]) for t in ids.tolist()]
    entropy = -(logprobs.exp() * logprobs).sum(-1)[len(prompt) - 1 :]
    assert torch.allclose(torch.tensor(meta["output_token_entropy"]), entropy, atol=1e-4)

    # prompt log-probs from position 1: tokens 13, 9, 14, each given the tokens before it
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt[1:]
    expected = logprobs[:3].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"]]), expected, atol=1e-4)
    assert len(meta["input_top_logprobs"]) == 3 and all(len(top) == 3 for top in meta["input_top_logprobs"])
    _, from_start = call(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1},
                                               "return_logprob": True, "logprob_start_len": 0})
    assert from_start["meta_info"]["input_token_logprobs"][0] == [None, prompt[0], None]  # the first token has none


def test_text_prompts_are_tokenized_with_the_model_tokenizer(server, tiny_model_dir):
    from miles.models.hf import load_tokenizer

    ids = load_tokenizer(tiny_model_dir).encode("12+3=")
    by_ids = call(server, "/generate", {"input_ids": ids, "sampling_params": GREEDY})[1]
    by_text = call(server, "/generate", {"text": "12+3=", "sampling_params": GREEDY})[1]
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["meta_info"]["prompt_tokens"] == len(ids)
    status, batch = call(server, "/generate", {"text": ["12+3=", "4"], "rid": ["a", "b"],
                                               "sampling_params": [GREEDY, {**GREEDY, "max_new_tokens": 1}]})
    assert status == 200 and [a["meta_info"]["id"] for a in batch] == ["a", "b"]
    assert batch[0]["output_ids"] == by_ids["output_ids"] and len(batch[1]["output_ids"]) == 1


def test_sglang_information_endpoints(server):
    for path in ("/model_info", "/get_model_info"):
        status, info = call(server, path)
        assert status == 200 and info["is_generation"] and info["model_path"] and info["tokenizer_path"]
        assert info["architectures"] == ["Qwen3ForCausalLM"] and info["model_type"] == "qwen3"
    for path in ("/server_info", "/get_server_info"):
        status, info = call(server, path)
        assert status == 200 and info["dp_size"] == 1 and info["context_length"] == 128
        assert info["max_request_bytes"] == MIB and info["max_weight_request_bytes"] == 2 * MIB
        assert {"requests_finished", "waiting_requests", "running_requests"} <= set(info["internal_states"][0])
    status, error = call(server, "/no_such_endpoint")
    assert status == 404 and "GET /no_such_endpoint" in error["error"]


def recv_all(sock):
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_an_http2_preface_is_answered_quietly(engine_process):
    base, log_path = engine_process
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:  # what sglang-router sends first on each connection
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
        answer = recv_all(s)  # the server answers and closes: whatever it logs is written by now
    assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400")
    assert call(base, "/health")[0] == 200
    assert "Traceback" not in log_path.read_text()
