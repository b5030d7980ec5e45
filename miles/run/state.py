"""What the phases of one run share, and the run's loggers."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.config.prepared import Prepared
from miles.config.validate import component_node
from miles.hookspecs import RewindableLogger
from miles.rollout.data_source import Prompt
from miles.run.checkpoint import Checkpoint

__all__ = ["RunState", "start_loggers", "rewind_loggers", "frozen_heap"]


@dataclass
class RunState:
    """What the phases of one run share."""

    p: Prepared
    run_dir: Path
    seed: int
    stack: list[dict[str, Any]]
    tokenizer: Any
    pad_token_id: int
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    loggers: list[Any]
    eval_sets: list[Any]  # miles.loop.evaluation.EvalSet: the eval section's datasets
    closing: ExitStack
    cluster: Any = None  # miles.cluster.RayCluster, when engines or the backend run on Ray
    ray_num_cpus: int | None = None  # CPUs of a local Ray instance (see miles.run.preflight)
    base_model: str = ""  # the model the run starts from, before any SFT; its architecture is checked on resume
    resume_from: Checkpoint | None = None
    chat_format: Any = None  # miles.agentic.chat_format.BoundFormat (None: no format fits the tokenizer)
    trainer_process: Any = None  # miles.train.process_backend.TrainerProcess, started before the SFT phase
    times: dict[str, float] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    def timed(self, phase: str, since: float) -> None:
        self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - since

    def ray_cluster(self) -> Any:
        """The run's Ray cluster, started (or joined) on first use."""
        if self.cluster is None:
            from miles.cluster import RayCluster

            self.cluster = RayCluster(self.p.config.cluster, self.run_dir, num_cpus=self.ray_num_cpus)
            self.closing.callback(self.cluster.shutdown)
        return self.cluster


def start_loggers(p: Prepared, run_dir: Path, closing: ExitStack) -> list[Any]:
    """The loggers of ``run.loggers``, started on ``run_dir``; ``closing`` closes them."""
    loggers = [p.registry.build("logger", component_node(node), f"run.loggers[{i}]")
               for i, node in enumerate(p.config.run.loggers)]
    for logger in loggers:
        logger.start(str(run_dir), p.config)
        closing.callback(logger.close)
    return loggers


def rewind_loggers(loggers: list[Any], step: int) -> None:
    """Drop what an interrupted run logged from ``step`` on (:class:`miles.hookspecs.RewindableLogger`)."""
    for logger in loggers:
        if isinstance(logger, RewindableLogger):
            logger.rewind(step)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Take what exists now (imports, the model, the engine: 400,000 objects with torch and transformers) out
    of the garbage collector's view during a phase's steps. A full collection walks every tracked object: left
    in view, each cost 0.1 s, about 9 ms a step of the quickstart. What a step creates is collected as before;
    at the end they are in view again (a process may train more than once)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
