"""Progress of a phase: a tqdm bar on a terminal, a plain line now and then in a log file."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["progress", "phase", "PlainProgress"]


class PlainProgress:
    """Prints ``desc: k/total (postfix)`` every ``every`` steps, after ``interval_s`` without a line, and at
    the end: a log file gets a few readable lines instead of thousands of carriage-return frames."""

    def __init__(self, total: int, desc: str, file: IO[str], every: int | None = None,
                 interval_s: float = 60.0) -> None:
        self.total, self.desc, self.file = total, desc, file
        self.every = every or max(1, total // 10)
        self.interval_s = interval_s
        self.n = 0
        self.postfix = ""
        self._last_line_n = 0
        self._last_line_at = time.monotonic()

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.n != self._last_line_n:
            self._line()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n - self._last_line_n >= self.every or time.monotonic() - self._last_line_at >= self.interval_s:
            self._line()

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def _line(self) -> None:
        suffix = f" ({self.postfix})" if self.postfix else ""
        print(f"{self.desc}: {self.n}/{self.total}{suffix}", file=self.file, flush=True)
        self._last_line_n, self._last_line_at = self.n, time.monotonic()


def progress(total: int, desc: str, enabled: bool, file: IO[str] | None = None) -> Any:
    """A tqdm bar when ``file`` (stderr) is a terminal, else :class:`PlainProgress`; disabled: silent."""
    file = file or sys.stderr
    if enabled and not file.isatty():
        return PlainProgress(total, desc, file)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, file=file, dynamic_ncols=True, leave=True)


@contextlib.contextmanager
def phase(what: str, enabled: bool = True, file: IO[str] | None = None) -> Iterator[None]:
    """A line when a long phase starts (``what ...``) and one when it ends (``what: done in 12.3 s``), so that a
    run that saves a checkpoint or evaluates is not taken for a hung one; silent when not ``enabled``."""
    file = file or sys.stderr
    start = time.perf_counter()
    if enabled:
        print(f"{what} ...", file=file, flush=True)
    yield
    if enabled:
        print(f"{what}: done in {time.perf_counter() - start:.1f} s", file=file, flush=True)
