"""Images in prompts and observations: where a chat message holds them, how one named in data is read, and the
rules a bad one meets.

A message's ``content`` may be a list of parts, as OpenAI's API and HF chat templates write them. An image part is
``{"type": "image", "image": REF}`` (HF; ``"url"`` or ``"path"`` instead of ``"image"`` too) or
``{"type": "image_url", "image_url": {"url": REF}}`` (OpenAI; the bare string form too). ``REF`` is one of

- a path, relative to the data file's folder (or absolute), or a ``file://`` URL;
- a data URL, ``data:image/png;base64,...``;
- bare base64 of an image file's bytes;
- in an environment's observation (never in a data file), a ``PIL.Image.Image``.

Web URLs are refused: a run reads nothing from the network. Every image is decoded whole when it is read (a
truncated or corrupt file is an error, never half an image), and then:

- its mode becomes RGB (an alpha channel is composited on white; palette, greyscale, CMYK and 16-bit images
  are converted);
- one larger than ``max_pixels`` is scaled down, keeping its aspect ratio, to at most that many pixels (bicubic);
  one of more than :data:`MAX_DECODE_PIXELS` is refused before it is decoded (a decompression bomb);
- one smaller than ``min_side`` pixels on a side is refused (a vision encoder's patch needs that many).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ImageProblem", "LoadedImage", "MAX_DECODE_PIXELS", "MAX_PIXELS", "content_text", "image_parts",
           "image_refs", "load_image"]

MAX_PIXELS = 1280 * 28 * 28  # about a megapixel: Qwen2.5-VL's processor's usual max_pixels in RL recipes
MIN_SIDE = 4
MAX_DECODE_PIXELS = 16 * 4096 * 4096  # larger images are refused before decoding
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]+")


class ImageProblem(ValueError):
    """An image that cannot be read; the message says why and what was expected."""


@dataclass(frozen=True)
class LoadedImage:
    """An image as a run uses it: RGB pixels (a ``PIL.Image.Image``), and where it came from (for messages)."""

    image: Any
    source: str
    resized_from: tuple[int, int] | None = None  # (width, height) before it was scaled down to max_pixels

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def image_parts(message: Any) -> Iterator[dict[str, Any]]:
    """The image parts of one chat message (a dict whose ``content`` is a list of parts), in order."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return
    for part in content:
        if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
            yield part


def content_text(content: Any, sep: str = "") -> str:
    """A message's text: its content, or its text parts' texts joined by ``sep`` (an image part has none)."""
    if isinstance(content, list):
        return sep.join(str(part.get("text") or "") for part in content
                        if isinstance(part, dict) and part.get("type") == "text")
    return str(content or "")


def image_refs(prompt: Any) -> list[Any]:
    """Every image a prompt (text, or a list of chat messages) names, in order: each part's ``REF`` (None where
    an image part names none)."""
    if not isinstance(prompt, list):
        return []
    refs = []
    for message in prompt:
        for part in image_parts(message):
            if part["type"] == "image_url":
                url = part.get("image_url")
                refs.append(url.get("url") if isinstance(url, dict) else url)
            else:
                refs.append(next((part[k] for k in ("image", "url", "path") if part.get(k) is not None), None))
    return refs


def load_image(ref: Any, base_dir: str | Path | None = None, *, max_pixels: int = MAX_PIXELS,
               min_side: int = MIN_SIDE) -> LoadedImage:
    """The image ``ref`` names (see the module's doc), decoded whole, in RGB, within ``max_pixels``; an
    :class:`ImageProblem` says why one cannot be."""
    from PIL import Image

    if isinstance(ref, Image.Image):  # made by an environment: already decoded
        return _fit(_rgb(ref), "an image object", min_side, max_pixels)
    data, source = _read(ref, base_dir)
    try:
        with Image.open(io.BytesIO(data)) as opened:
            width, height = opened.size
            if width * height > MAX_DECODE_PIXELS:
                raise ImageProblem(f"{source}: {width}x{height} pixels, more than the {MAX_DECODE_PIXELS} an image "
                                   f"may have to be decoded at all; scale it down first")
            opened.load()  # the whole file now: a truncated one fails here, not later in the middle of a run
            image = _rgb(opened)
    except ImageProblem:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageProblem(f"{source}: too large to decode ({exc})") from None
    except Image.UnidentifiedImageError:
        raise ImageProblem(f"{source}: not an image file (no format Pillow reads); expected a PNG, JPEG, WebP, GIF "
                           f"or BMP file") from None
    except (OSError, ValueError, SyntaxError) as exc:  # PIL's errors for files it cannot identify or decode
        raise ImageProblem(f"{source}: not a readable image ({exc}); expected a PNG, JPEG, WebP, GIF or BMP "
                           f"file") from None
    return _fit(image, source, min_side, max_pixels)


def _fit(image: Any, source: str, min_side: int, max_pixels: int) -> LoadedImage:
    """``image`` (RGB) checked against ``min_side`` and scaled down to ``max_pixels``."""
    from PIL import Image

    if min(image.size) < min_side:
        raise ImageProblem(f"{source}: {image.size[0]}x{image.size[1]} pixels; expected at least {min_side} on "
                           f"each side")
    resized_from = None
    if image.size[0] * image.size[1] > max_pixels:
        resized_from = image.size
        scale = math.sqrt(max_pixels / (image.size[0] * image.size[1]))
        size = (max(min_side, math.floor(image.size[0] * scale)), max(min_side, math.floor(image.size[1] * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
    return LoadedImage(image, source, resized_from)


def _read(ref: Any, base_dir: str | Path | None) -> tuple[bytes, str]:
    """The bytes ``ref`` names and how to name it in messages."""
    if not isinstance(ref, str) or not ref.strip():
        raise ImageProblem(f"expected an image as a path, a data: URL, base64 text or (from an environment) a "
                           f"PIL image, got {_shown(ref)}")
    if ref.startswith("data:"):
        header, sep, payload = ref.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageProblem(f"data URL {_shown(ref)}: expected data:image/...;base64,<base64 of the file>")
        return _b64(payload, "data URL"), f"data URL ({len(payload)} characters)"
    if ref.startswith(("http://", "https://")):
        raise ImageProblem(f"{_shown(ref)}: web URLs are not fetched (a run reads nothing from the network); "
                           f"download the image and name its path, or embed it as base64")
    path = Path(ref.removeprefix("file://"))
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    looks_like_path = len(ref) < 1024 and ("/" in ref or "." in ref[-6:] or not _BASE64.fullmatch(ref))
    if looks_like_path and _BASE64.fullmatch(ref) and not path.exists() and _image_bytes(ref):
        looks_like_path = False  # short base64 of an image file ('/' is a base64 character)
    try:
        if path.is_file():
            return path.read_bytes(), str(path)
    except OSError as exc:  # e.g. a name too long to be a path
        if looks_like_path:
            raise ImageProblem(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if looks_like_path:
        where = "the data file's folder" if base_dir is not None else "the working directory"
        raise ImageProblem(f"{path}: no such file (a relative path is taken from {where})")
    return _b64(ref, "base64 text"), f"base64 image ({len(ref)} characters)"


_SIGNATURES = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"RIFF", b"BM")  # PNG, JPEG, GIF, WebP, BMP


def _image_bytes(text: str) -> bool:
    """Whether ``text`` is base64 of bytes that start as an image file does."""
    try:
        head = base64.b64decode("".join(text.split())[:16], validate=True)
    except (binascii.Error, ValueError):
        return False
    return head.startswith(_SIGNATURES)


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageProblem(f"{what}: not valid base64 ({exc})") from None


def _rgb(image: Any) -> Any:
    """``image`` in RGB: transparency composited on white, every other mode converted."""
    from PIL import Image

    if image.mode == "RGB":
        return image.copy()
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16- or 32-bit greyscale: to 8 bits first
        return image.point(lambda v: v / 256).convert("L").convert("RGB")
    return image.convert("RGB")


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
