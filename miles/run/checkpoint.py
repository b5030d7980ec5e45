"""Training checkpoints: written atomically, found again by ``run.resume``, refused when incompatible.

A checkpoint is ``<run.dir>/checkpoints/step_<k>/`` (``k`` RL steps done):

- ``backend/``: what the training backend needs to continue (weights, optimizer, LR schedule, its RNG);
- ``loop.pt``: the driver's RNG, the data position and the rollout engines' sampling RNG;
- ``state.json``: step, weight version, the reward history, the model's architecture, the backend,
  the plugin stack with versions (read before anything else, to refuse a mismatch) and the size of
  every other file of the checkpoint.

It is written under a hidden temporary name (``.step_<k>.<random>``) and renamed into place when complete, so a run
killed mid-write leaves no ``step_*`` directory behind, and only complete ones are ever resumed from; the hidden
folder such a run leaves is removed when the run dir is used again (:func:`remove_partial_checkpoints`).
A checkpoint damaged later (a truncated file, a size that differs from the one recorded) is skipped
with a warning that names the file, and the run resumes from the newest intact one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from miles.errors import ConfigError, RunError, disk_cause

__all__ = ["Checkpoint", "save_checkpoint", "latest_checkpoint", "newest_intact_checkpoint", "damage",
           "check_compatible", "model_signature", "resume_hint", "remove_partial_checkpoints"]

_NAME = re.compile(r"^step_(\d+)$")
# The hidden folder a checkpoint is written in: ``.step_<k>.`` and the 8 characters tempfile.mkdtemp adds.
_PARTIAL = re.compile(r"^\.step_\d+\.[a-z0-9_]{8}$")
# Fields of an HF config.json that do not change what a checkpoint's weights mean.
_IGNORED_MODEL_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache"}


@dataclass
class Checkpoint:
    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def backend_dir(self) -> str:
        return str(self.path / "backend")

    def loop_state(self) -> dict[str, Any]:
        return torch.load(self.path / "loop.pt", weights_only=False)


def model_signature(model_path: str | Path) -> dict[str, Any]:
    """The architecture of an HF model directory: its config.json without bookkeeping fields."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return {k: v for k, v in sorted(config.items()) if k not in _IGNORED_MODEL_KEYS}


def save_checkpoint(root: Path, state: dict[str, Any], loop_state: dict[str, Any], backend: Any, keep: int,
                    extra: Callable[[Path], Any] | None = None) -> Path:
    """Write ``step_<state['step']>`` under ``root`` atomically; keep only the newest ``keep``. ``extra(folder)``
    writes more into the checkpoint's folder before it is listed (``run.export_precision``'s model)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{int(state['step']):06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        (tmp / "backend").mkdir()
        backend.save_checkpoint(str(tmp / "backend"))
        torch.save(loop_state, tmp / "loop.pt")
        if extra is not None:
            extra(tmp)
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        (tmp / "state.json").write_text(json.dumps({**state, "files": files}, indent=1))
        if final.exists():  # a step redone after resuming from an earlier checkpoint
            shutil.rmtree(final)
        os.replace(tmp, final)
    except Exception as exc:
        if (why := _disk_refusal(root, final, tmp, exc)) is not None:
            raise RunError(f"checkpoint {final.name} could not be written under {str(root)!r}: {why}; the "
                           f"checkpoints before it are intact: free space there, then continue with "
                           f"run.resume=true") from exc
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in _complete(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old.path, ignore_errors=True)
    return final


def remove_partial_checkpoints(root: Path) -> list[str]:
    """Remove the hidden folders of checkpoint writes that never completed under ``root``; their names.

    A run killed while it wrote a checkpoint leaves one, and a trainer in a process of its own
    (``backend.separate_process``) may still write into one after an interrupted run removed it. Only names of the
    form :func:`save_checkpoint` gives them (``.step_<k>.<8 characters>``) are touched; nothing else is ours. The
    caller holds the run directory (:class:`miles.run.lock.RunDirLock`), so no other run is writing one."""
    removed = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if _PARTIAL.match(path.name) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def _disk_refusal(root: Path, final: Path, tmp: Path, exc: Exception) -> str | None:
    """Why the checkpoint ``final``, written in ``tmp``, failed, when the disk is the cause: what the disk said, the
    file being written, the bytes free, and the size of the last checkpoint (about what this one needs). None for
    any other failure.

    A backend's writer does not always say that the disk is full (torch.save raises a RuntimeError, a Ray actor a
    RayTaskError, a trainer process the error it got) nor which file it wrote: the file system's free space says
    the first, and the entry of ``tmp`` changed last the second (a backend writes one file at a time; one that
    removed its own temporary folder leaves the folder it was in as the one changed last)."""
    try:
        stats = os.statvfs(root)
        free: int | None = stats.f_bavail * stats.f_frsize
    except OSError:
        free = None
    if (cause := disk_cause(exc)) is None:
        if free is None or free >= _NEARLY_FULL:
            return None
        cause = "no space left on the device"
    failed = _failed_file(exc) or _changed_last(tmp)
    if failed is not None and Path(failed).is_relative_to(tmp):  # the hidden folder goes: named as the checkpoint's
        failed = str(final / Path(failed).relative_to(tmp)) + ("/" if Path(failed).is_dir() else "")
    figures = [f"{free} bytes free there"] if free is not None else []
    if (last := latest_checkpoint(root)) is not None:
        size = sum(f.stat().st_size for f in last.path.rglob("*") if f.is_file())
        figures.append(f"a checkpoint needs about {size} bytes: {last.path.name} takes that")
    where = f" while writing {failed}" if failed else ""
    return f"{cause}{where} ({'; '.join(figures)})" if figures else f"{cause}{where}"


def _changed_last(folder: Path) -> str | None:
    """The entry under ``folder`` changed last (one that vanishes meanwhile is passed over)."""
    newest: tuple[int, str] | None = None
    for entry in folder.rglob("*") if folder.is_dir() else []:
        try:
            changed = (entry.lstat().st_mtime_ns, str(entry))
        except OSError:
            continue
        newest = max(newest or changed, changed)
    return newest[1] if newest else None


def _failed_file(exc: BaseException | None) -> str | None:
    """The file named by the OSError ``exc`` is, or was raised from; None when none names one."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.filename:
            return str(exc.filename)
        exc = exc.__cause__ or exc.__context__
    return None


_NEARLY_FULL = 1 << 20


def _complete(root: Path) -> list[Checkpoint]:
    found = []
    for path in root.iterdir() if root.is_dir() else []:
        if _NAME.match(path.name) and (path / "state.json").is_file():
            try:
                state = json.loads((path / "state.json").read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                state = {"step": int(_NAME.match(path.name).group(1)), "damaged": "state.json is not valid JSON"}
            found.append(Checkpoint(path, state))
    return sorted(found, key=lambda c: c.step)


def damage(checkpoint: Checkpoint) -> str | None:
    """What is wrong with a checkpoint's files (naming the file), or None when it is intact.

    Sizes are compared with those recorded at save time; safetensors headers and the zip directory
    of ``.pt`` files are read (cheap: no tensor is loaded)."""
    from safetensors import safe_open

    if "damaged" in checkpoint.state:
        return f"{checkpoint.path / 'state.json'}: {checkpoint.state['damaged']}"
    recorded: dict[str, int] = checkpoint.state.get("files", {})
    for name, size in recorded.items():
        file = checkpoint.path / name
        if not file.is_file():
            return f"{file}: missing"
        if file.stat().st_size != size:
            return f"{file}: {file.stat().st_size} bytes, {size} when it was written (truncated or overwritten)"
    if not (checkpoint.path / "loop.pt").is_file():
        return f"{checkpoint.path / 'loop.pt'}: missing"
    for file in sorted(checkpoint.path.rglob("*")):
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), "pt"):
                    pass
            elif file.suffix in (".pt", ".bin"):
                zipfile.ZipFile(file).close()
        except Exception as exc:
            return f"{file}: cannot be read ({type(exc).__name__}: {exc})"
    return None


def newest_intact_checkpoint(root: Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest complete checkpoint whose files are intact, and what was wrong with each newer one."""
    skipped = []
    for checkpoint in reversed(_complete(root)):
        problem = damage(checkpoint)
        if problem is None:
            return checkpoint, skipped
        skipped.append(f"{checkpoint.path.name}: {problem}")
    return None, skipped


def resume_hint(run_dir: Path, save_every: int, command: list[str]) -> str:
    """What a run stopped by Ctrl-C or SIGTERM says: its last checkpoint and the command (``command``, the one it was
    started with, ``run.resume=true`` added) that continues it."""
    line = shlex.join([*(c for c in command if not c.startswith(("run.resume=", "run.overwrite="))),
                       "run.resume=true"])
    found = latest_checkpoint(run_dir / "checkpoints")
    if found is None:
        why = ("it saves none: run.save_every=0" if save_every == 0
               else f"it saves one every {save_every} steps (run.save_every)")
        return (f"miles: no checkpoint of this run in {run_dir} ({why}); this starts it over from step 0 there:\n"
                f"  {line}")
    return f"miles: the last checkpoint is {found.path} ({found.step} RL steps done); continue from it with:\n  {line}"


def latest_checkpoint(root: Path) -> Checkpoint | None:
    """The newest complete checkpoint under ``root``, if any (half-written ones are hidden temporaries)."""
    found = _complete(root)
    return found[-1] if found else None


def _version(stack: dict[str, str | None], name: str) -> str:
    return "absent" if name not in stack else (stack[name] or "unversioned")


def check_compatible(checkpoint: Checkpoint, *, model: dict[str, Any], backend: str,
                     plugins: list[dict[str, Any]]) -> None:
    """Refuse to resume when the model architecture, the backend or the plugin stack differ."""
    saved = checkpoint.state
    problems = []
    for key in sorted(set(saved["model"]) | set(model)):
        if saved["model"].get(key) != model.get(key):
            problems.append(f"model {key}: {saved['model'].get(key)!r} in the checkpoint, {model.get(key)!r} now")
    if saved["backend"] != backend:
        problems.append(f"backend: {saved['backend']!r} in the checkpoint, {backend!r} now")
    then = {p["name"]: p["version"] for p in saved["plugins"]}
    now = {p["name"]: p["version"] for p in plugins}
    for name in sorted(set(then) | set(now)):
        if (name in then, then.get(name)) != (name in now, now.get(name)):
            problems.append(f"plugin {name}: {_version(then, name)} in the checkpoint, {_version(now, name)} now")
    if problems:
        raise ConfigError(f"run.resume: checkpoint {checkpoint.path} does not fit this run:\n  " + "\n  ".join(problems)
                          + "\nResume with the same model and plugins, or start in a new run.dir.")
