"""The ``dots`` task, a vision-language model's first recipe: count the dots in a picture drawn at run time.

The ``dots`` data generator draws the pictures (:func:`dots`); the ``dots`` environment (:class:`DotsEnv`) is its
multi-turn variant, which shows a new picture each turn (``configs/vlm_multi_turn.yaml``).
"""

from __future__ import annotations

import random
from typing import Any

from miles import hookimpl
from miles.agentic import Action, EnvContext, StepResult

DOTS_QUESTION = "How many dots?"


def dots(seed: int, size: int = 2000, eval_fraction: float = 0.1, side: int = 56,
         turns: int = 1) -> dict[str, list[dict]]:
    """Images to count: a ``side`` x ``side`` picture cut in a 2 x 2 grid, a dot (of a random colour, size and place)
    in each of 0 to 4 of its cells; the prompt is the image and ``How many dots?`` as a chat message (the image as a
    PNG data URL), the label the count. With Qwen2.5-VL's 28-pixel tokens, a 56-pixel picture is one token per cell.
    With ``turns`` > 1, each row's ``pictures`` holds ``turns - 1`` more (``{"image": URL, "count": "N"}``), which
    the ``dots`` environment shows one per turn. No picture appears twice: train and eval never share one."""
    import base64
    import io

    from PIL import Image, ImageDraw

    if size < 2 or not 0 < eval_fraction < 1 or side < 8 or turns < 1:
        raise ValueError("expected size >= 2, eval_fraction in (0, 1), side >= 8, turns >= 1")
    rng, cell = random.Random(seed), side // 2
    colours = ["red", "blue", "green", "black", "orange", "purple"]
    seen: set[bytes] = set()

    def picture() -> tuple[str, str]:
        while True:
            filled = [k for k in range(4) if rng.random() < 0.5]
            image = Image.new("RGB", (side, side), "white")
            pen = ImageDraw.Draw(image)
            for k in filled:
                radius = rng.randint(cell // 5, cell // 3)
                x = (k % 2) * cell + rng.randint(radius, cell - radius)
                y = (k // 2) * cell + rng.randint(radius, cell - radius)
                pen.ellipse((x - radius, y - radius, x + radius, y + radius), fill=rng.choice(colours))
            out = io.BytesIO()
            image.save(out, format="PNG")
            if out.getvalue() not in seen:
                seen.add(out.getvalue())
                return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode(), str(len(filled))

    rows = []
    for _ in range(size):
        url, count = picture()
        row = {"prompt": [{"role": "user", "content": [{"type": "image", "image": url},
                                                       {"type": "text", "text": DOTS_QUESTION}]}], "label": count}
        if turns > 1:
            row["pictures"] = [dict(zip(("image", "count"), picture())) for _ in range(turns - 1)]
        rows.append(row)
    n_eval = max(1, round(len(rows) * eval_fraction))
    return {"eval": rows[:n_eval], "train": rows[n_eval:]}



class DotsEnv:
    """Registered as env ``dots``: the prompt's picture first, then each of its row's ``pictures`` (the ``dots``
    generator with ``turns`` > 1), one per user message after each answer. Each answer is scored against its
    picture's count; the reward is the share of pictures counted right."""

    tools: list[dict[str, Any]] = []

    def __init__(self, ctx: EnvContext) -> None:
        self.counts: list[str] = []
        self.pictures: list[dict[str, str]] = []
        self.turn = self.right = 0

    async def reset(self, sample: Any) -> None:
        pictures = sample.metadata.get("data", {}).get("pictures")
        if not isinstance(pictures, list) or not all(isinstance(p, dict) and {"image", "count"} <= set(p)
                                                     for p in pictures):
            raise ValueError(f"env dots: the sample's data row has no 'pictures' list of {{image, count}} (got "
                             f"{type(pictures).__name__}); the dots data generator writes it with turns >= 2")
        self.counts = [str(sample.label)] + [str(p["count"]) for p in pictures]
        self.pictures = pictures
        return None  # the sample's prompt: its first picture

    async def step(self, action: Action) -> StepResult:
        self.right += action.text.strip() == self.counts[self.turn]
        self.turn += 1
        if self.turn == len(self.counts):
            return StepResult(reward=self.right / len(self.counts), done=True)
        picture = self.pictures[self.turn - 1]["image"]
        return StepResult(observation={"role": "user", "content": [{"type": "image", "image": picture},
                                                                   {"type": "text", "text": DOTS_QUESTION}]})

    async def close(self) -> None:
        pass


@hookimpl(trylast=True)
def miles_register_data_generators(register):
    register("dots", dots)


@hookimpl(trylast=True)
def miles_register_envs(register):
    register("dots", DotsEnv)
