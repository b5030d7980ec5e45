"""The engine's prefix cache: the same tokens and log-probs with it as without, fewer tokens prefilled,
bounded, and emptied by weight updates and /flush_cache. Nothing here waits a fixed time."""

import asyncio
import json
import threading
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.engine import LocalEngine
from miles.engine.batcher import Request
from miles.engine.prefix_cache import PrefixCache
from miles.engine.sampling import SamplingParams

SYSTEM = [4, 13, 5, 14, 9, 9, 13, 2, 7, 14, 3]  # a shared head, like a system prompt


def make_engine(model_dir, cache_tokens, background=False):
    engine = LocalEngine(seed=7, background=background, prefix_cache_tokens=cache_tokens)
    engine.load_model(str(model_dir))
    return engine


def generate(engine, prompts, params, **kwargs):
    async def go():
        return await asyncio.gather(*(engine.generate(p, params, **kwargs) for p in prompts))

    return asyncio.run(go())


def counts(engine):
    stats = engine.stats()
    return stats["prefill_tokens_requested"], stats["prefill_tokens_computed"]


def logprobs(answer, key="output_token_logprobs"):
    return [lp for lp, _, _ in answer["meta_info"][key]]


def assert_same(with_cache, without):
    assert len(with_cache) == len(without)
    for a, b in zip(with_cache, without):
        assert a["output_ids"] == b["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            if key in b["meta_info"]:
                x, y = logprobs(a, key), logprobs(b, key)
                assert [v is None for v in x] == [v is None for v in y]
                assert torch.allclose(torch.tensor([v or 0.0 for v in x]), torch.tensor([v or 0.0 for v in y]),
                                      atol=1e-5)


def perturbed(model_dir):
    other = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5 * torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())))
    return other.state_dict()


TEMPERATURES = pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])


# -- the cache itself ------------------------------------------------------------------------------


def kv_of(tokens):
    """Fake K/V [layers=2, 2, heads=1, T, dim=1] whose values name the token and its position."""
    values = torch.tensor([t * 100 + i for i, t in enumerate(tokens)], dtype=torch.float32)
    return values.view(1, 1, 1, -1, 1).expand(2, 2, 1, -1, 1).clone()


def test_longest_prefix_shares_runs_and_leaves_a_token():
    cache = PrefixCache(100)
    cache.insert([1, 2, 3, 4], kv_of([1, 2, 3, 4]))
    cache.insert([1, 2, 5], kv_of([1, 2, 5]))
    assert cache.tokens == 5  # the common head is held once
    for prompt, length in (([1, 2, 3, 9], 3), ([1, 2, 5, 6], 3), ([1, 7], 1), ([8], 0)):
        got, kv = cache.match(prompt, len(prompt))
        assert got == length
        assert (kv is None) if length == 0 else torch.equal(kv, kv_of(prompt[:length]))
    assert cache.match([1, 2, 3, 4], 3)[0] == 3  # the limit (the batcher passes len - 1)
    cache.insert([1, 2], kv_of([1, 2]))  # a held prefix: nothing new
    assert cache.tokens == 5
    cache.clear()
    assert cache.tokens == 0 and cache.match([1, 2, 3], 3) == (0, None)


def test_insert_takes_only_the_kv_of_what_is_not_held():
    """The batcher copies the K/V of a finished row's new tokens only: ``held`` says how many lead tokens are held,
    ``insert(..., start=held)`` takes the rest; the cache then holds what a whole insert would have held."""
    cache = PrefixCache(100)
    cache.insert([1, 2, 3, 4], kv_of([1, 2, 3, 4]))
    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 7], [1, 2, 3, 4], [8, 9]):
        held = cache.held(tokens)
        assert held == cache.match(tokens, len(tokens))[0]
        cache.insert(tokens, kv_of(tokens)[..., held:, :], start=held)
        length, kv = cache.match(tokens, len(tokens))
        assert length == len(tokens) and torch.equal(kv, kv_of(tokens))
    assert cache.tokens == 4 + 2 + 1 + 2
    with pytest.raises(ValueError, match="only 2 tokens are held"):
        cache.insert([1, 2, 8], kv_of([1, 2, 8])[..., 3:, :], start=3)


def test_least_recently_used_tails_go_first():
    cache = PrefixCache(8)
    cache.insert([1, 2, 3, 4], kv_of([1, 2, 3, 4]))
    cache.insert([5, 6, 7, 8], kv_of([5, 6, 7, 8]))
    cache.match([1, 2, 3, 4, 0], 5)  # [1 ...] is now the most recent
    cache.insert([9, 10, 11], kv_of([9, 10, 11]))
    assert cache.tokens == 8
    assert cache.match([5, 6, 7, 8], 4)[0] == 1  # the oldest lost its tail
    assert cache.match([1, 2, 3, 4], 4)[0] == 4 and cache.match([9, 10, 11], 3)[0] == 3
    cache.insert(list(range(20, 40)), kv_of(list(range(20, 40))))  # longer than the bound
    assert cache.tokens == 8
    length, kv = cache.match(list(range(20, 40)), 20)
    assert length == 8 and torch.equal(kv, kv_of(list(range(20, 28))))


# -- the engine: the same answers with the cache as without ------------------------------------------


@TEMPERATURES
def test_multi_turn_continuations(tiny_model_dir, temperature):
    params = {"max_new_tokens": 5, "temperature": temperature, "ignore_eos": True}

    def trajectories(cache_tokens):
        engine = make_engine(tiny_model_dir, cache_tokens)
        prompts, answers = [SYSTEM + [1, 3], SYSTEM + [2, 2, 6]], []
        for turn in range(3):
            turn_answers = generate(engine, prompts, params)
            answers += turn_answers
            prompts = [p + a["output_ids"] + [5 + turn, 13] for p, a in zip(prompts, turn_answers)]
        result = answers, counts(engine), engine.stats()["prefix_cache_tokens"]
        engine.close()
        return result

    with_cache, (requested, computed), held = trajectories(4096)
    without, (requested_off, computed_off), held_off = trajectories(0)
    assert_same(with_cache, without)
    assert requested == requested_off and computed_off == requested_off and held_off == 0
    # turn 1 computes both prompts; turns 2 and 3 only what follows the previous turn's last fed token
    assert computed == 2 * len(SYSTEM) + 2 + 3 + 2 * 2 * (1 + 2) and held > 0


@TEMPERATURES
def test_identical_prompts_in_one_batch_are_computed_once(tiny_model_dir, temperature):
    params = {"max_new_tokens": 4, "temperature": temperature, "ignore_eos": True}
    prompts = [SYSTEM] * 6 + [[7, 13, 2]]

    def run(cache_tokens):
        engine = make_engine(tiny_model_dir, cache_tokens)
        result = generate(engine, prompts, params), counts(engine)
        engine.close()
        return result

    with_cache, (requested, computed) = run(4096)
    without, (requested_off, computed_off) = run(0)
    assert_same(with_cache, without)
    assert requested == requested_off == computed_off == 6 * len(SYSTEM) + 3
    assert computed == len(SYSTEM) + 3


@TEMPERATURES
def test_mixed_hit_lengths_in_one_batch(tiny_model_dir, temperature):
    """No hit, a short and a long hit, a whole prompt held, repeats, and a row that wants prompt log-probs."""
    params = {"max_new_tokens": 6, "temperature": temperature, "ignore_eos": True}
    long_head = SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]

    def run(cache_tokens):
        engine = make_engine(tiny_model_dir, cache_tokens)
        warm = generate(engine, [long_head, [9, 8, 7]], params)
        mixed = [[3, 3, 3, 3],  # no hit
                 SYSTEM[:3] + [12, 12],  # a short hit
                 long_head + [11, 12],  # a long hit
                 long_head + warm[0]["output_ids"][:-1] + [2],  # the whole held sequence and one more
                 long_head,  # held whole: its last token is computed again
                 SYSTEM[:3] + [12, 12]]  # a repeat
        before = counts(engine)
        answers = generate(engine, mixed, params)
        after = counts(engine)
        prompt_logprobs = generate(engine, [long_head + [11, 12]], {**params, "max_new_tokens": 2},
                                   return_logprob=True, logprob_start_len=3)
        engine.close()
        return warm + answers + prompt_logprobs, (after[0] - before[0], after[1] - before[1]), mixed

    with_cache, (requested, computed), mixed = run(4096)
    without, (requested_off, computed_off), _ = run(0)
    assert_same(with_cache, without)
    assert "input_token_logprobs" in with_cache[-1]["meta_info"]
    assert requested == requested_off == computed_off == sum(map(len, mixed))
    assert computed == 4 + (5 - 3) + 2 + 1 + 1  # the repeat of the short hit is computed once


def test_cached_logprobs_match_a_transformers_forward(tiny_model_dir):
    engine = make_engine(tiny_model_dir, 4096)
    params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    first = generate(engine, [SYSTEM], params)[0]
    prompt = SYSTEM + first["output_ids"] + [2, 6]
    second = generate(engine, [prompt, SYSTEM + [1]], params)[0]
    assert counts(engine)[1] < counts(engine)[0]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + second["output_ids"]])
    with torch.no_grad():
        expected = torch.log_softmax(reference(ids).logits[0, :-1].float(), -1)[len(prompt) - 1 :]
    expected = expected.gather(1, ids[0, len(prompt) :, None]).squeeze(1)
    assert torch.allclose(torch.tensor(logprobs(second)), expected, atol=1e-4)
    engine.close()


@TEMPERATURES
def test_a_request_joins_a_running_batch_with_a_hit(tiny_model_dir, temperature):
    """Background engine: the follow-up turn arrives after the 3rd decode step of a long request (submitted by
    the worker itself, so the step is exact whatever the timing)."""
    params = {"max_new_tokens": 6, "temperature": temperature, "ignore_eos": True}

    def run(cache_tokens):
        engine = make_engine(tiny_model_dir, cache_tokens, background=True)
        try:
            first = generate(engine, [SYSTEM], params)
            late, done = [], threading.Event()
            follow_up = Request(SYSTEM + first[0]["output_ids"] + [6, 13], SamplingParams.parse(params),
                                lambda answer: (late.append(answer), done.set()))
            batcher, decode = engine.batcher, engine.batcher._decode
            joins_at = batcher.stats["decode_steps"] + 3

            def hooked():
                decode()
                if batcher.stats["decode_steps"] == joins_at:
                    batcher.submit([follow_up])

            batcher._decode = hooked
            before, steps = counts(engine), batcher.stats["decode_steps"]
            long = generate(engine, [[9, 8, 7, 6]], {**params, "max_new_tokens": 12})
            assert done.wait(60)
            after = counts(engine)
            assert batcher.stats["decode_steps"] - steps == 11  # the follow-up rode along
            return first + long + late, (after[0] - before[0], after[1] - before[1])
        finally:
            engine.close()

    with_cache, (requested, computed) = run(4096)
    without, (requested_off, computed_off) = run(0)
    assert_same(with_cache, without)
    assert requested == requested_off == computed_off == 4 + len(SYSTEM) + 6 + 2
    assert computed == 4 + 1 + 2  # the follow-up: the last output token and the two new ones


# -- bounds, switches, invalidation ----------------------------------------------------------------


def test_held_tokens_stay_under_the_bound(tiny_model_dir):
    engine = make_engine(tiny_model_dir, 20)
    params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    for i in range(6):
        generate(engine, [[3 + i] * 9, [4 + i, 5] * 4], params)
        assert 0 < engine.stats()["prefix_cache_tokens"] <= 20
        assert engine.batcher.prefix_cache.tokens == engine.stats()["prefix_cache_tokens"]
    engine.close()


def test_disabled_saves_nothing(tiny_model_dir):
    engine = make_engine(tiny_model_dir, 0)
    params = {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}
    first = generate(engine, [SYSTEM] * 4, params)
    generate(engine, [SYSTEM + first[0]["output_ids"] + [2]], params)
    requested, computed = counts(engine)
    assert engine.batcher.prefix_cache is None
    assert requested == computed == 4 * len(SYSTEM) + len(SYSTEM) + 3 + 1
    assert engine.stats()["prefix_cache_tokens"] == 0
    engine.close()


@pytest.mark.parametrize("value", [-1, 1.5, True, "8"])
def test_bad_size_is_refused(value):
    with pytest.raises(ValueError, match="prefix_cache_tokens: expected an integer >= 0"):
        LocalEngine(prefix_cache_tokens=value)


def test_weight_update_empties_the_cache(tiny_model_dir):
    engine = make_engine(tiny_model_dir, 4096)
    params = {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}
    generate(engine, [SYSTEM], params)
    assert engine.stats()["prefix_cache_tokens"] == len(SYSTEM) + 4
    new = perturbed(tiny_model_dir)
    engine.update_weights(new)
    assert engine.stats()["prefix_cache_tokens"] == 0
    fresh = make_engine(tiny_model_dir, 4096)
    fresh.update_weights(new)
    fresh.set_rng_state(engine.rng_state())
    before = counts(engine)
    again = generate(engine, [SYSTEM], params)
    assert counts(engine)[1] - before[1] == len(SYSTEM)  # no hit
    assert_same(again, generate(fresh, [SYSTEM], params))
    engine.close()
    fresh.close()


def test_a_row_that_spans_a_weight_update_is_not_stored(tiny_model_dir):
    """Its K/V mix old and new weights."""
    engine = make_engine(tiny_model_dir, 4096)
    answers = []
    params = SamplingParams.parse({"max_new_tokens": 6, "ignore_eos": True})
    engine.batcher.submit([Request(list(SYSTEM), params, answers.append)])
    engine.batcher._iteration()  # admitted (the prompt is stored) and one decode step
    assert engine.stats()["prefix_cache_tokens"] == len(SYSTEM)
    engine.update_weights(perturbed(tiny_model_dir))
    engine.batcher.drain()
    assert len(answers) == 1 and engine.stats()["prefix_cache_tokens"] == 0
    engine.close()


def serving(engine):
    """The engine's HTTP app on a free loopback port, served from a thread."""
    from miles.testing import serve_in_thread

    return serve_in_thread(engine)


def post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_server_flush_and_counts_through_the_plane(tiny_model_dir):
    from miles.rollout.plane import RolloutPlane
    from miles.engine.router import Router

    engine = make_engine(tiny_model_dir, 4096, background=True)
    params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    with serving(engine) as base:
        for _ in range(2):
            post(base + "/generate", {"input_ids": SYSTEM, "sampling_params": params})
        with urllib.request.urlopen(base + "/server_info", timeout=60) as response:
            states = json.loads(response.read())["internal_states"][0]
        assert states["prefill_tokens_requested"] == 2 * len(SYSTEM)
        assert states["prefill_tokens_computed"] == len(SYSTEM) + 1
        assert states["prefix_cache_tokens"] == len(SYSTEM) + 2
        plane = RolloutPlane(router=Router([base]))
        try:
            assert plane.prefill_counts()[:2] == (2 * len(SYSTEM), len(SYSTEM) + 1)
        finally:
            plane.close()
        assert post(base + "/flush_cache", {})["success"]
        assert engine.stats()["prefix_cache_tokens"] == 0
        post(base + "/generate", {"input_ids": SYSTEM, "sampling_params": params})
        assert counts(engine) == (3 * len(SYSTEM), 2 * len(SYSTEM) + 1)
    local = RolloutPlane(local_engines=[engine])
    assert local.prefill_counts()[:2] == counts(engine)
    local.close()
