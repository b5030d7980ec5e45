"""The embedded engine as a real HTTP server on 127.0.0.1, spoken to with SGLang's protocol."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.testing import build_tiny_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "miles", "engine", "serve", "--model", str(tiny_model_dir),
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if call(base, "/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("engine server did not become healthy: " + proc.stdout.read())
    yield base
    proc.terminate()
    proc.wait(timeout=10)


def test_generate_single_and_batch(server):
    params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    status, single = call(server, "/generate", {"input_ids": [4, 13, 5, 14], "sampling_params": params, "return_logprob": True})
    assert status == 200
    assert len(single["output_ids"]) == 3 and single["meta_info"]["completion_tokens"] == 3
    assert [t for _, t, _ in single["meta_info"]["output_token_logprobs"]] == single["output_ids"]
    status, batch = call(server, "/generate", {"input_ids": [[4, 13, 5, 14], [7, 13, 2, 14]], "sampling_params": params})
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
    _, before = call(server, "/generate", {"input_ids": [4, 13, 5, 14], "sampling_params": params, "return_logprob": True})
    other = build_tiny_model(tmp_path / "other", seed=123)
    status, result = call(server, "/update_weights_from_disk", {"model_path": str(other)})
    assert status == 200 and result["weight_version"] == before["meta_info"]["weight_version"] + 1
    _, after = call(server, "/generate", {"input_ids": [4, 13, 5, 14], "sampling_params": params, "return_logprob": True})
    assert after["meta_info"]["weight_version"] == result["weight_version"]
    assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    status, error = call(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert status == 400 and "model_path" in error["error"]


def test_health_answers_while_a_long_generation_runs(server):
    import threading

    finished = {}

    def long_generation():
        call(server, "/generate", {"input_ids": [[4, 13, 5, 14]] * 128,
                                   "sampling_params": {"max_new_tokens": 120, "ignore_eos": True}})
        finished["generate"] = time.monotonic()

    worker = threading.Thread(target=long_generation)
    worker.start()
    time.sleep(0.3)  # the generation is under way
    assert call(server, "/health")[0] == 200
    finished["health"] = time.monotonic()
    worker.join()
    assert finished["health"] < finished["generate"]


def test_update_weights_from_tensor(server, tmp_path):
    from miles.engine.weights_io import encode_named_tensors

    params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", seed=7))
    status, result = call(server, "/update_weights_from_tensor",
                          {"serialized_named_tensors": encode_named_tensors(model.state_dict())})
    assert status == 200
    _, answer = call(server, "/generate", {"input_ids": [3, 13, 9, 14], "sampling_params": params, "return_logprob": True})
    assert answer["meta_info"]["weight_version"] == result["weight_version"]
    ids = torch.tensor([[3, 13, 9, 14] + answer["output_ids"]])
    with torch.no_grad():
        expected = torch.log_softmax(model(ids).logits[0, 3:-1], -1).gather(1, ids[0, 4:, None]).squeeze(1)
    got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, expected, atol=1e-4)  # the new weights serve, all of them

    bad = dict(model.state_dict())
    bad.pop(next(iter(bad)))
    status, error = call(server, "/update_weights_from_tensor", {"serialized_named_tensors": encode_named_tensors(bad)})
    assert status == 400 and "weight update refused" in error["error"] and "(missing)" in error["error"]
    assert call(server, "/health")[1]["weight_version"] == result["weight_version"]  # old weights keep serving
    assert call(server, "/update_weights_from_tensor", {"serialized_named_tensors": "!!"})[0] == 400


def test_update_weights_from_distributed(server, tmp_path):
    import threading

    from miles.engine.weights_io import broadcast_tensors, open_weight_group

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", seed=11))
    state = model.state_dict()
    port = free_port()
    joined = {}
    thread = threading.Thread(target=lambda: joined.update(answer=call(server, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 0, "world_size": 2, "backend": "gloo"})))
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
                                           "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}})
    ids = torch.tensor([[5, 13, 2, 14] + answer["output_ids"]])
    with torch.no_grad():
        expected = torch.log_softmax(model(ids).logits[0, 3:-1], -1).gather(1, ids[0, 4:, None]).squeeze(1)
    got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, expected, atol=1e-4)


def test_pause_holds_requests_and_abort_answers_them(server):
    import threading

    assert call(server, "/pause_generation", {})[1]["success"]
    out = {}
    thread = threading.Thread(target=lambda: out.update(answer=call(server, "/generate", {
        "input_ids": [4, 13, 5, 14], "rid": "held-1", "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}})))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()  # paused: nothing is generated
    assert call(server, "/abort_request", {"rid": "held-1"}) == (200, {"success": True, "aborted": 1})
    thread.join(timeout=30)
    status, answer = out["answer"]
    assert status == 200 and answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert answer["output_ids"] == []
    assert call(server, "/continue_generation", {})[1]["success"]
    assert call(server, "/abort_request", {})[0] == 400


def test_admin_token_guards_admin_endpoints(tiny_model_dir, miles_cli):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILES_ADMIN_TOKEN": "s3cret"}
    proc = subprocess.Popen([sys.executable, "-m", "miles", "engine", "serve", "--model", str(tiny_model_dir),
                             "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if call(base, "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        assert call(base, "/pause_generation", {})[0] == 401
        request = urllib.request.Request(base + "/pause_generation", data=b"{}", headers={
            "Content-Type": "application/json", "Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    refused = miles_cli("engine", "serve", "--model", str(tiny_model_dir), "--host", "0.0.0.0", "--port", str(port),
                        env={"MILES_ADMIN_TOKEN": ""})
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
    from miles.rollout.router import Router
    from miles.train.torch_backend import TorchBackend
    from miles.train.weight_sync import DiskTransport, DistributedTransport, TensorTransport

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
                                           "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}})
    ids = torch.tensor([prompt + answer["output_ids"]])
    with torch.no_grad():
        expected = torch.log_softmax(backend.model(ids).logits[0, 3:-1], -1).gather(1, ids[0, 4:, None]).squeeze(1)
    got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, expected, atol=1e-4)
