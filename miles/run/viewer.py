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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO, Any

from miles.errors import ConfigError
from miles.loop.trajectories import DIRECTORY, trajectory_steps

__all__ = ["RunTrajectories", "StepSummary", "PageSpan", "Unreadable", "ImageRefused", "run_image", "index_page",
           "step_page", "step_file", "write_viewer", "completions_section", "reward_value", "PAGE_SAMPLES",
           "PAGE_BYTES"]

PAGE_SAMPLES = 50  # samples on one step page at most
PAGE_BYTES = 4 * 2**20  # and about this much of the step file: a page takes no more lines once past it
UNREADABLE_NAMED = 20  # unreadable lines named per step file (all of them are counted)

ImageSource = Callable[[Path, str], str]  # an image file inside the run and its MIME type -> the page's src


def step_file(step: int, page: int = 1) -> str:
    """Page ``page`` (from 1) of step ``step``, beside the index (the same name served and on disk)."""
    return f"step_{step:06d}.html" if page == 1 else f"step_{step:06d}_page{page}.html"


def reward_value(reward: Any) -> float | None:
    """A reward as one number: a dict reward's ``score``; None for a sample without one (failed)."""
    if isinstance(reward, dict):
        reward = reward.get("score")
    if not isinstance(reward, (int, float)) or isinstance(reward, bool):
        return None
    try:
        return float(reward)
    except OverflowError:  # an integer past float's range, as JSON may hold
        return math.copysign(math.inf, reward)


@dataclass(frozen=True)
class Unreadable:
    """A line of a step file that is not a sample, and why."""

    line: int | None  # from 1; None: the whole file
    why: str


@dataclass(frozen=True)
class PageSpan:
    """One page of a step: the bytes of the step file that hold its lines."""

    start: int  # offset of its first line
    end: int  # offset after its last line
    first: int  # its first sample's position among the file's samples (from 0: ``#sample-N``)
    samples: int


@dataclass(frozen=True)
class StepSummary:
    step: int
    file: str  # the step file, relative to the run directory
    samples: int  # the file's readable samples
    mean_reward: float | None  # of the samples with a reward (NaN when one of them is)
    failed: int
    mean_length: float | None  # response tokens
    best: int | None  # the position of the sample with the highest finite reward (the first of equals)
    worst: int | None  # and of the lowest
    pages: tuple[PageSpan, ...]  # one at least
    unreadable: tuple[Unreadable, ...]  # the first UNREADABLE_NAMED
    unreadable_count: int

    def page_of(self, position: int) -> int:
        """The page (from 1) that shows the sample at ``position``; the last page for one past the end."""
        return next((number for number, span in enumerate(self.pages, 1) if position < span.first + span.samples),
                    len(self.pages))


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false",
               type(None): "null"}


def _parse(raw: bytes) -> dict[str, Any] | str | None:
    """A line's sample, why it is not one (a str), or None for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte {exc.start + 1} of the line)"
    if not text.strip():
        return None
    try:
        record = json.loads(text.rstrip("\r\n"))  # NaN and Infinity are read as Python's json writes them
    except RecursionError:
        return "not readable: nested too deeply"
    except ValueError as exc:  # not JSON; a number too long to read
        return f"not JSON ({exc})" + ("; the file ends inside this line: cut short?" if not raw.endswith(b"\n")
                                      else "")
    if not isinstance(record, dict):
        return f"expected a JSON object (one sample), got {_JSON_KINDS.get(type(record), type(record).__name__)}"
    return record


def _summarize(step: int, file: str, handle: IO[bytes]) -> StepSummary:
    """Read the step file ``handle`` once, line by line, into its summary and its pages."""
    pages: list[PageSpan] = []
    unreadable: list[Unreadable] = []
    unreadable_count = samples = failed = tokens = rewarded = 0
    reward_total = 0.0
    best: tuple[float, int] | None = None
    worst: tuple[float, int] | None = None
    page_start = page_first = offset = 0
    handle.seek(0)
    for number, raw in enumerate(handle, 1):
        at, offset = offset, offset + len(raw)
        record = _parse(raw)
        if record is None:
            continue
        if isinstance(record, str):
            unreadable_count += 1
            if len(unreadable) < UNREADABLE_NAMED:
                unreadable.append(Unreadable(number, record))
            continue
        if samples > page_first and (samples - page_first >= PAGE_SAMPLES or at - page_start >= PAGE_BYTES):
            pages.append(PageSpan(page_start, at, page_first, samples - page_first))
            page_start, page_first = at, samples
        reward = reward_value(record.get("reward"))
        if reward is not None:
            rewarded += 1
            reward_total += reward
            if math.isfinite(reward):
                best = (reward, samples) if best is None or reward > best[0] else best
                worst = (reward, samples) if worst is None or reward < worst[0] else worst
        failed += record.get("status") == "failed"
        tokens += len(record["tokens"]) if isinstance(record.get("tokens"), list) else 0
        samples += 1
    pages.append(PageSpan(page_start, offset, page_first, samples - page_first))
    return StepSummary(step, file, samples, reward_total / rewarded if rewarded else None, failed,
                       tokens / samples if samples else None, best[1] if best else None, worst[1] if worst else None,
                       tuple(pages), tuple(unreadable), unreadable_count)


def _page_records(handle: IO[bytes], span: PageSpan) -> list[dict[str, Any]]:
    """The samples of one page (its unreadable lines left out: the summary names them)."""
    handle.seek(span.start)
    records, offset = [], span.start
    while offset < span.end:
        raw = handle.readline()
        if not raw:
            break
        offset += len(raw)
        record = _parse(raw)
        if isinstance(record, dict):
            records.append(record)
    return records


class RunTrajectories:
    """A run's trajectories files. A step file is summarized again when it changes (a resumed run writes its steps
    again), and new files are found at each call, so that a run still being written can be shown."""

    def __init__(self, run_dir: str | Path, command: str = "miles view") -> None:
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise ConfigError(f"{command}: {str(run_dir)!r} is not a directory; expected a run directory (run.dir)")
        if not self.steps():
            raise ConfigError(
                f"{command}: {self.run_dir / DIRECTORY} holds no step_*.jsonl: the run wrote no trajectories "
                f"(run.trajectories=0, a run made before they were written, or one that has not finished its "
                f"first step yet)")
        self.root = Path(os.path.realpath(self.run_dir))  # the only folder whose image files are shown
        self._summaries: dict[int, tuple[tuple[int, int, int], StepSummary]] = {}

    @property
    def name(self) -> str:
        return self.root.name

    def steps(self) -> list[int]:
        return trajectory_steps(self.run_dir)

    @staticmethod
    def file(step: int) -> str:
        return f"{DIRECTORY}/step_{step:06d}.jsonl"

    @contextmanager
    def _open(self, step: int) -> Iterator[tuple[StepSummary, IO[bytes]]]:
        """The step file, open, and its summary: of the very version open (a file replaced meanwhile is summarized
        anew), so that the offsets of its pages are those of the bytes read."""
        with open(self.run_dir / self.file(step), "rb") as handle:
            status = os.fstat(handle.fileno())
            key = (status.st_ino, status.st_mtime_ns, status.st_size)
            cached = self._summaries.get(step)
            if cached is None or cached[0] != key:
                cached = (key, _summarize(step, self.file(step), handle))
                self._summaries[step] = cached
            yield cached[1], handle

    def _unreadable_file(self, step: int, exc: OSError) -> StepSummary:
        return StepSummary(step, self.file(step), 0, None, 0, None, None, None, (PageSpan(0, 0, 0, 0),),
                           (Unreadable(None, f"cannot be read ({exc.strerror or exc})"),), 1)

    def summary(self, step: int) -> StepSummary:
        """Step ``step``'s summary; FileNotFoundError when it has no file (any more)."""
        try:
            with self._open(step) as (summary, _):
                return summary
        except FileNotFoundError:
            raise
        except OSError as exc:  # a file this user may not read, a folder of that name
            return self._unreadable_file(step, exc)

    def summaries(self) -> list[StepSummary]:
        found = []
        for step in self.steps():
            try:
                found.append(self.summary(step))
            except FileNotFoundError:  # removed since it was listed
                continue
        return found

    def page(self, step: int, page: int) -> tuple[StepSummary, list[dict[str, Any]]] | None:
        """Step ``step``'s summary and the samples of its page ``page`` (from 1); None when it has no such page."""
        try:
            with self._open(step) as (summary, handle):
                if not 1 <= page <= len(summary.pages):
                    return None
                return summary, _page_records(handle, summary.pages[page - 1])
        except FileNotFoundError:
            raise
        except OSError as exc:
            return (self._unreadable_file(step, exc), []) if page == 1 else None

    def sample(self, step: int, position: int) -> dict[str, Any] | None:
        """The sample at ``position`` of step ``step``'s file (its page read, not the whole file)."""
        summary = self.summary(step)
        number = summary.page_of(position)
        found = self.page(step, number)
        if found is None or found[0] is not summary:  # rewritten meanwhile
            return None
        at = position - summary.pages[number - 1].first
        return found[1][at] if 0 <= at < len(found[1]) else None


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
