"""The trajectory viewer's pages: a run's ``trajectories/step_*.jsonl`` (:mod:`miles.loop.trajectories`) as HTML.

One renderer for both ways of showing them: every page is the same shell, its data embedded as JSON and
``viewer.js`` and ``viewer.css`` (beside this module) inlined, so that a page needs nothing else, no network
either. ``miles view`` (:mod:`miles.run.viewer_server`) makes the pages at each request, so a run still being
written shows its new steps on reload; ``miles report`` writes them once into ``report/trajectories/`` with
:func:`write_viewer`, files a browser opens from disk. The two differ only in where an image comes from: the
server's ``image?path=`` (it serves only the paths the run's files name) or a copy beside the pages.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from miles.errors import ConfigError
from miles.loop.trajectories import DIRECTORY, read_trajectories, trajectory_steps

__all__ = ["RunTrajectories", "StepSummary", "index_page", "step_page", "step_file", "write_viewer",
           "completions_section", "reward_value"]

ImageSource = Callable[[str], "str | None"]  # an image as the file names it -> the page's src (None: not found)


def step_file(step: int) -> str:
    """The page of step ``step``, beside the index (the same name served and on disk)."""
    return f"step_{step:06d}.html"


def reward_value(reward: Any) -> float | None:
    """A reward as one number: a dict reward's ``score``; None for a sample without one (failed)."""
    if isinstance(reward, dict):
        reward = reward.get("score")
    return float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class StepSummary:
    step: int
    samples: int
    mean_reward: float | None  # of the samples with a reward
    failed: int
    mean_length: float | None  # response tokens
    images: frozenset[str]  # the image files the step's samples name (data URLs left out)


class RunTrajectories:
    """A run's trajectories files. A step's summary is read again when its file changes (a resumed run writes
    its steps again), and new files are found at each call, so that a run still being written can be shown."""

    def __init__(self, run_dir: str | Path, command: str = "miles view") -> None:
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise ConfigError(f"{command}: {str(run_dir)!r} is not a directory; expected a run directory (run.dir)")
        if not self.steps():
            raise ConfigError(
                f"{command}: {self.run_dir / DIRECTORY} holds no step_*.jsonl: the run wrote no trajectories "
                f"(run.trajectories=0, a run made before they were written, or one that has not finished its "
                f"first step yet)")
        self._summaries: dict[int, tuple[tuple[int, int], StepSummary]] = {}

    @property
    def name(self) -> str:
        return self.run_dir.resolve().name

    def steps(self) -> list[int]:
        return trajectory_steps(self.run_dir)

    def records(self, step: int) -> list[dict[str, Any]]:
        return read_trajectories(self.run_dir, step)

    def summary(self, step: int) -> StepSummary:
        stat = (self.run_dir / DIRECTORY / f"step_{step:06d}.jsonl").stat()
        key = (stat.st_mtime_ns, stat.st_size)
        cached = self._summaries.get(step)
        if cached is not None and cached[0] == key:
            return cached[1]
        records = self.records(step)
        rewards = [r for r in (reward_value(record.get("reward")) for record in records) if r is not None]
        summary = StepSummary(
            step, len(records), _mean(rewards), sum(record.get("status") == "failed" for record in records),
            _mean([len(record.get("tokens") or []) for record in records]),
            frozenset(ref for record in records for ref in record.get("images") or []
                      if isinstance(ref, str) and not ref.startswith("data:")))
        self._summaries[step] = (key, summary)
        return summary

    def summaries(self) -> list[StepSummary]:
        found = []
        for step in self.steps():
            try:
                found.append(self.summary(step))
            except FileNotFoundError:  # removed since it was listed
                continue
        return found

    def image_paths(self) -> set[str]:
        """Every image file some step's samples name: the only files the server gives out."""
        return {ref for summary in self.summaries() for ref in summary.images}


_IMAGE_PARTS = {"image", "image_url", "input_image"}


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


def _page_sample(record: dict[str, Any], image_src: ImageSource) -> dict[str, Any]:
    sample = dict(record)
    sample["prompt"] = _without_images(record.get("prompt"))
    sample["images"] = [{"ref": _image_label(ref), "src": image_src(ref)} for ref in record.get("images") or []
                        if isinstance(ref, str)]
    for key in ("tokens", "prompt_tokens", "loss_mask", "tool_calls"):
        sample[key] = record.get(key) or []
    return sample


def _asset(name: str) -> str:
    return resources.files("miles.run").joinpath(name).read_text(encoding="utf-8")


def page(title: str, data: dict[str, Any]) -> str:
    """The HTML of one page: the shell, ``data`` as JSON (no ``<``, ``>`` or ``&`` left to end the script element
    early) and the viewer's script and style."""
    payload = (json.dumps(data, ensure_ascii=False, allow_nan=False)
               .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))
    return ("<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{html.escape(title)}</title>\n<style>\n{_asset('viewer.css')}</style></head>\n<body>"
            "<div id='app'></div><noscript>The trajectory viewer needs JavaScript.</noscript>\n"
            f"<script type='application/json' id='miles-data'>{payload}</script>\n"
            f"<script>\n{_asset('viewer.js')}</script>\n</body></html>\n")


def index_page(trajectories: RunTrajectories, *, live: bool = False, back: str | None = None) -> str:
    """The list of steps, each with its samples' mean reward. ``live``: says new steps come on reload;
    ``back``: a link to the report."""
    steps = [{"step": s.step, "file": step_file(s.step), "samples": s.samples, "mean_reward": s.mean_reward,
              "failed": s.failed, "mean_length": s.mean_length} for s in trajectories.summaries()]
    return page(f"Trajectories: {trajectories.name}",
                {"page": "index", "run": trajectories.name, "steps": steps, "live": live, "back": back})


def step_page(trajectories: RunTrajectories, step: int, image_src: ImageSource,
              steps: list[int] | None = None) -> str:
    """Step ``step``'s samples with the filters, and each sample's detail (``#sample-N``: the N-th of the file)."""
    steps = trajectories.steps() if steps is None else steps
    at = steps.index(step) if step in steps else None
    prev_step = steps[at - 1] if at else None
    next_step = steps[at + 1] if at is not None and at + 1 < len(steps) else None
    samples = [_page_sample(record, image_src) for record in trajectories.records(step)]
    return page(f"Step {step}: {trajectories.name}", {
        "page": "step", "run": trajectories.name, "step": step, "index": "index.html", "samples": samples,
        "prev": step_file(prev_step) if prev_step is not None else None, "prev_step": prev_step,
        "next": step_file(next_step) if next_step is not None else None, "next_step": next_step})


class _CopiedImages:
    """The static pages' images: a data URL stays in the page, a file is copied once into ``images/`` under a
    name made of its content's hash."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._src: dict[str, str | None] = {}

    def __call__(self, ref: str) -> str | None:
        if ref.startswith("data:"):
            return ref
        if ref not in self._src:
            try:
                content = Path(ref.removeprefix("file://")).read_bytes()
            except OSError:
                self._src[ref] = None
                return None
            suffix = Path(ref).suffix.lower()
            name = hashlib.sha256(content).hexdigest()[:24] + (suffix if re.fullmatch(r"\.[a-z0-9]{1,5}", suffix)
                                                               else "")
            self.directory.mkdir(parents=True, exist_ok=True)
            if not (self.directory / name).exists():
                (self.directory / name).write_bytes(content)
            self._src[ref] = f"images/{name}"
        return self._src[ref]


def write_viewer(run_dir: str | Path, out_dir: str | Path, back: str | None = None) -> Path | None:
    """Write the viewer's pages for every step of ``run_dir`` into ``out_dir`` (``index.html``, one page per step,
    ``images/``); None when the run wrote no trajectories."""
    if not trajectory_steps(run_dir):
        return None
    trajectories = RunTrajectories(run_dir, "miles report")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = trajectories.steps()
    images = _CopiedImages(out / "images")
    for step in steps:
        (out / step_file(step)).write_text(step_page(trajectories, step, images, steps), encoding="utf-8")
    for stale in out.glob("step_*.html"):  # from an earlier report of this directory
        if stale.name not in {step_file(step) for step in steps}:
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


def _picked_samples(records: list[dict[str, Any]]) -> list[int]:
    """The best-rewarded sample and the worst (the first when all got the same reward)."""
    rated = [(reward_value(r.get("reward")), i) for i, r in enumerate(records)]
    rated = [(value, i) for value, i in rated if value is not None]
    if not rated:
        return [0] if records else []
    best = max(rated, key=lambda pair: (pair[0], -pair[1]))[1]
    worst = min(rated)[1]
    return [best] if reward_value(records[best]["reward"]) == reward_value(records[worst]["reward"]) \
        else [best, worst]


def completions_section(run_dir: Path, viewer: Path | None, link: str = "trajectories") -> str:
    """The report's "Sample completions": a few steps' best and worst samples, prompt, response and reward, each
    linking to its page of the static viewer ``viewer`` (``link``: its folder, relative to the report)."""
    e = html.escape
    parts = ["<h2>Sample completions</h2>"]
    if viewer is None:
        parts.append("<p>The run wrote no trajectories (<code>run.trajectories</code>: 0, or a run made before "
                     "they were written).</p>")
        return "\n".join(parts)
    parts.append("<style>.completion{margin:.5em 0 1em}.completion pre{white-space:pre-wrap;background:#f6f6f6;"
                 "padding:.3em .6em;margin:.2em 0}</style>")
    parts.append(f"<p>The best and the worst sample of a few steps; <a href='{link}/index.html'>the trajectory "
                 "viewer</a> shows every saved sample token by token (loss mask, log-probs, advantages, tool "
                 "calls, images).</p>")
    for step in _picked_steps(trajectory_steps(run_dir)):
        records = read_trajectories(run_dir, step)
        parts.append(f"<h3>Step {step}</h3>")
        for position in _picked_samples(records):
            record = records[position]
            reward = record.get("reward")
            shown = f"{reward_value(reward):.4g}" if reward_value(reward) is not None else "none"
            parts.append(
                f"<div class='completion'><p>group {e(str(record.get('group')))}, sample "
                f"{e(str(record.get('index')))}: reward <b>{e(shown)}</b>, {e(str(record.get('status')))} "
                f"(<a href='{link}/{step_file(step)}#sample-{position}'>tokens</a>)</p>"
                f"<small>prompt</small><pre>{e(_prompt_text(record.get('prompt')))}</pre>"
                f"<small>response</small><pre>{e(str(record.get('response_text') or ''))}</pre></div>")
    return "\n".join(parts)
