"""Saved rollouts (``run.save_rollouts``): every sample a step trained on, token-exact, one file per step.

``<run.dir>/rollouts/meta.json`` names the model RL started from; ``step_000123.npz`` (a compressed NumPy
archive, read without pickle) holds step 123's samples in the order the step trained them:

- ``prompt_ids``, ``response_ids`` (int32) and ``loss_mask`` (uint8): every sample's tokens end to end, cut by
  ``prompt_lens`` and ``response_lens`` (int32, one per sample);
- ``rollout_logprobs``: float32 (float64 when a value would not survive float32), aligned with ``response_ids``;
- ``routed_experts`` and ``routed_lens`` (-1: none), when samples carry MoE expert ids;
- ``rng_torch`` and ``rng_python`` (and ``rng_cuda``): this process's RNG state as the step began training;
- ``meta``: UTF-8 JSON: per sample its group, index, status, reason, reward (float or dict), label, prompt,
  response text, weight versions, off-policy tokens, turns, metadata and sampling parameters (``sampled_with``:
  ``[start, temperature, top_p, top_k]`` records; a file without them replays under the run's ``rollout.sampling``).

:func:`read_step` gives the samples back as :class:`~miles.types.Sample` objects (``miles replay`` trains on
them); anything a step's metadata holds that JSON cannot (a plugin's object) is kept as its ``repr``.
"""

from __future__ import annotations

import json
import os
import random
import re
import uuid
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.errors import DataError
from miles.types import Group, SampledWith, Sample, SampleStatus

__all__ = ["FORMAT", "RolloutWriter", "step_path", "saved_steps", "write_step", "read_step", "read_meta",
           "groups_of", "restore_rng"]

FORMAT = 1
_STEP_FILE = re.compile(r"step_(\d+)\.npz")


def step_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}.npz"


def saved_steps(directory: str | Path) -> list[int]:
    """The steps with a file under ``directory``, in order."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for f in directory.iterdir() if (m := _STEP_FILE.fullmatch(f.name)))


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return repr(value)


def _logprobs_array(values: list[float]) -> np.ndarray:
    """float32 when every value is one already (an engine's log-probs are), else float64: nothing is rounded."""
    wide = np.asarray(values, dtype=np.float64)
    narrow = wide.astype(np.float32)
    return narrow if np.array_equal(narrow.astype(np.float64), wide) else wide


def _rng_arrays() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    version, state, gauss_next = random.getstate()
    arrays = {"rng_torch": torch.get_rng_state().numpy(), "rng_python": np.asarray(state, dtype=np.uint32)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        arrays["rng_cuda"] = torch.stack(torch.cuda.get_rng_state_all()).numpy()
    return arrays, {"python_version": version, "python_gauss_next": gauss_next}


def write_step(directory: str | Path, step: int, samples: list[Sample]) -> Path:
    """Write ``samples`` (and this process's RNG state) as step ``step``'s file, atomically."""
    directory = Path(directory)
    routed = [s.routed_experts for s in samples]
    arrays: dict[str, np.ndarray] = {
        "prompt_ids": np.asarray([t for s in samples for t in s.prompt_ids], dtype=np.int32),
        "prompt_lens": np.asarray([len(s.prompt_ids) for s in samples], dtype=np.int32),
        "response_ids": np.asarray([t for s in samples for t in s.response_ids], dtype=np.int32),
        "response_lens": np.asarray([len(s.response_ids) for s in samples], dtype=np.int32),
        "loss_mask": np.asarray([m for s in samples for m in s.loss_mask], dtype=np.uint8),
        "rollout_logprobs": _logprobs_array([v for s in samples for v in s.rollout_logprobs]),
    }
    if any(r is not None for r in routed):
        from miles.models.moe import compact, expand

        present = [expand(r) for r in routed if r is not None]
        arrays["routed_experts"] = compact(np.concatenate(present))
        arrays["routed_lens"] = np.asarray([-1 if r is None else len(r) for r in routed], dtype=np.int32)
    rng, rng_meta = _rng_arrays()
    arrays.update(rng)
    meta = {
        "format": FORMAT, "step": step, **rng_meta,
        "samples": [{
            "group": s.group_index, "index": s.index, "status": s.status.value, "reason": s.reason,
            "reward": s.reward, "label": s.label, "prompt": s.prompt, "response_text": s.response_text,
            "weight_versions": s.weight_versions, "off_policy_tokens": s.off_policy_tokens, "turns": s.turns,
            "metadata": s.metadata, "sampled_with": [list(entry) for entry in s.sampled_with],
        } for s in samples],
    }
    arrays["meta"] = np.frombuffer(json.dumps(meta, default=_jsonable).encode(), dtype=np.uint8)
    directory.mkdir(parents=True, exist_ok=True)
    target = step_path(directory, step)
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as out:
            np.savez_compressed(out, **arrays)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def _split(flat: np.ndarray, lens: np.ndarray) -> list[np.ndarray]:
    return np.split(flat, np.cumsum(lens)[:-1]) if len(lens) else []


def read_step(path: str | Path) -> tuple[list[Sample], dict[str, Any]]:
    """The samples of one step file and the RNG state it recorded (for :func:`restore_rng`); a file that is
    missing, damaged or not a step file is a :class:`~miles.errors.DataError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"saved rollouts {path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
        meta = json.loads(arrays.pop("meta").tobytes().decode())
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error, UnicodeDecodeError) as exc:
        raise DataError(f"saved rollouts {path}: cannot be read, the file is damaged or not a Miles rollout file "
                        f"({type(exc).__name__}: {exc})") from None
    try:
        return _samples(arrays, meta), {k: v for k, v in {**arrays, **meta}.items() if k.startswith(("rng", "python_"))}
    except (KeyError, ValueError, TypeError) as exc:
        raise DataError(f"saved rollouts {path}: inconsistent content, the file is damaged or of another "
                        f"format ({type(exc).__name__}: {exc})") from None


def _samples(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> list[Sample]:
    if meta.get("format") != FORMAT:
        raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT}")
    rows = meta["samples"]
    prompt_lens, response_lens = arrays["prompt_lens"], arrays["response_lens"]
    if not len(rows) == len(prompt_lens) == len(response_lens):
        raise ValueError(f"{len(rows)} samples described, {len(prompt_lens)} prompts, {len(response_lens)} responses")
    response_total = int(response_lens.sum())
    for name, total in (("prompt_ids", int(prompt_lens.sum())), ("response_ids", response_total),
                        ("loss_mask", response_total), ("rollout_logprobs", response_total)):
        if len(arrays[name]) != total:
            raise ValueError(f"{name} holds {len(arrays[name])} values, the lengths add up to {total}")
    prompts, responses = _split(arrays["prompt_ids"], prompt_lens), _split(arrays["response_ids"], response_lens)
    masks, logprobs = _split(arrays["loss_mask"], response_lens), _split(arrays["rollout_logprobs"], response_lens)
    routed: list[Any] = [None] * len(rows)
    if "routed_experts" in arrays:
        from miles.models.moe import compact, expand

        lens = arrays["routed_lens"]
        present = _split(expand(arrays["routed_experts"]), np.asarray([n for n in lens if n >= 0]))
        it = iter(present)
        routed = [None if n < 0 else compact(next(it)) for n in lens]
    samples = []
    for i, row in enumerate(rows):
        samples.append(Sample(
            prompt_ids=prompts[i].tolist(), group_index=row["group"], index=row["index"], prompt=row["prompt"],
            label=row["label"], response_ids=responses[i].tolist(), loss_mask=masks[i].tolist(),
            rollout_logprobs=logprobs[i].tolist(), response_text=row["response_text"], reward=row["reward"],
            status=SampleStatus(row["status"]), reason=row["reason"], weight_versions=row["weight_versions"],
            off_policy_tokens=row["off_policy_tokens"], turns=row["turns"], metadata=row["metadata"],
            routed_experts=routed[i], sampled_with=[SampledWith(*entry) for entry in row.get("sampled_with", [])]))
    return samples


def restore_rng(state: dict[str, Any]) -> None:
    """Put this process's RNGs back as :func:`write_step` found them."""
    if "rng_torch" in state:
        torch.set_rng_state(torch.from_numpy(np.array(state["rng_torch"], dtype=np.uint8)))
    if "rng_python" in state:
        random.setstate((state["python_version"], tuple(int(v) for v in state["rng_python"]),
                         state["python_gauss_next"]))
    if "rng_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(r) for r in np.array(state["rng_cuda"], dtype=np.uint8)])


def groups_of(samples: list[Sample]) -> list[Group]:
    """The samples back in their groups (consecutive runs of one group index), in order."""
    groups: list[Group] = []
    for sample in samples:
        if not groups or groups[-1].index != sample.group_index:
            groups.append(Group(sample.group_index, []))
        groups[-1].samples.append(sample)
    return groups


def read_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"saved rollouts: {path} is missing (it names the model the run's RL phase started "
                        f"from)") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"saved rollouts {path}: cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "start_model" not in meta:
        raise DataError(f"saved rollouts {path}: expected format {FORMAT} with 'start_model', got {meta!r}")
    return meta


class RolloutWriter:
    """``run.save_rollouts``: called by the loop with each step's training samples, before they train (a step
    whose training fails is kept, so that a replay reproduces the failure)."""

    def __init__(self, run_dir: str | Path, start_model: str, pad_token_id: int) -> None:
        run_dir = Path(run_dir)
        self.directory = run_dir / "rollouts"
        self.directory.mkdir(parents=True, exist_ok=True)
        model = Path(start_model)
        # relative to the run directory when inside it, so that a moved run directory replays too
        recorded = str(model.relative_to(run_dir)) if model.is_relative_to(run_dir) else str(model)
        meta = {"format": FORMAT, "start_model": recorded, "pad_token_id": pad_token_id}
        (self.directory / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")

    def __call__(self, step: int, samples: list[Sample]) -> None:
        write_step(self.directory, step, samples)
