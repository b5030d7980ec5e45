"""SGLang's own router (``sglang-router`` from PyPI, a Rust binary) in front of two Miles engines.

The router probes each engine (HTTP/2 preface, ``/server_info``, ``/model_info``) and forwards
``/generate`` with SGLang's whole request schema; the engines must answer it all, quietly.
"""


import pytest
import torch
from transformers import AutoModelForCausalLM

from test_engine_server import call, reference_logprobs, start_engine, start_router

pytest.importorskip("sglang_router", reason="sglang-router is in the test extra: pip install -e '.[test]'")

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def routed(tiny_model_dir, tmp_path_factory):
    """(router URL, [engine URLs], [engine log paths]) with round-robin routing."""
    logs = tmp_path_factory.mktemp("sglang-router")
    engines = [start_engine(tiny_model_dir, logs / f"engine{i}.log") for i in range(2)]
    urls = [base for _, base in engines]
    processes = [p for p, _ in engines]
    try:
        router, base = start_router(urls, logs / "router.log", "--policy", "round_robin")
        processes.insert(0, router)
        yield base, urls, [logs / f"engine{i}.log" for i in range(2)]
    finally:
        for proc in processes:
            proc.terminate()
        for proc in processes:
            proc.wait(timeout=10)


def finished(url):
    return call(url, "/server_info")[1]["internal_states"][0]["requests_finished"]


def test_generate_through_sglang_router(routed, tiny_model_dir):
    base, engines, logs = routed
    before = [finished(url) for url in engines]
    prompt = [3, 13, 9, 14]
    answers = [call(base, "/generate", {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True})
               for _ in range(4)]
    assert all(status == 200 for status, _ in answers), answers
    direct = call(engines[0], "/generate", {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True})[1]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for _, answer in answers:
        assert answer["output_ids"] == direct["output_ids"] and len(answer["output_ids"]) == 4
        logprobs = reference_logprobs(model, prompt, answer["output_ids"])[len(prompt) - 1 :]
        expected = logprobs.gather(1, torch.tensor(answer["output_ids"])[:, None]).squeeze(1)
        got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, expected, atol=1e-4)
    served = [finished(url) - b for url, b in zip(engines, before)]
    assert served[0] >= 2 and served[1] >= 2 and sum(served) == 5  # round robin: two each, plus the direct one

    status, by_text = call(base, "/generate", {"text": "12+3=", "sampling_params": GREEDY, "return_logprob": True,
                                               "return_text_in_logprobs": True, "top_logprobs_num": 2})
    assert status == 200 and len(by_text["meta_info"]["output_top_logprobs"]) == 4
    assert all(isinstance(text, str) for _, _, text in by_text["meta_info"]["output_token_logprobs"])
    status, refused = call(base, "/generate", {"input_ids": prompt, "return_hidden_states": True})
    assert status == 400 and "return_hidden_states" in refused["error"]
    for log in logs:
        assert "Traceback" not in log.read_text()


def test_router_admin_calls_reach_every_engine(routed):
    base, engines, logs = routed
    status, flushed = call(base, "/flush_cache", data=b"", headers={"Content-Type": "application/json"})
    assert status == 200 and flushed["workers_flushed"] == 2, flushed
    status, info = call(base, "/get_model_info")
    assert status == 200 and info["is_generation"] and info["model_type"] == "qwen3"
    for log in logs:
        assert "Traceback" not in log.read_text()
