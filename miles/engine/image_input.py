"""SGLang's ``image_data`` for the embedded engine: each image read, processed and placed in its prompt.

``image_data`` of one prompt is an image reference or a list of them, one per image span of the prompt, in order
(:mod:`miles.models.vision`): a path (absolute, or relative to the engine's working directory), a ``file://`` URL,
a data URL or bare base64 of the file's bytes, read and checked by :func:`miles.models.images.load_image` (web
URLs are refused: the engine reads nothing from the network). A span holds one ``<|image_pad|>`` token, widened
here to the image's count, or that count already. Processed images are kept by what names them
(:class:`ImageCache`): a multi-turn trajectory sends its history's images with every turn, and the ``n`` samples
of a prompt send the same ones.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Any

from miles.engine.request import Request
from miles.lazy import lazy_module
from miles.models.images import ImageProblem, load_image
from miles.models.vision import ProcessedImage, VisionSpec, cache_key, expand_images, mrope_positions, process_image

torch = lazy_module("torch")

__all__ = ["MAX_IMAGES", "ImageCache", "attach_images", "image_list", "prefill_vision_inputs"]

MAX_IMAGES = 64  # per prompt


def image_list(image_data: Any) -> list[str]:
    """One prompt's ``image_data`` as a list of references (a ValueError says what was expected)."""
    refs = [image_data] if isinstance(image_data, str) else image_data
    if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
        raise ValueError("image_data: expected an image (a path, a file:// URL, a data URL or base64) or a list of "
                         "them, one per image in the prompt")
    if len(refs) > MAX_IMAGES:
        raise ValueError(f"image_data: {len(refs)} images for one prompt; at most {MAX_IMAGES}")
    return refs


class ImageCache:
    """Images as the model's ``processor`` made them, by reference, the most recently used kept up to ``max_bytes``
    of pixels. A path is known by its name, modification time and size (a file written again is read again); any
    other reference by its text."""

    def __init__(self, processor: Any, max_bytes: int = 256 << 20) -> None:
        self.processor, self.max_bytes = processor, max_bytes
        self._held: OrderedDict[tuple[bytes, int, int], ProcessedImage] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def get(self, ref: str) -> ProcessedImage:
        """The image ``ref`` names, processed (an :class:`ImageProblem` says why it cannot be read)."""
        key = self._key(ref)
        image = self._held.get(key)
        if image is not None:
            self._held.move_to_end(key)
            self.hits += 1
            return image
        self.misses += 1
        image = process_image(self.processor, load_image(ref).image, ref)
        size = image.pixel_values.nbytes
        if size <= self.max_bytes:
            self._held[key] = image
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._bytes -= self._held.popitem(last=False)[1].pixel_values.nbytes
        return image

    @staticmethod
    def _key(ref: str) -> tuple[bytes, int, int]:
        digest = hashlib.blake2b(ref.encode(), digest_size=16).digest()
        if len(ref) < 4096:
            try:
                stat = os.stat(ref.removeprefix("file://"))
                return digest, stat.st_mtime_ns, stat.st_size
            except (OSError, ValueError):
                pass
        return digest, 0, 0


def attach_images(request: Request, image_data: Any, vision: VisionSpec | None, images_of: ImageCache | None) -> None:
    """Read ``image_data`` (None: no images) into ``request``: its prompt widened, its images, positions and
    cache key. A text prompt to a vision-language model gets plain positions; images to a text-only model are a
    ValueError."""
    refs = [] if image_data is None else image_list(image_data)
    if vision is None or images_of is None:
        if refs:
            raise ValueError("image_data: this model takes no images (its config has no vision tower)")
        return
    images = []
    for k, ref in enumerate(refs):
        try:
            images.append(images_of.get(ref))
        except ImageProblem as exc:
            raise ValueError(f"image_data[{k}]: {exc}") from exc
    request.prompt, request.spans = expand_images(request.prompt, vision, images)
    request.images = images
    request.positions, request.delta = mrope_positions(len(request.prompt), request.spans, images, vision.merge)
    request.key = cache_key(request.prompt, request.spans, images) if images else None


def prefill_vision_inputs(rows: list[Request], held: list[int], width: int,
                          device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """For a prefill of ``rows`` whose first ``held`` tokens come from the prefix cache: the multimodal positions
    ``[3, rows, width]`` of their suffixes (left-padded as the suffixes are), and the pixels and patch grids of the
    images in those suffixes, in the order their tokens come (a held prefix never ends inside an image)."""
    positions = torch.zeros((3, len(rows), width), dtype=torch.long)
    images = []
    for u, (r, h) in enumerate(zip(rows, held)):
        positions[:, u, width - (len(r.prompt) - h):] = r.positions[:, h:]
        images += [image for (start, _), image in zip(r.spans, r.images) if start >= h]
    if not images:
        return positions.to(device), {}
    pixels = torch.cat([image.pixel_values for image in images]).to(device)
    grids = torch.tensor([image.grid for image in images], device=device)
    return positions.to(device), {"pixel_values": pixels, "image_grid_thw": grids}
