"""A vision-language model (a tiny Qwen2.5-VL) in the embedded engine: SGLang's ``image_data``, checked against a
fresh ``transformers`` forward that places the images and computes the multimodal positions its own way."""

import asyncio
import os
import base64

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from miles.engine.local import LocalEngine
from miles.engine.router import Router
from miles.models.hf import load_image_processor, load_tokenizer
from miles.models.vision import expand_images, mrope_positions, process_image, vision_spec
from miles.testing.vision import VISION_PROMPT, draw_dots, png_bytes
from test_engine_server import call, start_engine, start_router

PROMPT = VISION_PROMPT
GREEDY = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    paths = {}
    for name, image in {"two_red": draw_dots(2, "red"), "four_blue": draw_dots(4, "blue"),
                        "big": draw_dots(5, "green", size=(900, 700))}.items():
        paths[name] = folder / f"{name}.png"
        paths[name].write_bytes(png_bytes(image))
    (folder / "broken.png").write_bytes(png_bytes(draw_dots(1, "red"))[:60])
    paths["broken"] = folder / "broken.png"
    return paths


@pytest.fixture(scope="module")
def vlm(vlm_model_dir):
    model = AutoModelForImageTextToText.from_pretrained(vlm_model_dir).eval()
    return model, load_tokenizer(vlm_model_dir), load_image_processor(vlm_model_dir), vision_spec(model.config)


def reference(vlm, ids, paths, output_ids):
    """(prompt log-probs of tokens 1.., output log-probs) of the expanded prompt, by ``transformers`` alone."""
    model, _, processor, spec = vlm
    processed = [process_image(processor, Image.open(p).convert("RGB")) for p in paths]
    full, _ = expand_images(ids, spec, processed)
    seq = torch.tensor([full + output_ids])
    kwargs = {}
    if processed:
        kwargs = {"pixel_values": torch.cat([p.pixel_values for p in processed]),
                  "image_grid_thw": torch.tensor([p.grid for p in processed])}
    with torch.no_grad():
        logits = model(input_ids=seq, mm_token_type_ids=(seq == spec.image_token_id).int(), **kwargs).logits[0].float()
    prompt = logits.log_softmax(-1).gather(1, seq[0, 1:, None]).squeeze(1)[: len(full) - 1]
    # outputs are sampled without the image tokens (a policy never generates them)
    masked = logits.index_fill(-1, torch.tensor(spec.never_generated), float("-inf")).log_softmax(-1)
    return prompt, masked.gather(1, seq[0, 1:, None]).squeeze(1)[len(full) - 1:]


def output_logprobs(answer):
    return torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])


def engine(model_dir, cache_tokens=4096):
    e = LocalEngine(prefix_cache_tokens=cache_tokens)
    e.load_model(str(model_dir))
    return e


def generate(e, ids, image_data, **kwargs):
    return asyncio.run(e.generate(ids, GREEDY, True, image_data=image_data, **kwargs))


def test_positions_are_those_transformers_computes(vlm, images):
    """Two images with text between and after, and text only: the same positions as the model's get_rope_index,
    and generated tokens continue from where the prompt's positions end."""
    model, tokenizer, processor, spec = vlm
    ids = tokenizer.encode(f"a{PROMPT}b{PROMPT}cd")
    processed = [process_image(processor, Image.open(images[k]).convert("RGB")) for k in ("two_red", "big")]
    full, spans = expand_images(ids, spec, processed)
    seq = torch.tensor([full])
    expected, deltas = model.model.get_rope_index(seq, (seq == spec.image_token_id).int(),
                                                  torch.tensor([p.grid for p in processed]))
    positions, delta = mrope_positions(len(full), spans, processed, spec.merge)
    assert torch.equal(positions, expected[:, 0]) and delta == int(deltas[0]) and delta < 0
    text_only, zero = mrope_positions(5, [], [], spec.merge)
    assert torch.equal(text_only, torch.arange(5).expand(3, 5)) and zero == 0


def test_each_form_of_image_gives_the_logprobs_of_a_fresh_forward(vlm, vlm_model_dir, images):
    _, tokenizer, _, spec = vlm
    e = engine(vlm_model_dir, cache_tokens=0)
    ids = tokenizer.encode(PROMPT)
    raw = images["two_red"].read_bytes()
    encoded = base64.b64encode(raw).decode()
    forms = [str(images["two_red"]), images["two_red"].as_uri(), "data:image/png;base64," + encoded, encoded]
    answers = [generate(e, ids, form, logprob_start_len=0) for form in forms]
    prompt_lp, output_lp = reference(vlm, ids, [images["two_red"]], answers[0]["output_ids"])
    for answer in answers:
        assert answer["output_ids"] == answers[0]["output_ids"]
        assert torch.allclose(output_logprobs(answer), output_lp, atol=1e-4)
        got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["input_token_logprobs"][1:]])
        assert torch.allclose(got, prompt_lp, atol=1e-4)
    # the prompt already widened to the image's tokens is taken as it is
    widened = answers[0]["meta_info"]["prompt_tokens"]
    pads = widened - len(ids) + 1
    assert pads == 6  # 84x56 pixels: a 6x4 patch grid, merged 2x2
    start = ids.index(spec.image_token_id)
    again = generate(e, ids[:start] + [spec.image_token_id] * pads + ids[start + 1:], str(images["two_red"]))
    assert again["output_ids"] == answers[0]["output_ids"]
    assert torch.allclose(output_logprobs(again), output_lp, atol=1e-4)


def test_two_images_behind_the_same_text_never_share_the_prefix_cache(vlm, vlm_model_dir, images):
    _, tokenizer, _, _ = vlm
    ids = tokenizer.encode("Look: " + PROMPT)
    order = [images["two_red"], images["four_blue"], images["two_red"]]
    cached, plain = engine(vlm_model_dir), engine(vlm_model_dir, cache_tokens=0)
    computed = []
    for path in order:
        before = cached.stats()["prefill_tokens_computed"]
        with_cache, without = generate(cached, ids, str(path)), generate(plain, ids, str(path))
        computed.append(cached.stats()["prefill_tokens_computed"] - before)
        assert torch.allclose(output_logprobs(with_cache), output_logprobs(without), atol=1e-5)
        _, expected = reference(vlm, ids, [path], with_cache["output_ids"])
        assert torch.allclose(output_logprobs(with_cache), expected, atol=1e-4)
    prompt_tokens = len(ids) - 1 + 6
    text_before = len(tokenizer.encode("Look: <|vision_start|>"))
    # the first image: all of it; the second: everything from its image on; the first again: only the last token
    assert computed == [prompt_tokens, prompt_tokens - text_before, 1]


def test_a_batch_of_images_text_and_n_samples_through_the_server_and_sglang_router(vlm, vlm_model_dir, images,
                                                                                   tmp_path):
    _, tokenizer, _, _ = vlm
    proc, base = start_engine(vlm_model_dir, tmp_path / "engine.log")
    processes = [proc]
    try:
        router, routed = start_router([base], tmp_path / "router.log")
        processes.insert(0, router)
        status, info = call(base, "/model_info")
        assert status == 200 and info["has_image_understanding"] is True
        prompts = [tokenizer.encode(PROMPT), tokenizer.encode("Two: " + PROMPT + PROMPT), tokenizer.encode("Hi ")]
        image_data = [str(images["four_blue"]), [str(images["two_red"]), str(images["big"])], None]
        body = {"input_ids": prompts, "image_data": image_data, "sampling_params": {**GREEDY, "n": 2},
                "return_logprob": True}
        for url in (base, routed):
            status, answers = call(url, "/generate", body)
            assert status == 200, answers
            assert len(answers) == 6
            for k, answer in enumerate(answers):
                ids, refs = prompts[k // 2], image_data[k // 2]
                paths = [] if refs is None else [refs] if isinstance(refs, str) else refs
                _, expected = reference(vlm, ids, paths, answer["output_ids"])
                assert torch.allclose(output_logprobs(answer), expected, atol=1e-4), k
        # the big image was scaled by the processor's rule (at most 112x112 pixels: 16 tokens), not refused
        assert answers[2]["meta_info"]["prompt_tokens"] <= len(prompts[1]) - 2 + 6 + 16

        # Miles' own client batches one loop turn's requests into one /generate, image_data per prompt
        async def through_miles_router():
            router = Router([base])
            await router.start()
            try:
                return await asyncio.gather(*(router.generate(ids, GREEDY, image_data=None if refs is None else
                                                              [refs] if isinstance(refs, str) else refs)
                                              for ids, refs in zip(prompts, image_data)))
            finally:
                await router.close()

        batched_before = call(base, "/server_info")[1]["internal_states"][0]["prefill_batches"]
        for k, answer in enumerate(asyncio.run(through_miles_router())):
            assert answer["output_ids"] == answers[2 * k]["output_ids"]
            assert torch.allclose(output_logprobs(answer), output_logprobs(answers[2 * k]), atol=1e-5)
        assert call(base, "/server_info")[1]["internal_states"][0]["prefill_batches"] == batched_before + 1
    finally:
        for p in processes:
            p.terminate()
        for p in processes:
            p.wait(timeout=10)


@pytest.mark.parametrize("refs, prompt, field, expected", [
    (["broken"], PROMPT, "image_data[0]: ", "not a readable image (image file is truncated)"),
    (["missing"], PROMPT, "image_data[0]: ", "missing: no such file"),
    (["https://example.com/cat.png"], PROMPT, "image_data[0]: ", "web URLs are not fetched"),
    (["two_red", "four_blue"], PROMPT, "image_data: ", "2 image(s) for a prompt with 1 image span(s)"),
    ([], PROMPT, "image_data: ", "0 image(s) for a prompt with 1 image span(s)"),
    (["two_red"], "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>", "input_ids: ",
     "image 0 spans 2 <|image_pad|> tokens; expected 1 (widened by the engine) or 6"),
    (["two_red"], "<|image_pad|>x", "input_ids: ", "are not between a <|vision_start|>"),
    ([7], PROMPT, "image_data: ", "expected an image (a path"),
])
def test_bad_image_input_is_refused_naming_what_was_wrong(vlm, vlm_model_dir, images, refs, prompt, field, expected):
    _, tokenizer, _, _ = vlm
    e = engine(vlm_model_dir)
    data = [str(images.get(r, images["two_red"].with_name(r))) if isinstance(r, str) and not r.startswith("http")
            else r for r in refs]
    with pytest.raises(ValueError) as refused:
        e.prepare(tokenizer.encode(prompt), GREEDY, image_data=data)
    assert str(refused.value).startswith(field) and expected in str(refused.value)
    assert e.stats()["requests_finished"] == 0


def test_images_to_a_text_only_model_are_refused(tiny_model_dir, images):
    e = engine(tiny_model_dir)
    with pytest.raises(ValueError, match="this model takes no images"):
        e.prepare([3, 4, 5], GREEDY, image_data=str(images["two_red"]))


def test_a_weight_update_reaches_the_vision_tower(vlm, vlm_model_dir, images):
    model, tokenizer, _, _ = vlm
    e = engine(vlm_model_dir, cache_tokens=0)
    ids = tokenizer.encode(PROMPT)
    before = generate(e, ids, str(images["two_red"]))
    noise = torch.Generator().manual_seed(1)
    changed = {name: (t + 0.05 * torch.randn(t.shape, generator=noise) if "visual" in name else t.clone())
               for name, t in model.state_dict().items()}
    e.update_weights(changed, weight_version=1)
    after = generate(e, ids, str(images["two_red"]))
    assert not torch.allclose(output_logprobs(before), output_logprobs(after), atol=1e-4)
    moved = AutoModelForImageTextToText.from_pretrained(vlm_model_dir).eval()
    moved.load_state_dict(changed)
    _, expected = reference((moved, *vlm[1:]), ids, [images["two_red"]], after["output_ids"])
    assert torch.allclose(output_logprobs(after), expected, atol=1e-4)
    assert after["meta_info"]["weight_version"] == 1


def test_a_held_prefix_that_ends_inside_an_image_is_not_used_past_the_image_start(vlm, vlm_model_dir, images):
    """A cache of 10 tokens holds the prompt's first 10: 7 of text, 3 of the image's 6. The second request starts
    from the 7 (the vision tower encodes an image whole), not from the 10."""
    _, tokenizer, _, _ = vlm
    ids = tokenizer.encode("Look: " + PROMPT)
    text_before = len(tokenizer.encode("Look: <|vision_start|>"))
    e = engine(vlm_model_dir, cache_tokens=text_before + 3)
    first = generate(e, ids, str(images["two_red"]))
    before = e.stats()["prefill_tokens_computed"]
    second = generate(e, ids, str(images["two_red"]))
    assert e.stats()["prefill_tokens_computed"] - before == first["meta_info"]["prompt_tokens"] - text_before
    _, expected = reference(vlm, ids, [images["two_red"]], second["output_ids"])
    assert torch.allclose(output_logprobs(second), expected, atol=1e-4)


def test_image_tokens_are_never_sampled(vlm, vlm_model_dir, images):
    """Hot sampling from a random model would draw one of them about once in 35 tokens (200 tokens without one: a
    chance of 0.3%); an image token is an image only where a prompt puts one."""
    _, tokenizer, _, spec = vlm
    e = engine(vlm_model_dir, cache_tokens=0)
    hot = {"max_new_tokens": 200, "temperature": 5.0, "ignore_eos": True}
    answer = asyncio.run(e.generate(tokenizer.encode(PROMPT), hot, True, image_data=str(images["two_red"])))
    assert len(answer["output_ids"]) == 200 and not set(answer["output_ids"]) & set(spec.never_generated)


def test_processed_images_are_kept_by_reference_until_the_file_changes(vlm, images, tmp_path):
    from miles.engine.image_input import ImageCache

    _, _, processor, _ = vlm
    path = tmp_path / "picture.png"
    path.write_bytes(png_bytes(draw_dots(2, "red")))
    cache = ImageCache(processor)
    first = cache.get(str(path))
    assert cache.get(str(path)) is first and (cache.hits, cache.misses) == (1, 1)
    path.write_bytes(png_bytes(draw_dots(3, "blue")))  # the same name, another picture
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert cache.get(str(path)).digest != first.digest and cache.misses == 2
    url = "data:image/png;base64," + base64.b64encode(png_bytes(draw_dots(1, "green"))).decode()
    small = ImageCache(processor, max_bytes=first.pixel_values.nbytes)  # room for one picture
    held = small.get(url)
    small.get(str(path))
    assert small.get(url) is not held and small.misses == 3  # the least recently used went
