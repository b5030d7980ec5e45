"""What a Qwen2.5-VL-style model needs besides token ids: pixels in patches, image tokens, and 3D positions.

A prompt names each image with a span ``<|vision_start|> <|image_pad|>... <|vision_end|>``. The image processor
cuts an image into patches (``pixel_values [patches, channels * temporal * patch * patch]``) on a grid
``(t, h, w)``; the vision tower merges ``merge x merge`` patches into one token, so the span holds
``t * h * w / merge**2`` pad tokens, whose embeddings the tower's output replaces. A span may also hold a single
pad token (as a chat template writes it): :func:`expand_images` widens it to the image's count, as SGLang does.

Positions are Qwen2-VL's multimodal RoPE: three components (time, height, width). Text tokens carry the same
value in all three, counting on from where the last token left off; an image's tokens carry their grid
coordinates offset by the position where the image starts, and the text after an image resumes at that start
plus the grid's larger side over ``merge``. So a prompt of ``L`` tokens ends at a position other than ``L - 1``:
``delta`` is that difference, and each generated token at index ``i`` sits at ``i + delta`` in all three.

A policy never samples these tokens (:attr:`VisionSpec.never_generated`): an image token in a response would not
stand for an image. The engine samples from the next-token distribution renormalised without them, and the trainer
computes log-probs from the same distribution.

Two prompts that differ only in their images have the same token ids. :func:`cache_key` gives the ids under which
a prefix cache may hold a prompt: each image's pad tokens replaced by negative numbers drawn from the image's
bytes, so equal text before different images never shares K/V past the image's first token.
"""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.lazy import lazy_module
from miles.models.images import load_image

torch = lazy_module("torch")

__all__ = ["ImageEncoder", "ProcessedImage", "VisionSpec", "cache_key", "expand_images", "image_spans",
           "mrope_positions", "process_image", "row_inputs", "vision_spec", "vision_tower"]


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language model's image tokens and geometry, from its config."""

    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    merge: int  # patches merged per side into one token
    video_token_id: int | None = None

    @property
    def never_generated(self) -> list[int]:
        """The tokens that stand for images (and videos): a policy never samples them. The engine samples from the
        next-token distribution without them, and the trainer computes its log-probs the same way."""
        return sorted({self.image_token_id, self.vision_start_id, self.vision_end_id}
                      | ({self.video_token_id} if self.video_token_id is not None else set()))


def vision_spec(config: Any) -> VisionSpec | None:
    """The spec of a Qwen2-VL-family config (Qwen2-VL, Qwen2.5-VL); None for a text-only model."""
    vision = getattr(config, "vision_config", None)
    if vision is None or getattr(config, "image_token_id", None) is None:
        return None
    video = getattr(config, "video_token_id", None)
    return VisionSpec(int(config.image_token_id), int(config.vision_start_token_id), int(config.vision_end_token_id),
                      int(vision.spatial_merge_size), None if video is None else int(video))


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The vision tower of a Qwen2-VL-family model (its ``visual`` module), wrapped or not."""
    for name, module in model.named_modules():
        if name == "visual" or name.endswith(".visual"):
            return module
    raise ValueError(f"{type(model).__name__} has no vision tower (no module named visual)")


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image as the vision tower takes it."""

    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch], float32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    digest: bytes  # of the pixels: equal images, equal digests
    ref: str | None = None  # how an engine is sent the same image: an absolute path or a data URL

    def tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * h * w // (merge * merge)


def process_image(processor: Any, image: Any, ref: str | None = None) -> ProcessedImage:
    """``image`` (an RGB ``PIL.Image.Image``) through the model's image processor; ``ref``: where it came from (an
    absolute path or a data URL; by default a data URL of the image as PNG)."""
    out = processor(images=[image], return_tensors="pt")
    pixels = out["pixel_values"].to(torch.float32).contiguous()
    grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
    digest = hashlib.blake2b(pixels.numpy().tobytes(), digest_size=16, person=b"miles-image").digest()
    if ref is None:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        ref = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return ProcessedImage(pixels, grid, digest, ref)  # type: ignore[arg-type]


class ImageEncoder:
    """A vision-language model's images for prompts and observations: each read
    (:func:`miles.models.images.load_image`), made into the vision tower's input by the model's image processor, and
    its span of the tokens widened to its count."""

    def __init__(self, spec: VisionSpec, processor: Any) -> None:
        self.spec, self.processor = spec, processor

    @classmethod
    def of(cls, model_path: str | Path) -> "ImageEncoder | None":
        """The encoder of the model directory ``model_path``; None for a text-only model."""
        from transformers import AutoConfig

        from miles.models.hf import load_image_processor

        spec = vision_spec(AutoConfig.from_pretrained(model_path))
        return None if spec is None else cls(spec, load_image_processor(model_path))

    def load(self, ref: Any, folder: str | Path | None = None) -> ProcessedImage:
        """The image ``ref`` names (a relative path from ``folder``), processed. Its ``ref`` is what an engine is
        sent: the file's absolute path, the data as it was given, or a PNG data URL of an image object."""
        loaded = load_image(ref, folder)
        if not isinstance(ref, str):
            return process_image(self.processor, loaded.image)
        path = Path(loaded.source)
        if path.is_file():
            return process_image(self.processor, loaded.image, str(path.resolve()))
        data_url = ref if ref.startswith("data:") else "data:image/png;base64," + "".join(ref.split())
        return process_image(self.processor, loaded.image, data_url)

    def encode(self, ids: list[int], refs: list[Any], folder: str | Path | None = None) -> tuple[
            list[int], tuple[ProcessedImage, ...]]:
        """``ids`` widened, and the images ``refs`` name (relative paths from ``folder``), one per image span."""
        images = tuple(self.load(ref, folder) for ref in refs)
        return expand_images(ids, self.spec, list(images))[0], images


def image_spans(ids: list[int], spec: VisionSpec) -> list[tuple[int, int]]:
    """``[start, end)`` of each image's pad tokens in ``ids``, in order. A ValueError names a span that is not
    ``<|vision_start|> <|image_pad|>... <|vision_end|>``."""
    spans, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] == spec.image_token_id:
            start = i
            while i < n and ids[i] == spec.image_token_id:
                i += 1
            if start == 0 or ids[start - 1] != spec.vision_start_id or i == n or ids[i] != spec.vision_end_id:
                raise ValueError(f"input_ids: the image tokens at {start}..{i - 1} are not between a "
                                 f"<|vision_start|> ({spec.vision_start_id}) and a <|vision_end|> "
                                 f"({spec.vision_end_id}) token")
            spans.append((start, i))
        else:
            i += 1
    return spans


def expand_images(ids: list[int], spec: VisionSpec, images: list[ProcessedImage]) -> tuple[list[int],
                                                                                         list[tuple[int, int]]]:
    """``ids`` with each image's span holding its number of tokens, and the spans. A span of one pad token is
    widened; one of exactly the image's count is kept; any other width, or a count of spans other than of images,
    is a ValueError saying what was expected."""
    spans = image_spans(ids, spec)
    if len(spans) != len(images):
        raise ValueError(f"image_data: {len(images)} image(s) for a prompt with {len(spans)} image span(s) "
                         f"(<|vision_start|><|image_pad|><|vision_end|>); expected one image per span, in order")
    out, last, placed = [], 0, []
    for k, ((start, end), image) in enumerate(zip(spans, images)):
        want = image.tokens(spec.merge)
        if end - start not in (1, want):
            raise ValueError(f"input_ids: image {k} spans {end - start} <|image_pad|> tokens; expected 1 (widened "
                             f"by the engine) or {want} (its {image.grid[1]}x{image.grid[2]} patch grid merged "
                             f"{spec.merge}x{spec.merge})")
        out += ids[last:start]
        placed.append((len(out), len(out) + want))
        out += [spec.image_token_id] * want
        last = end
    out += ids[last:]
    return out, placed


def mrope_positions(length: int, spans: list[tuple[int, int]], images: list[ProcessedImage],
                    merge: int) -> tuple[torch.Tensor, int]:
    """Positions ``[3, length]`` of a prompt whose images fill ``spans``, and its ``delta``: a token at index
    ``i >= length`` (generated) sits at ``i + delta`` in all three components."""
    pos = torch.empty((3, length), dtype=torch.long)
    at, cursor = 0, 0  # index in the prompt, position of the next text token
    for (start, end), image in zip(spans, images):
        run = start - at
        pos[:, at:start] = torch.arange(cursor, cursor + run)
        cursor += run
        t, h, w = image.grid[0], image.grid[1] // merge, image.grid[2] // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        pos[:, start:end] = grid.reshape(3, -1) + cursor
        cursor += max(h, w)
        at = end
    pos[:, at:] = torch.arange(cursor, cursor + length - at)
    end_pos = cursor + length - at  # the position the next token takes
    return pos, end_pos - length


def cache_key(ids: list[int], spans: list[tuple[int, int]], images: list[ProcessedImage]) -> list[int]:
    """``ids`` with each image's pad tokens replaced by negative numbers drawn from its digest (see the module)."""
    key = list(ids)
    for (start, end), image in zip(spans, images):
        base = -1 - int.from_bytes(image.digest[:7], "big") * 4096
        key[start:end] = [base - (i % 4096) for i in range(end - start)]
    return key


def row_inputs(spec: VisionSpec, input_ids: torch.Tensor, lengths: list[int],
               images: list[list[ProcessedImage]]) -> dict[str, torch.Tensor]:
    """A training forward's inputs besides ``input_ids`` for right-padded rows (``lengths`` tokens each) whose
    image spans hold ``images``: ``position_ids [3, B, L]`` (padding at 0; causal attention keeps it out of every
    real token's context), and the images' ``pixel_values`` and ``image_grid_thw`` in the order of their tokens.
    A ValueError says which row's images do not match its spans."""
    rows, width = input_ids.shape
    positions = torch.zeros((3, rows, width), dtype=torch.long)
    ordered = []
    for row, (ids, n, mine) in enumerate(zip(input_ids.tolist(), lengths, images)):
        spans = image_spans(ids[:n], spec)
        if len(spans) != len(mine) or any(end - start != image.tokens(spec.merge)
                                          for (start, end), image in zip(spans, mine)):
            raise ValueError(f"row {row}: {len(spans)} image span(s) of "
                             f"{[end - start for start, end in spans]} tokens, but {len(mine)} image(s) of "
                             f"{[image.tokens(spec.merge) for image in mine]} tokens")
        positions[:, row, :n] = mrope_positions(n, spans, mine, spec.merge)[0]
        ordered += mine
    inputs = {"position_ids": positions.to(input_ids.device)}
    if ordered:
        inputs["pixel_values"] = torch.cat([image.pixel_values for image in ordered]).to(input_ids.device)
        inputs["image_grid_thw"] = torch.tensor([image.grid for image in ordered], device=input_ids.device)
    return inputs
