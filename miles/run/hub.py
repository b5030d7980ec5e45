"""Models and datasets named by their Hugging Face Hub ids.

``model.path: Qwen/Qwen3-0.6B`` (no such local folder) is fetched with ``huggingface_hub.snapshot_download`` into
the Hub's cache (``HF_HOME``), once: later runs, and runs with ``HF_HUB_OFFLINE=1``, take it from there.
``data.train_path: hf:ORG/NAME`` (and ``data.eval_path``) read split ``data.train_split`` (``data.eval_split``) of
subset ``data.hub_subset`` with ``datasets.load_dataset``; the split is written into the run directory's ``data/``
as Parquet, so that the run holds the exact rows it trained on and later reads are local.
"""

from __future__ import annotations

import re
from pathlib import Path

from miles.errors import ConfigError, DataError

__all__ = ["HUB_DATA", "is_hub_data", "local_model_problem", "model_folder", "stage_hub_split"]

HUB_DATA = "hf:"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what a model folder needs: the config, the weights, the tokenizer's files and a chat template
_MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]


def is_hub_data(path: str | None) -> bool:
    return isinstance(path, str) and path.startswith(HUB_DATA)


def local_model_problem(path: str, key: str = "model.path") -> str | None:
    """What makes ``path`` neither an HF model directory nor a Hub model id; None when it may be one (a Hub id is
    looked up only when the model is fetched). Checked before anything heavy is imported."""
    if Path(path).is_dir():
        if not (Path(path) / "config.json").is_file():
            return f"{key} {path!r} is not an HF model directory (no config.json there)"
        return None
    if not _REPO_ID.match(path):
        return (f"{key} {path!r}: no such directory, nor a Hugging Face Hub model id ('org/name'); expected an "
                f"HF-format model directory or a Hub id such as Qwen/Qwen3-0.6B")
    return None


def model_folder(path: str, key: str = "model.path") -> str:
    """The local folder of ``path``: itself when it is one, else the Hub model of that id (fetched or cached)."""
    if problem := local_model_problem(path, key):
        raise ConfigError(problem)
    if Path(path).is_dir():
        return str(path)
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HfHubHTTPError

    try:
        folder = snapshot_download(path, allow_patterns=_MODEL_FILES)
    except (HfHubHTTPError, OSError, ValueError) as exc:
        offline = " (HF_HUB_OFFLINE is set: only the Hub's local cache was looked in)" if _offline() else ""
        raise ConfigError(f"{key} {path!r}: not a local directory, and the Hugging Face Hub model of that id could "
                          f"not be had{offline}: {type(exc).__name__}: {exc}") from None
    if not (Path(folder) / "config.json").is_file():
        raise ConfigError(f"{key} {path!r}: the Hub repository {path} has no config.json (not a transformers model)")
    return folder


def stage_hub_split(path: str, subset: str | None, split: str, out: Path, key: str) -> Path:
    """Split ``split`` of the Hub dataset ``path`` (``hf:ORG/NAME``) as a Parquet file at ``out``."""
    repo = path[len(HUB_DATA):]
    if not _REPO_ID.match(repo):
        raise ConfigError(f"{key} {path!r}: expected hf:ORG/NAME, a Hugging Face Hub dataset id")
    import datasets

    datasets.disable_progress_bars()
    try:
        dataset = datasets.load_dataset(repo, subset, split=split)
    except Exception as exc:  # datasets raises many kinds: missing split, subset, repository, offline
        offline = " (HF_HUB_OFFLINE is set: only the local cache was looked in)" if _offline() else ""
        raise DataError(f"{key} {path!r}: split {split!r} of subset {subset!r} could not be loaded{offline}: "
                        f"{type(exc).__name__}: {exc}") from None
    if len(dataset) == 0:
        raise DataError(f"{key} {path!r}: split {split!r} has no rows")
    out.parent.mkdir(parents=True, exist_ok=True)
    dataset.to_parquet(str(out))
    return out


def _offline() -> bool:
    import os

    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
