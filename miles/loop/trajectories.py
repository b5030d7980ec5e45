"""Trajectories a person can look at (``run.trajectories``): a few groups of every step, token by token.

``<run.dir>/trajectories/step_000123.jsonl`` holds one JSON object per sample of the first ``run.trajectories``
groups the step kept, failed samples included, in the step's order:

- ``step``, ``group``, ``index``, ``status``, ``reason``, ``reward`` (a number or the reward's dict), ``label``,
  ``prompt`` (as the data gave it: text or messages), ``response_text`` (what the reward scored), ``turns``,
  ``weight_versions``, ``tool_calls`` (multi-turn: per call its turn, name, arguments and error), ``images``
  (how the engine was sent each image: an absolute path or a data URL) and, aligned with it, ``image_files``
  (where the run keeps a copy of each image file, relative to the run directory: ``trajectories/images/<hash>``,
  null for a data URL or a file gone by then; the viewer shows only files inside the run directory);
- ``prompt_tokens`` and ``tokens``: the prompt's and the response's tokens, each as its text (a token that is
  part of a multi-byte character shows as U+FFFD);
- aligned with ``tokens``: ``loss_mask`` (1: the policy produced it, 0: an observation: a tool's output, the
  env's answer), ``rollout_logprobs`` (the engine's), ``train_logprobs`` (the trainer's, of the same weights,
  before the step's update: the gap is the rollout-training mismatch) and ``advantages`` (what the loss
  weighs each token with); the last two are null for a sample that did not train (failed) or in a run that
  does not train (``run.rollout_only``);
- ``advantage``: the mean advantage over the sample's loss tokens (null where ``advantages`` is).

The trainer's log-probs cost one more forward pass over these samples (``run.trajectories`` groups of
``rollout.prompts_per_step``). ``miles view RUN_DIR`` and ``miles report RUN_DIR`` show the files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from miles.types import Group, Sample

__all__ = ["TrajectoryWriter", "DIRECTORY", "trajectory_steps"]

DIRECTORY = "trajectories"
IMAGES = "images"  # under DIRECTORY: copies of the image files the samples name


def _jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: containers walked, numbers kept, non-finite floats as null, others as repr."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # a NumPy or torch scalar
        return _jsonable(value.item())
    if hasattr(value, "tolist"):
        return _jsonable(value.tolist())
    return repr(value)


class TrajectoryWriter:
    """Called by the learner with each step's kept groups; writes the first ``groups_per_step`` of them."""

    def __init__(self, run_dir: str | Path, tokenizer: Any, groups_per_step: int) -> None:
        self.directory = Path(run_dir) / DIRECTORY
        self.tokenizer = tokenizer
        self.groups_per_step = groups_per_step
        self._pieces: dict[int, str] = {}

    def shown(self, groups: list[Group]) -> list[Sample]:
        """The samples this step writes: every sample of its first groups."""
        return [s for g in groups[: self.groups_per_step] for s in g.samples]

    def _text(self, ids: list[int]) -> list[str]:
        pieces = self._pieces
        for token in ids:
            if token not in pieces:
                pieces[token] = self.tokenizer.decode([token])
        return [pieces[t] for t in ids]

    def record(self, step: int, sample: Sample, advantages: list[float] | None,
               train_logprobs: list[float] | None) -> dict[str, Any]:
        trained = advantages is not None
        mask = sample.loss_mask
        loss_tokens = sum(mask)
        mean = (sum(a for a, m in zip(advantages, mask) if m) / loss_tokens if loss_tokens else 0.0) if trained \
            else None
        return _jsonable({
            "step": step, "group": sample.group_index, "index": sample.index, "status": sample.status.value,
            "reason": sample.reason or "", "reward": sample.reward, "label": sample.label, "prompt": sample.prompt,
            "response_text": sample.response_text, "turns": sample.turns, "weight_versions": sample.weight_versions,
            "tool_calls": sample.metadata.get("tool_calls", []), "images": [image.ref for image in sample.images],
            "image_files": [self._image_file(image.ref) for image in sample.images],
            "prompt_tokens": self._text(sample.prompt_ids), "tokens": self._text(sample.response_ids),
            "loss_mask": mask, "rollout_logprobs": sample.rollout_logprobs, "train_logprobs": train_logprobs,
            "advantages": advantages, "advantage": mean,
        })

    def _image_file(self, ref: str | None) -> str | None:
        """A copy, inside the run directory, of the image file ``ref`` names (its path relative to the run directory;
        a file already inside it is itself): the viewer shows only the run's files, and an environment's temporary
        file may be gone when someone looks. None for a data URL or a file that cannot be read."""
        if not ref or ref.startswith("data:"):
            return None
        run_dir = self.directory.parent.resolve()
        try:
            source = Path(ref.removeprefix("file://")).resolve()
            if source.is_relative_to(run_dir):
                return source.relative_to(run_dir).as_posix()
            content = source.read_bytes()
        except (OSError, ValueError):  # gone, unreadable, not a path at all
            return None
        suffix = source.suffix.lower()
        name = hashlib.sha256(content).hexdigest()[:32] + (suffix if re.fullmatch(r"\.[a-z0-9]{1,5}", suffix) else "")
        target = self.directory / IMAGES / name
        if not target.exists():  # named by its content: an image shown at every step is copied once
            target.parent.mkdir(parents=True, exist_ok=True)
            temporary = target.with_name(f"{name}.{os.getpid()}.tmp")
            temporary.write_bytes(content)
            os.replace(temporary, target)
        return f"{DIRECTORY}/{IMAGES}/{name}"

    def write(self, step: int, records: list[dict[str, Any]]) -> Path:
        """Write step ``step``'s file atomically (a resumed run writes its steps again)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"step_{step:06d}.jsonl"
        temporary = path.with_name(path.name + ".tmp")
        with open(temporary, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(temporary, path)
        return path


def trajectory_steps(run_dir: str | Path) -> list[int]:
    """The steps with a trajectories file under ``run_dir``, in order."""
    directory = Path(run_dir) / DIRECTORY
    if not directory.is_dir():
        return []
    return sorted(int(f.name[5:-6]) for f in directory.glob("step_*.jsonl") if f.name[5:-6].isdigit())

