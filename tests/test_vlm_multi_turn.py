"""Images in multi-turn trajectories of a vision-language model (a tiny Qwen2.5-VL): an environment that shows a
new picture each turn, the ``multi_turn`` rollout function on the real engine, and the session server through the
real ``openai`` client. Every generated token's log-prob is checked against a fresh ``transformers`` forward over
the whole trajectory (positions by the model's own ``get_rope_index``), and against the torch backend's."""

import asyncio
import base64

import openai
import pytest
import torch
from openai import AsyncOpenAI
from transformers import AutoModelForImageTextToText

from miles.agentic.chat import Conversation
from miles.agentic.types import StepResult
from miles.engine.local import LocalEngine
from miles.models.hf import load_tokenizer
from miles.models.images import ImageProblem
from miles.models.vision import ImageEncoder, expand_images, image_spans, vision_spec
from miles.rollout.context import RolloutContext
from miles.rollout.multi_turn import MultiTurn
from miles.session.server import SessionServer
from miles.testing.vision import draw_dots, png_bytes
from miles.train.torch_backend import TorchBackend
from miles.types import Sample, SampleStatus, TrainBatch

COLOURS = ["red", "blue", "green", "black"]


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def refs(folder):
    """The same four pictures (1..4 dots; 84x56, 56x56, 84x56, 112x84 pixels) named in each form an image may take."""
    sizes = [(84, 56), (56, 56), (84, 56), (112, 84)]
    pictures = [draw_dots(k + 1, COLOURS[k], sizes[k]) for k in range(4)]
    paths = []
    for k, picture in enumerate(pictures):
        paths.append(folder / f"{k}.png")
        paths[-1].write_bytes(png_bytes(picture))
    return {"object": pictures, "data_url": [data_url(p) for p in pictures], "path": [str(p) for p in paths],
            "base64": [base64.b64encode(png_bytes(p)).decode() for p in pictures]}


def user(ref, text="How many dots? "):
    return {"role": "user", "content": [{"type": "image", "image": ref}, {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def vlm(vlm_model_dir):
    model = AutoModelForImageTextToText.from_pretrained(vlm_model_dir).eval()
    return model, load_tokenizer(vlm_model_dir), ImageEncoder.of(vlm_model_dir), vision_spec(model.config)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    return refs(tmp_path_factory.mktemp("pictures"))


def reference(vlm, ids, images):
    """Log-probs of ``ids[1:]`` under a fresh ``transformers`` forward with ``images`` in the spans, from the
    distribution without the image tokens (as a policy samples)."""
    model, _, _, spec = vlm
    seq = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=seq, mm_token_type_ids=(seq == spec.image_token_id).int(),
                       pixel_values=torch.cat([i.pixel_values for i in images]),
                       image_grid_thw=torch.tensor([i.grid for i in images])).logits[0].float()
    masked = logits.index_fill(-1, torch.tensor(spec.never_generated), float("-inf")).log_softmax(-1)
    return masked.gather(1, seq[0, 1:, None]).squeeze(1)


@pytest.mark.parametrize("form", ["object", "data_url", "path", "base64"])
def test_turns_with_images_are_the_widened_rendering_of_the_whole_conversation(vlm, pictures, form):
    """Token in, token out with images in the history: the first prompt, the generated turns and each observation's
    suffix join into exactly the chat template's rendering of the whole conversation, each image span widened to its
    image, and the conversation holds the images in the order of their spans."""
    _, tokenizer, encoder, spec = vlm
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    conversation = Conversation(tokenizer, [user(pictures[form][0])], images=encoder)
    ids = list(conversation.prompt_ids)
    messages = [user(pictures[form][0])]
    for turn, answer in enumerate(["1", "22", "3"], start=1):
        generated = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        ids += generated
        conversation.add_policy_turn({"role": "assistant", "content": answer}, generated)
        messages += [{"role": "assistant", "content": answer}, user(pictures[form][turn], "And now? ")]
        ids += conversation.extend([messages[-1]])
    assert ids[-1] != eot and generated[-1] == eot
    expected = [encoder.load(pictures["object"][k]) for k in range(4)]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    widened, spans = expand_images(tokenizer.encode(rendered, add_special_tokens=False), spec, expected)
    assert ids == widened
    assert [i.digest for i in conversation.images] == [i.digest for i in expected]
    assert [end - start for start, end in spans] == [6, 4, 6, 12]  # each picture's own width
    assert [i.ref.startswith("data:") for i in conversation.images] == [form != "path"] * 4
    # a trajectory that re-renders (rollout.tito.on_mismatch: split or retokenize) gets every image again, in order
    conversation.add_policy_turn({"role": "assistant", "content": "4"},
                                 tokenizer.encode("4<|im_end|>", add_special_tokens=False))
    again = conversation.resync([user(pictures[form][0], "Again? ")])
    messages += [{"role": "assistant", "content": "4"}, user(pictures[form][0], "Again? ")]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected += expected[:1]
    assert again == expand_images(tokenizer.encode(rendered, add_special_tokens=False), spec, expected)[0]
    assert [i.digest for i in conversation.images] == [i.digest for i in expected]


def test_an_observation_whose_image_cannot_be_read_is_named(vlm, pictures, tiny_model_dir):
    _, tokenizer, encoder, _ = vlm
    conversation = Conversation(tokenizer, [user(pictures["path"][0])], images=encoder)
    conversation.add_policy_turn({"role": "assistant", "content": "1"})
    with pytest.raises(ImageProblem, match=r"message 2 \(user\), image 1: .*no such file"):
        conversation.extend([user("missing.png")])
    assert len(conversation.messages) == 2 and len(conversation.images) == 1  # nothing of the refused turn stays
    with pytest.raises(ImageProblem, match=r"message 2 \(user\), image 1: .*web URLs are not fetched"):
        conversation.extend([user("https://example.com/a.png")])
    text_tokenizer = load_tokenizer(tiny_model_dir)
    with pytest.raises(ImageProblem, match=r"message 0 \(user\) holds an image and the model is text-only"):
        Conversation(tokenizer, [user(pictures["path"][0])], images=None)
    assert ImageEncoder.of(tiny_model_dir) is None and text_tokenizer is not None


class PictureEnv:
    """Shows a new picture each turn, named in the form ``forms[turn]``; the reward is the share of turns answered
    with the picture's count of dots. Ends after ``len(forms)`` turns."""

    tools: list = []

    def __init__(self, ctx, pictures=None, forms=("object", "data_url", "path")):
        self.pictures, self.forms, self.turn, self.right = pictures, forms, 0, 0

    def show(self, text):
        return [user(self.pictures[self.forms[self.turn]][self.turn], text)]

    async def reset(self, sample):
        return self.show("How many dots? ")

    async def step(self, action):
        self.right += action.text.strip() == str(self.turn + 1)
        self.turn += 1
        if self.turn == len(self.forms):
            return StepResult(reward=self.right / self.turn, done=True)
        return StepResult(observation=self.show("And now? "))

    async def close(self):
        pass


@pytest.fixture(scope="module")
def trajectories(vlm_model_dir, vlm, pictures):
    """Four trajectories of three turns each, generated by the real engine (prefix cache on) at temperature 1. A
    random model may end a turn with EOS, which the template renders as <|im_end|>: such a turn is re-rendered
    (rollout.tito.on_mismatch: retokenize), so that every trajectory goes on with the images of its history."""
    engine = LocalEngine(seed=1, prefix_cache_tokens=4096)
    engine.load_model(str(vlm_model_dir))
    ctx = RolloutContext(engine=engine, tokenizer=vlm[1], sampling_params={"max_new_tokens": 3, "temperature": 1.0},
                         env=lambda env_ctx: PictureEnv(env_ctx, pictures), images=vlm[2],
                         tito_on_mismatch="retokenize")
    rollout = MultiTurn(max_turns=3)

    async def run():
        return await asyncio.gather(*(rollout(Sample(prompt_ids=[], index=k), ctx) for k in range(4)))

    samples = asyncio.run(run())
    stats = (engine.image_cache.hits, engine.image_cache.misses)
    engine.close()
    return samples, stats


def test_a_multi_turn_trajectory_holds_each_turns_picture_and_the_engines_logprobs(vlm, pictures, trajectories):
    samples, (hits, misses) = trajectories
    _, _, encoder, spec = vlm
    expected = [encoder.load(pictures["object"][k]) for k in range(3)]
    for sample in samples:
        # a random tiny model seldom ends a turn itself: cut turns go on (on_cut_turn: env)
        assert sample.status is not SampleStatus.FAILED and sample.turns == 3, sample.reason
        ids = sample.prompt_ids + sample.response_ids
        spans = image_spans(ids, spec)
        assert [i.digest for i in sample.images] == [i.digest for i in expected]
        assert [end - start for start, end in spans] == [i.tokens(spec.merge) for i in expected]
        mask = [0] * len(sample.prompt_ids) + sample.loss_mask
        assert all(mask[k] == 0 for start, end in spans for k in range(start - 1, end + 1))
        assert not set(spec.never_generated) & {t for t, m in zip(sample.response_ids, sample.loss_mask) if m}
        # every generated token, whatever turn: the engine's log-prob is a fresh forward's over the whole trajectory
        ref = reference(vlm, ids, sample.images)[len(sample.prompt_ids) - 1:]
        generated = torch.tensor(sample.loss_mask).bool()
        assert generated.sum() >= 3
        got = torch.tensor(sample.rollout_logprobs)[generated]
        assert torch.allclose(got, ref[generated], atol=1e-5), (got - ref[generated]).abs().max()
    # each turn sends the trajectory's pictures so far; the engine processes each picture once (the four
    # trajectories show the same three)
    assert (misses, hits) == (3, 4 * (1 + 2 + 3) - 3)


def test_training_logprobs_of_multi_turn_image_trajectories_equal_the_engines(vlm_model_dir, trajectories):
    samples, _ = trajectories
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    assert [len(i) for i in batch.images] == [3] * 4
    backend = TorchBackend(lr=1e-2, micro_batch_size=2)
    backend.setup(str(vlm_model_dir), seed=0)
    logprobs = backend.compute_logprobs(batch)
    mask = batch.loss_mask.bool()
    assert torch.allclose(logprobs[mask], batch.rollout_logprobs[mask], atol=1e-4), \
        (logprobs[mask] - batch.rollout_logprobs[mask]).abs().max()


def test_the_session_server_takes_openai_image_parts(vlm_model_dir, vlm, pictures, tiny_model_dir):
    """Through the real ``openai`` client: two completions, a new picture in each user message; the session's tokens
    hold both pictures, every generated token's log-prob is a fresh forward's, and bad images are refused by name."""
    _, tokenizer, encoder, spec = vlm
    engine = LocalEngine(seed=0, prefix_cache_tokens=4096)
    engine.load_model(str(vlm_model_dir))

    def part(url, text):
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                                            {"type": "text", "text": text}]}

    async def conversation():
        server = SessionServer(engine, tokenizer, None, {"max_new_tokens": 3, "temperature": 1.0}, images=encoder)
        url = await server.start()
        session = server.open()
        try:
            async with AsyncOpenAI(base_url=f"{url}/sessions/{session.id}/v1", api_key="unused",
                                   max_retries=0) as client:
                messages = [part(pictures["data_url"][0], "How many dots? ")]
                first = await client.chat.completions.create(model="policy", messages=messages)
                messages += [first.choices[0].message, part(pictures["path"][1], "And now? ")]
                second = await client.chat.completions.create(model="policy", messages=messages)
                with pytest.raises(openai.BadRequestError) as missing:
                    await client.chat.completions.create(model="policy", messages=messages + [
                        second.choices[0].message, part("/nowhere/x.png", "And?")])
                with pytest.raises(openai.BadRequestError) as web_url:
                    await client.chat.completions.create(model="policy", messages=messages + [
                        second.choices[0].message, part("https://example.com/x.png", "And?")])
                with pytest.raises(openai.BadRequestError) as audio:
                    await client.chat.completions.create(model="policy", messages=messages + [
                        second.choices[0].message, {"role": "user", "content": [
                            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])
            return session.trajectory(), session, missing.value, web_url.value, audio.value
        finally:
            await server.stop()

    trajectory, session, missing, web_url, audio = asyncio.run(conversation())
    engine.close()
    assert trajectory["turns"] == 2 and len(trajectory["images"]) == 2
    assert trajectory["images"][1] == pictures["path"][1]
    ids = trajectory["prompt_ids"] + trajectory["response_ids"]
    assert [end - start for start, end in image_spans(ids, spec)] == [6, 4]
    ref = reference(vlm, ids, session.images)[len(trajectory["prompt_ids"]) - 1:]
    generated = torch.tensor(trajectory["loss_mask"]).bool()
    got = torch.tensor(trajectory["logprobs"])[generated]
    assert torch.allclose(got, ref[generated], atol=1e-5), (got - ref[generated]).abs().max()
    assert missing.code == "invalid_image" and "message 4 (user), image 1: /nowhere/x.png: no such file" in str(missing)
    assert "web URLs are not fetched" in str(web_url)
    assert "messages[4].content[0]: expected a text part" in str(audio) and "image part" in str(audio)


def test_a_text_only_models_session_refuses_images(chat_model_dir, pictures):
    engine = LocalEngine(seed=0)
    engine.load_model(str(chat_model_dir))

    async def ask():
        server = SessionServer(engine, engine.tokenizer, None, {"max_new_tokens": 2})
        url = await server.start()
        session = server.open()
        try:
            async with AsyncOpenAI(base_url=f"{url}/sessions/{session.id}/v1", api_key="unused",
                                   max_retries=0) as client:
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": pictures["data_url"][0]}}]}])
            return refused.value, session
        finally:
            await server.stop()

    refused, session = asyncio.run(ask())
    engine.close()
    assert refused.code == "invalid_image"
    assert "message 0 (user) holds an image and the model is text-only" in str(refused)
    assert session.turns == 0 and session.conversation is None
