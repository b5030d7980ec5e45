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
