"""Builtin metric loggers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any

from miles import hookimpl


class JsonlLogger:
    """One JSON object per step in ``<run.dir>/<filename>``."""

    def __init__(self, filename: str = "metrics.jsonl") -> None:
        self.filename = filename
        self._file: IO[str] | None = None

    def start(self, run_dir: str, config: Any) -> None:
        self._path = Path(run_dir) / self.filename
        resuming = bool(config.run.resume) and self._path.exists()
        self._file = open(self._path, "a" if resuming else "w", encoding="utf-8")

    def rewind(self, step: int) -> None:
        """Keep only the rows of steps before ``step`` (a resumed run redoes the later ones)."""
        assert self._file is not None, "start() was not called"
        self._file.close()
        rows = [line for line in self._path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line)["step"] < step]
        self._path.write_text("".join(row + "\n" for row in rows), encoding="utf-8")
        self._file = open(self._path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        assert self._file is not None, "start() was not called"
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@hookimpl(trylast=True)
def miles_register_loggers(register):
    register("jsonl", JsonlLogger)
