"""The in-process engine: log-prob fidelity, sampling controls, stop rules, weight updates."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.engine import LocalEngine


@pytest.fixture
def engine(tiny_model_dir):
    engine = LocalEngine(seed=1, background=True)
    engine.load_model(str(tiny_model_dir))
    yield engine
    engine.close()


def reference_logprobs(model_dir, prompt, output_ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logprobs[len(prompt) - 1 :].gather(1, ids[0, len(prompt) :, None]).squeeze(1)


def generate_many(engine, prompts, params):
    async def go():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    return asyncio.run(go())


def test_answer_has_sglang_shape(engine):
    [answer] = generate_many(engine, [[4, 5]], {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True})
    meta = answer["meta_info"]
    assert len(answer["output_ids"]) == 3 == meta["completion_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == answer["output_ids"]
    assert meta["weight_version"] == 0 and meta["prompt_tokens"] == 2
    assert isinstance(answer["text"], str)


def test_logprobs_match_a_transformers_forward(engine, tiny_model_dir):
    prompts = [[4, 13, 5, 14], [7, 13], [3, 13, 9, 14, 2, 2]]  # different lengths: left padding is exercised
    answers = generate_many(engine, prompts, {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True})
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for prompt, answer in zip(prompts, answers):
        ids = torch.tensor([prompt + answer["output_ids"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(reference(ids).logits[0, :-1].float(), -1)
        expected = logprobs[len(prompt) - 1 :].gather(1, ids[0, len(prompt) :, None]).squeeze(1)
        got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, expected, atol=1e-4), (got, expected)


def test_concurrent_requests_are_batched_and_independent(engine):
    params = {"max_new_tokens": 4, "temperature": 0.0}
    before = engine.batcher.stats["prefill_batches"]
    answers = generate_many(engine, [[4, 13, 5, 14]] * 5 + [[7, 13, 2, 14]], params)
    assert engine.batcher.stats["prefill_batches"] == before + 1  # one turn, one prefill
    single = generate_many(engine, [[7, 13, 2, 14]], params)[0]
    assert answers[-1]["output_ids"] == single["output_ids"]  # padding does not change greedy results
    assert all(a["output_ids"] == answers[0]["output_ids"] for a in answers[:5])


def test_stop_tokens_and_eos(engine):
    greedy = generate_many(engine, [[4, 13, 5, 14]], {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})[0]
    first = greedy["output_ids"][0]
    stopped = generate_many(engine, [[4, 13, 5, 14]], {"max_new_tokens": 8, "temperature": 0.0,
                                                        "stop_token_ids": [first]})[0]
    assert stopped["output_ids"] == [first]  # the matched stop token is part of the output
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


def test_top_k_one_is_greedy(engine):
    prompt = [[4, 13, 5, 14]]
    greedy = generate_many(engine, prompt, {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True})[0]
    top1 = generate_many(engine, prompt, {"max_new_tokens": 5, "temperature": 1.0, "top_k": 1, "ignore_eos": True})[0]
    assert greedy["output_ids"] == top1["output_ids"]


def test_bad_requests_name_the_field(engine):
    with pytest.raises(ValueError, match="unknown parameter.*'temprature'"):
        generate_many(engine, [[4]], {"temprature": 1.0})
    with pytest.raises(ValueError, match="max_new_tokens: expected an integer >= 0, got -1"):
        generate_many(engine, [[4]], {"max_new_tokens": -1})
    with pytest.raises(ValueError, match="does not fit the context"):
        generate_many(engine, [[4] * 500], {})
    with pytest.raises(ValueError, match="token ids must be integers"):
        generate_many(engine, [[4, 10_000]], {})


def test_weight_update_changes_outputs_and_version(engine, tiny_model_dir):
    params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    before = generate_many(engine, [[4, 13, 5, 14]], params)[0]
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    assert engine.update_weights(other.state_dict()) == 1
    after = generate_many(engine, [[4, 13, 5, 14]], params)[0]
    assert after["meta_info"]["weight_version"] == 1
    assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]


def test_mismatched_weight_update_is_refused_whole(engine):
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    bad = {k: v + 1 for k, v in state.items()}
    name = next(iter(bad))
    bad[name] = torch.zeros(3)
    with pytest.raises(ValueError, match="weight update refused"):
        engine.update_weights(bad)
    assert engine.weight_version == 0
    assert all(torch.equal(v, state[k]) for k, v in engine.model.state_dict().items())


def test_continuous_batching_short_request_overtakes_a_long_one(engine, tiny_model_dir):
    """A request that joins a running batch finishes first, and both keep exact log-probs."""
    finished = []

    async def go():
        async def one(name, prompt, n, delay):
            await asyncio.sleep(delay)
            answer = await engine.generate(prompt, {"max_new_tokens": n, "ignore_eos": True})
            finished.append(name)
            return answer

        return await asyncio.gather(one("long", [4, 13, 5, 14], 100, 0.0), one("short", [9, 13, 9, 14, 1, 3], 3, 0.05))

    decode_steps = engine.batcher.stats["decode_steps"]
    long, short = asyncio.run(go())
    assert finished == ["short", "long"]
    assert len(long["output_ids"]) == 100 and len(short["output_ids"]) == 3
    assert engine.batcher.stats["decode_steps"] - decode_steps < 100 + 3  # the short one rode along
    for prompt, answer in (([4, 13, 5, 14], long), ([9, 13, 9, 14, 1, 3], short)):
        got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, reference_logprobs(tiny_model_dir, prompt, answer["output_ids"]), atol=1e-4)


def test_abort_returns_what_was_generated(engine):
    async def go():
        task = asyncio.ensure_future(engine.generate([4, 13, 5, 14], {"max_new_tokens": 120, "ignore_eos": True},
                                                     rid="r1"))
        start = engine.batcher.stats["decode_steps"]
        while engine.batcher.stats["decode_steps"] < start + 5:
            await asyncio.sleep(0.001)
        engine.pause()  # hold it mid-way, so the abort cannot arrive after the end
        assert engine.abort("r1") == 1
        answer = await task
        engine.resume()
        return answer

    answer = asyncio.run(go())
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert 5 <= len(answer["output_ids"]) < 120
    assert len(answer["meta_info"]["output_token_logprobs"]) == len(answer["output_ids"])


def test_an_abort_reaches_a_request_taken_off_the_queue_but_not_yet_admitted(engine):
    """The engine takes requests off its queue, then admits them under its step lock: an abort in between
    (a weight update's, in rollout.async.update=abort) still ends them, before they sample a token."""
    async def go():
        with engine.batcher.step_lock:  # hold the engine between taking the request and admitting it
            task = asyncio.ensure_future(engine.generate([4, 13, 5, 14], {"max_new_tokens": 8, "ignore_eos": True},
                                                         rid="r1"))
            while not engine.batcher._admitting:
                await asyncio.sleep(0.001)
            assert engine.abort("r1") == 1
        return await task

    answer = asyncio.run(go())
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert answer["output_ids"] == []


def test_inline_engine_generates_each_turn_in_the_calling_thread(tiny_model_dir):
    """The in-process default: no worker thread; a turn's requests run to completion, batched."""
    engine = LocalEngine(seed=1)
    engine.load_model(str(tiny_model_dir))
    assert engine.batcher._thread is None
    prompts = [[4, 13, 5, 14], [9, 13, 9, 14, 1, 3], [2, 13]]
    answers = generate_many(engine, prompts, {"max_new_tokens": 5, "ignore_eos": True})
    assert engine.batcher.stats["prefill_batches"] == 1
    for prompt, answer in zip(prompts, answers):
        got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, reference_logprobs(tiny_model_dir, prompt, answer["output_ids"]), atol=1e-4)
    engine.close()


def test_device_and_dtype_choose_where_and_in_what_the_weights_live(tiny_model_dir):
    with pytest.raises(ValueError, match="device: expected cpu, cuda or auto"):
        LocalEngine(device="tpu")
    with pytest.raises(ValueError, match="dtype: expected float32, bfloat16"):
        LocalEngine(dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no GPU"):
            LocalEngine(device="cuda").load_model(str(tiny_model_dir))
    engine = LocalEngine(seed=1, background=True, device="auto", dtype="bfloat16")
    engine.load_model(str(tiny_model_dir))
    try:
        expected_device = "cuda" if torch.cuda.is_available() else "cpu"
        assert {p.device.type for p in engine.model.parameters()} == {expected_device}
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
        prompts = [[4, 13, 5, 14], [7, 13]]
        answers = generate_many(engine, prompts, {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True})
        assert [len(a["output_ids"]) for a in answers] == [5, 5]
        # float32 weights from a trainer load into the bfloat16 engine
        weights = {k: v.float() + 0.01 for k, v in engine.model.state_dict().items()}
        assert engine.update_weights(weights, weight_version=3) == 3
        first = next(iter(engine.model.state_dict().values()))
        assert first.dtype == torch.bfloat16 and first.device.type == expected_device
    finally:
        engine.close()
