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
        self._file = open(Path(run_dir) / self.filename, "w", encoding="utf-8")

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
