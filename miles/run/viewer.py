"""The trajectory viewer's pages: a run's ``trajectories/step_*.jsonl`` (:mod:`miles.loop.trajectories`) as HTML.

One renderer for both ways of showing them: every page is the same shell, its data embedded as JSON and
``viewer.js`` and ``viewer.css`` (beside this module) inlined, so that a page needs nothing else, no network
either. ``miles view`` (:mod:`miles.run.viewer_server`) makes the pages at each request, so a run still being
written shows its new steps on reload; ``miles report`` writes them once into ``report/trajectories/`` with
:func:`write_viewer`, files a browser opens from disk.

What one page holds is bounded, whatever the size of a step file: a step is shown :data:`PAGE_SAMPLES` samples a
page (fewer when their lines pass :data:`PAGE_BYTES`), each file is read once per version into a
:class:`StepSummary` (its counts and means, where each page's lines start, the lines that cannot be read), and a
page reads only its own lines. A line that is not a sample (cut short, not JSON, not UTF-8, not an object) is left
out and named, file and line, on the index and on the step's pages; the rest is shown.

An image is shown from a data URL of an image, or from a file whose real path (symlinks followed) lies inside the
run directory and that is a PNG, JPEG, GIF, WebP or BMP file: a relative path is taken from the run directory,
never from the working directory, and any other file a trajectory names is not shown, served or copied (the run
keeps a copy of each image file its samples name, ``image_files``). The two ways differ only in where the page
finds such a file: the server's ``image?path=`` (checked again at each request) or a copy beside the pages.
"""

from __future__ import annotations

import hashlib
import html
import json
import math
import os
import re
import stat
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from miles.run.trajectory_files import (PAGE_BYTES, PAGE_SAMPLES, PageSpan, RunTrajectories, StepSummary, Unreadable,
                                        reward_value, step_file)

__all__ = ["RunTrajectories", "StepSummary", "PageSpan", "Unreadable", "ImageRefused", "run_image", "index_page",
           "step_page", "step_file", "write_viewer", "completions_section", "reward_value", "PAGE_SAMPLES",
           "PAGE_BYTES"]

ImageSource = Callable[[Path, str], str]  # an image file inside the run and its MIME type -> the page's src


class ImageRefused(Exception):
    """Why an image file a trajectory names is not shown (the message says)."""


_IMAGE_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png", ".png"), (b"\xff\xd8\xff", "image/jpeg", ".jpg"),
                     (b"GIF87a", "image/gif", ".gif"), (b"GIF89a", "image/gif", ".gif"), (b"BM", "image/bmp", ".bmp"))
_EXTENSIONS = {kind: suffix for _, kind, suffix in _IMAGE_SIGNATURES} | {"image/webp": ".webp"}


def _image_type(head: bytes) -> str | None:
    """The MIME type of an image file that starts with ``head``; None when it is none of the kinds a run reads (no
    SVG: a page's own origin must never hold a document that runs script)."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return next((kind for signature, kind, _ in _IMAGE_SIGNATURES if head.startswith(signature)), None)


def run_image(root: Path, name: str) -> tuple[Path, str]:
    """The image file ``name`` names and its MIME type, where ``root`` is the run directory's real path: ``name``
    is relative to ``root`` (never to the working directory), absolute or a ``file://`` URL. :class:`ImageRefused`
    unless the file's real path (every symlink followed) lies inside ``root`` and it is a PNG, JPEG, GIF, WebP or
    BMP file."""
    try:
        path = Path(os.path.realpath(root / name.removeprefix("file://")))
    except (OSError, ValueError):  # a NUL byte, a name too long
        raise ImageRefused("not a path") from None
    if not path.is_relative_to(root):
        raise ImageRefused("outside the run directory (only its files are shown)")
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a folder, a FIFO that would hold the reader
            raise ImageRefused("not a file")
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        raise ImageRefused("no such file in the run directory") from None
    kind = _image_type(head)
    if kind is None:
        raise ImageRefused("not a PNG, JPEG, GIF, WebP or BMP file")
    return path, kind


_IMAGE_PARTS = {"image", "image_url", "input_image"}
_IMAGE_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,")


def _without_images(value: Any) -> Any:
    """A prompt with each image part as ``{"type": "image"}``: the images are shown from ``images``, and a data
    URL need not be in the page twice."""
    if isinstance(value, list):
        return [_without_images(v) for v in value]
    if isinstance(value, dict):
        if value.get("type") in _IMAGE_PARTS:
            return {"type": "image"}
        return {k: _without_images(v) for k, v in value.items()}
    return value


def _image_label(ref: str) -> str:
    if ref.startswith("data:"):
        return f"{ref.partition(',')[0]} ({len(ref):,} characters)"
    return ref


def _page_images(record: dict[str, Any], root: Path, image_src: ImageSource) -> list[dict[str, Any]]:
    """A sample's images as the page shows them: each its label, its src or why it has none."""
    refs = record.get("images") if isinstance(record.get("images"), list) else []
    copies = record.get("image_files") if isinstance(record.get("image_files"), list) else []
    shown = []
    for i, ref in enumerate(refs):
        if not isinstance(ref, str):
            continue
        copy = copies[i] if i < len(copies) and isinstance(copies[i], str) else None
        src = why = None
        if copy is None and ref.startswith("data:"):
            src = ref if _IMAGE_DATA_URL.match(ref) else None
            why = None if src else "a data URL that is not a base64 image"
        else:
            try:
                src = image_src(*run_image(root, copy or ref))
            except ImageRefused as exc:
                why = str(exc)
            except OSError as exc:  # gone or unreadable since it was checked
                why = f"cannot be read ({exc.strerror or exc})"
        shown.append({"ref": _image_label(ref), "src": src, "why": why})
    return shown


def _page_sample(record: dict[str, Any], root: Path, image_src: ImageSource) -> dict[str, Any]:
    sample = dict(record)
    sample["prompt"] = _without_images(record.get("prompt"))
    sample["images"] = _page_images(record, root, image_src)
    for key in ("tokens", "prompt_tokens", "loss_mask", "tool_calls"):
        sample[key] = record[key] if isinstance(record.get(key), list) else []
    sample["tokens"] = [t if isinstance(t, str) else str(t) for t in sample["tokens"]]
    sample["prompt_tokens"] = [t if isinstance(t, str) else str(t) for t in sample["prompt_tokens"]]
    sample["tool_calls"] = [call for call in sample["tool_calls"] if isinstance(call, dict)]
    return sample


def _asset(name: str) -> str:
    return resources.files("miles.run").joinpath(name).read_text(encoding="utf-8")


def _finite(value: Any) -> Any:
    """``value`` with each NaN or infinity as the string JavaScript spells it (``NaN``, ``Infinity``,
    ``-Infinity``): JSON has no such number, and the page shows it as it is."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value).replace("nan", "NaN").replace("inf", "Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def page(title: str, data: dict[str, Any]) -> str:
    """The HTML of one page: the shell, ``data`` as JSON (no ``<``, ``>`` or ``&`` left to end the script element
    early; a non-finite number as a string) and the viewer's script and style."""
    try:
        payload = json.dumps(data, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a NaN somewhere (a reward, a log-prob): walk the data only then
        payload = json.dumps(_finite(data), ensure_ascii=False, allow_nan=False)
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return ("<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{html.escape(title)}</title>\n<style>\n{_asset('viewer.css')}</style></head>\n<body>"
            "<div id='app'></div><noscript>The trajectory viewer needs JavaScript.</noscript>\n"
            f"<script type='application/json' id='miles-data'>{payload}</script>\n"
            f"<script>\n{_asset('viewer.js')}</script>\n</body></html>\n")


def _unreadable(summary: StepSummary) -> list[dict[str, Any]]:
    return [{"line": u.line, "why": u.why} for u in summary.unreadable]


def index_page(trajectories: RunTrajectories, *, live: bool = False, back: str | None = None) -> str:
    """The list of steps, each with its samples' mean reward and the lines of its file that cannot be read.
    ``live``: says new steps come on reload; ``back``: a link to the report."""
    steps = [{"step": s.step, "file": step_file(s.step), "source": s.file, "samples": s.samples,
              "mean_reward": s.mean_reward, "failed": s.failed, "mean_length": s.mean_length, "pages": len(s.pages),
              "unreadable": _unreadable(s), "unreadable_count": s.unreadable_count}
             for s in trajectories.summaries()]
    return page(f"Trajectories: {trajectories.name}",
                {"page": "index", "run": trajectories.name, "steps": steps, "live": live, "back": back})


def step_page(trajectories: RunTrajectories, step: int, page_number: int, image_src: ImageSource,
              steps: list[int] | None = None) -> str | None:
    """Page ``page_number`` of step ``step``: its samples with the filters, each sample's detail (``#sample-N``: the
    N-th of the file, on whichever page holds it), the links to the step's other pages, and the lines of the file
    that cannot be read. None when the step has no such page."""
    steps = trajectories.steps() if steps is None else steps
    if step not in steps:
        return None
    try:
        found = trajectories.page(step, page_number)
    except FileNotFoundError:
        return None
    if found is None:
        return None
    summary, records = found
    span = summary.pages[page_number - 1]
    at = steps.index(step)
    prev_step = steps[at - 1] if at else None
    next_step = steps[at + 1] if at + 1 < len(steps) else None
    samples = [_page_sample(record, trajectories.root, image_src) for record in records]
    return page(f"Step {step}: {trajectories.name}", {
        "page": "step", "run": trajectories.name, "step": step, "index": "index.html", "source": summary.file,
        "samples": samples, "first": span.first, "total": summary.samples, "page_number": page_number,
        "pages": [[step_file(step, i), p.first, p.samples] for i, p in enumerate(summary.pages, 1)],
        "unreadable": _unreadable(summary), "unreadable_count": summary.unreadable_count,
        "prev": step_file(prev_step) if prev_step is not None else None, "prev_step": prev_step,
        "next": step_file(next_step) if next_step is not None else None, "next_step": next_step})


class _CopiedImages:
    """The static pages' images: each file (checked by :func:`run_image` to be one of the run's) copied once into
    ``images/`` under a name made of its content's hash."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._src: dict[Path, str] = {}

    def __call__(self, path: Path, kind: str) -> str:
        if path not in self._src:
            content = path.read_bytes()
            name = hashlib.sha256(content).hexdigest()[:24] + _EXTENSIONS[kind]
            self.directory.mkdir(parents=True, exist_ok=True)
            if not (self.directory / name).exists():
                (self.directory / name).write_bytes(content)
            self._src[path] = f"images/{name}"
        return self._src[path]


def write_viewer(trajectories: RunTrajectories, out_dir: str | Path, back: str | None = None) -> Path:
    """Write the viewer's pages for every step of ``trajectories`` into ``out_dir`` (``index.html``, the pages of
    each step, ``images/``), one page at a time; the index's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = trajectories.steps()
    images = _CopiedImages(out / "images")
    written = set()
    for step in steps:
        number = 1
        while (text := step_page(trajectories, step, number, images, steps)) is not None:
            (out / step_file(step, number)).write_text(text, encoding="utf-8")
            written.add(step_file(step, number))
            number += 1
    for stale in out.glob("step_*.html"):  # from an earlier report of this directory
        if stale.name not in written:
            stale.unlink()
    index = out / "index.html"
    index.write_text(index_page(trajectories, back=back), encoding="utf-8")
    return index


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        lines = []
        for message in _without_images(prompt):
            content = message.get("content") if isinstance(message, dict) else message
            parts = content if isinstance(content, list) else [content]
            text = "".join("[image]" if isinstance(p, dict) and p.get("type") == "image"
                           else p.get("text", "") if isinstance(p, dict) else str(p) for p in parts)
            lines.append(f"{message.get('role', '')}: {text}" if isinstance(message, dict) else text)
        return "\n".join(lines)
    return json.dumps(prompt)


def _picked_steps(steps: list[int], count: int = 4) -> list[int]:
    """The first step, the last, and some evenly between."""
    if len(steps) <= count:
        return steps
    return sorted({steps[round(i * (len(steps) - 1) / (count - 1))] for i in range(count)})


def _picked_samples(summary: StepSummary) -> list[int]:
    """The best-rewarded sample and the worst (the first when all got the same reward, or none a finite one)."""
    if summary.best is None or summary.worst is None:
        return [0] if summary.samples else []
    return [summary.best] if summary.best == summary.worst else [summary.best, summary.worst]


def completions_section(trajectories: RunTrajectories | None, link: str = "trajectories") -> str:
    """The report's "Sample completions": a few steps' best and worst samples, prompt, response and reward, each
    linking to its page of the static viewer (``link``: its folder, relative to the report; None: the run wrote no
    trajectories), and the lines of those steps' files that cannot be read."""
    e = html.escape
    parts = ["<h2>Sample completions</h2>"]
    if trajectories is None:
        parts.append("<p>The run wrote no trajectories (<code>run.trajectories</code>: 0, or a run made before "
                     "they were written).</p>")
        return "\n".join(parts)
    parts.append("<style>.completion{margin:.5em 0 1em}.completion pre{white-space:pre-wrap;background:#f6f6f6;"
                 "padding:.3em .6em;margin:.2em 0}.unreadable{color:#b91c1c}</style>")
    parts.append(f"<p>The best and the worst sample of a few steps; <a href='{link}/index.html'>the trajectory "
                 "viewer</a> shows every saved sample token by token (loss mask, log-probs, advantages, tool "
                 "calls, images).</p>")
    for step in _picked_steps(trajectories.steps()):
        try:
            summary = trajectories.summary(step)
        except FileNotFoundError:  # removed since it was listed
            continue
        parts.append(f"<h3>Step {step}</h3>")
        if summary.unreadable_count:
            named = "; ".join(f"line {u.line}: {u.why}" if u.line else u.why for u in summary.unreadable)
            parts.append(f"<p class='unreadable'>{e(summary.file)}: {summary.unreadable_count} line(s) cannot be "
                         f"read and are left out ({e(named)})</p>")
        for position in _picked_samples(summary):
            record = trajectories.sample(step, position)
            if record is None:
                continue
            value = reward_value(record.get("reward"))
            shown = f"{value:.4g}".replace("nan", "NaN").replace("inf", "Infinity") if value is not None else "none"
            parts.append(
                f"<div class='completion'><p>group {e(str(record.get('group')))}, sample "
                f"{e(str(record.get('index')))}: reward <b>{e(shown)}</b>, {e(str(record.get('status')))} "
                f"(<a href='{link}/{step_file(step, summary.page_of(position))}#sample-{position}'>tokens</a>)</p>"
                f"<small>prompt</small><pre>{e(_prompt_text(record.get('prompt')))}</pre>"
                f"<small>response</small><pre>{e(str(record.get('response_text') or ''))}</pre></div>")
    return "\n".join(parts)
