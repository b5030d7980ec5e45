"""Helpers for tests of vision-language models: images drawn with Pillow, and samples a tiny VLM's engine generated
from them (for a backend's log-prob checks: its training log-probs must equal the samples' rollout log-probs)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

VISION_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>How many dots? "


def draw_dots(dots: int, color: str, size: tuple[int, int] = (84, 56)) -> Any:
    """A white ``PIL.Image.Image`` of ``size`` with ``dots`` dots of ``color`` in a row."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, "white")
    pen = ImageDraw.Draw(image)
    for i in range(dots):
        pen.ellipse((4 + i * 14, 18, 14 + i * 14, 28), fill=color)
    return image


def png_bytes(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def vlm_samples(model_dir: str | Path, folder: str | Path, seed: int = 3) -> list[Any]:
    """Two samples each of three prompts that ``model_dir``'s engine generated (temperature 1): one image (84x56
    pixels, 6 tokens), two images (56x56 and 120x90: 4 and 12 tokens), text only; rewards 0 and 1 in each group.
    The images are written to ``folder``."""
    from PIL import Image

    from miles.engine.local import LocalEngine
    from miles.models.hf import load_image_processor, load_model, load_tokenizer
    from miles.models.vision import expand_images, process_image, vision_spec
    from miles.types import Sample

    paths = []
    for k, (dots, color, size) in enumerate([(2, "red", (84, 56)), (3, "blue", (56, 56)), (1, "green", (120, 90))]):
        paths.append(Path(folder) / f"{k}.png")
        paths[-1].write_bytes(png_bytes(draw_dots(dots, color, size)))
    tokenizer, processor = load_tokenizer(model_dir), load_image_processor(model_dir)
    spec = vision_spec(load_model(model_dir).config)
    engine = LocalEngine(prefix_cache_tokens=0, seed=seed)
    engine.load_model(str(model_dir))
    prompts = [(VISION_PROMPT, [paths[0]]), ("Both: " + VISION_PROMPT + VISION_PROMPT, [paths[1], paths[2]]),
               ("Say hi: ", [])]
    samples = []
    for group, (text, images) in enumerate(prompts):
        ids = tokenizer.encode(text)
        processed = [process_image(processor, Image.open(p).convert("RGB")) for p in images]
        widened, _ = expand_images(ids, spec, processed)
        for index in range(2):
            answer = asyncio.run(engine.generate(ids, {"max_new_tokens": 6, "temperature": 1.0}, True,
                                                 image_data=[str(p) for p in images] or None))
            sample = Sample(prompt_ids=widened, group_index=group, index=index, images=processed, reward=float(index))
            sample.append(answer["output_ids"], [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]],
                          from_policy=True)
            samples.append(sample)
    engine.close()
    return samples
