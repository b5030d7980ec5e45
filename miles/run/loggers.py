"""Builtin metric loggers: ``jsonl`` (the default); ``tensorboard`` and ``wandb`` when their package is installed."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from miles.errors import RunError

WANDB_MODES = ("offline", "online", "disabled")


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
        row = {"step": step,
               **{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _require(package: str, extra: str) -> None:
    """Config validation: ValueError naming the pip command when ``package`` is not installed."""
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"it needs the {package} package, which is not installed here: "
                         f"pip install 'miles[{extra}]' (or pip install {package})")


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


class TensorBoardLogger:
    """TensorBoard event files under ``<run.dir>/<log_dir>``: every metric a scalar at its step, and the
    config as text. A resumed run drops what the interrupted one logged after its checkpoint."""

    def __init__(self, log_dir: str = "tensorboard", flush_secs: float = 10.0) -> None:
        self.log_dir = log_dir
        self.flush_secs = flush_secs
        self._writer: Any = None

    @staticmethod
    def check_args(args: dict[str, Any]) -> None:
        _require("tensorboard", "tensorboard")
        if not args["flush_secs"] > 0:
            raise ValueError(f"flush_secs: expected a number of seconds > 0, got {args['flush_secs']!r}")

    def _open(self, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._writer = SummaryWriter(str(self._path), purge_step=purge_step, flush_secs=int(math.ceil(self.flush_secs)))

    def start(self, run_dir: str, config: Any) -> None:
        from omegaconf import OmegaConf

        self._path = Path(run_dir) / self.log_dir
        self._open()
        self._writer.add_text("config", "```yaml\n" + OmegaConf.to_yaml(config) + "```", 0)

    def rewind(self, step: int) -> None:
        if step > 0:  # TensorBoard discards the earlier files' events from ``purge_step`` on
            self._writer.close()
            self._open(purge_step=step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        assert self._writer is not None, "start() was not called"
        for key, value in _numbers(metrics).items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbLogger:
    """A Weights & Biases run whose files go under ``<run.dir>/wandb``; offline unless told otherwise.

    ``mode``: ``offline`` writes the run there only (``wandb sync`` uploads it later), ``online`` streams it
    too (needs ``wandb login`` or ``WANDB_API_KEY``), ``disabled`` logs nothing; null: ``$WANDB_MODE``,
    else offline. ``run_name`` (the node's ``name`` picks the logger) defaults to the run directory's name.
    The W&B run's config is the resolved Miles config.
    """

    def __init__(self, project: str = "miles", run_name: str | None = None, tags: list[str] | None = None,
                 group: str | None = None, entity: str | None = None, notes: str | None = None,
                 mode: str | None = None) -> None:
        self.project, self.run_name, self.group, self.entity, self.notes = project, run_name, group, entity, notes
        self.tags = [str(tag) for tag in tags or []]
        self.mode = mode
        self._run: Any = None

    @staticmethod
    def check_args(args: dict[str, Any]) -> None:
        _require("wandb", "wandb")
        if args["mode"] is not None and args["mode"] not in WANDB_MODES:
            raise ValueError(f"mode: expected one of {', '.join(WANDB_MODES)} (or null: $WANDB_MODE, else offline), "
                             f"got {args['mode']!r}")
        tags = args["tags"]
        if tags is not None and (isinstance(tags, str) or not isinstance(tags, Sequence)
                                 or not all(isinstance(tag, str) for tag in tags)):
            raise ValueError(f"tags: expected a list of strings, got {tags!r}")

    def start(self, run_dir: str, config: Any) -> None:
        import wandb
        from omegaconf import OmegaConf

        mode = self.mode or os.environ.get("WANDB_MODE") or "offline"
        # No console capture (it would wrap the process's stdout/stderr), no code, git or machine snapshot.
        settings = wandb.Settings(mode=mode, silent=True, console="off", save_code=False, disable_git=True,
                                  x_disable_stats=True, x_disable_meta=True)
        try:
            self._run = wandb.init(project=self.project, entity=self.entity, group=self.group, tags=self.tags,
                                   name=self.run_name or Path(run_dir).resolve().name, notes=self.notes, dir=run_dir,
                                   config=OmegaConf.to_container(config, resolve=True), settings=settings,
                                   reinit="create_new")
        except Exception as exc:  # e.g. online without credentials
            raise RunError(f"logger 'wandb' could not start a W&B run ({mode} mode): {type(exc).__name__}: {exc}. "
                           f"Log in (wandb login, or WANDB_API_KEY), or use mode: offline") from exc

    def log(self, step: int, metrics: dict[str, float]) -> None:
        assert self._run is not None, "start() was not called"
        self._run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
