"""A run's trajectory files (``trajectories/step_*.jsonl``, :mod:`miles.loop.trajectories`) read for the viewer's
pages (:mod:`miles.run.viewer`): each file once per version into a :class:`StepSummary` (its counts and means, where
each page's lines start, the lines that cannot be read, by file and line), and a page's lines alone."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from miles.errors import ConfigError
from miles.loop.trajectories import DIRECTORY, trajectory_steps

__all__ = ["RunTrajectories", "StepSummary", "PageSpan", "Unreadable", "step_file", "reward_value", "PAGE_SAMPLES",
           "PAGE_BYTES"]

PAGE_SAMPLES = 50  # samples on one step page at most
PAGE_BYTES = 4 * 2**20  # and about this much of the step file: a page takes no more lines once past it
UNREADABLE_NAMED = 20  # unreadable lines named per step file (all of them are counted)



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
