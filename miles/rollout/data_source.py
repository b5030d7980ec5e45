"""Prompts from local JSONL or Parquet files, read through ``datasets``."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.errors import DataError

__all__ = ["Prompt", "PromptSource", "read_rows", "encode_prompt", "encode_rows"]

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Prompt:
    index: int  # row in the source file
    prompt: Any  # text, or a list of chat messages
    label: Any
    prompt_ids: list[int]
    extra: dict[str, Any] = field(default_factory=dict)  # the row's other columns (for envs, SFT traces)


def read_rows(path: str | Path, prompt_key: str, label_key: str | None) -> list[dict[str, Any]]:
    """All rows of a JSONL or Parquet file, checked to hold ``prompt_key`` (and ``label_key``)."""
    import datasets

    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist (expected a .jsonl or .parquet file)")
    builder = _FORMATS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"data file {str(path)!r}: unsupported extension {path.suffix!r}; expected .jsonl or .parquet")
    if builder == "json":
        _check_jsonl(path)
    datasets.disable_progress_bars()
    try:
        dataset = datasets.load_dataset(builder, data_files=str(path), split="train", keep_in_memory=True)
    except Exception as exc:
        raise DataError(f"data file {str(path)!r} could not be read as {builder}: {type(exc).__name__}: {exc}") from exc
    if len(dataset) == 0:
        raise DataError(f"data file {str(path)!r} has no rows")
    for key, what in ((prompt_key, "data.prompt_key"), (label_key, "data.label_key")):
        if key is not None and key not in dataset.column_names:
            raise DataError(
                f"data file {str(path)!r}: rows have no {key!r} column ({what}); its columns are: "
                f"{', '.join(dataset.column_names)}. Set {what} to the column that holds it."
            )
    rows = dataset.to_list()
    empty = [i for i, row in enumerate(rows) if row[prompt_key] in (None, "", [])]
    if empty:
        raise DataError(f"data file {str(path)!r}: row(s) {empty[:5]} have an empty {prompt_key!r}")
    return rows


def _check_jsonl(path: Path) -> None:
    """Name the file and the 1-based line of the first row that is not a JSON object."""
    rows = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"data file {str(path)!r}, line {number}: not UTF-8 text "
                                f"(is it a binary file?)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"data file {str(path)!r}, line {number}: not valid JSON ({exc.msg} at column "
                                f"{exc.colno}); each line must hold one JSON object") from None
            if not isinstance(row, dict):
                raise DataError(f"data file {str(path)!r}, line {number}: expected a JSON object "
                                f"({{\"prompt\": ...}}), got {type(row).__name__}")
            rows += 1
    if rows == 0:
        raise DataError(f"data file {str(path)!r} has no rows (it is empty); expected one JSON object per line")


def encode_prompt(tokenizer: Any, prompt: Any, chat_template: bool) -> list[int]:
    """Token ids for a prompt: through the chat template when asked, else plain encoding."""
    if chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    if isinstance(prompt, list):
        raise DataError("a prompt is a list of chat messages but the tokenizer has no chat template")
    return tokenizer(str(prompt))["input_ids"]


def encode_rows(rows: list[dict[str, Any]], tokenizer: Any, *, prompt_key: str, label_key: str | None,
                chat_template: str | bool) -> list[Prompt]:
    """Every row as a :class:`Prompt`, its token ids encoded once (through the chat template when used)."""
    use_template = _use_chat_template(tokenizer, chat_template)
    return [Prompt(i, row[prompt_key], row.get(label_key) if label_key else None,
                   encode_prompt(tokenizer, row[prompt_key], use_template),
                   {k: v for k, v in row.items() if k not in (prompt_key, label_key)})
            for i, row in enumerate(rows)]


class PromptSource:
    """Serves prompts in a seeded shuffled order, epoch after epoch; ``position`` counts prompts served.
    Prompts given back with :meth:`requeue` (admitted but never trained: a stale group to generate again,
    what a checkpoint of a one_step_off/async run had in flight) are served first."""

    def __init__(self, rows: list[dict[str, Any]], tokenizer: Any, *, prompt_key: str, label_key: str,
                 chat_template: str | bool, shuffle: bool, seed: int) -> None:
        prompts = encode_rows(rows, tokenizer, prompt_key=prompt_key, label_key=label_key, chat_template=chat_template)
        self._init(prompts, shuffle, seed)

    @classmethod
    def from_prompts(cls, prompts: list[Prompt], *, shuffle: bool, seed: int) -> "PromptSource":
        """A source over prompts encoded already (see :func:`encode_rows`)."""
        source = cls.__new__(cls)
        source._init(list(prompts), shuffle, seed)
        return source

    def _init(self, prompts: list[Prompt], shuffle: bool, seed: int) -> None:
        self.prompts = prompts
        self.shuffle = shuffle
        self.seed = seed
        self.position = 0
        self.requeued: list[Prompt] = []
        self._order: list[int] = []
        self._epoch = -1

    def __len__(self) -> int:
        return len(self.prompts)

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch
        return self._order

    def requeue(self, prompts: list[Prompt]) -> None:
        self.requeued += prompts

    def draw(self, count: int, chooser: Any = None) -> list[Prompt]:
        """``count`` prompts: requeued ones first, then the chooser's (a selector's ``choose_prompts``) or the next
        in order."""
        out, self.requeued = self.requeued[:count], self.requeued[count:]
        if len(out) < count:
            out += chooser.choose_prompts(self, count - len(out)) if chooser else self.next(count - len(out))
        return out

    def next(self, count: int) -> list[Prompt]:
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.position, len(self.prompts))
            out.append(self.prompts[self._order_for(epoch)[offset]])
            self.position += 1
        return out


def _use_chat_template(tokenizer: Any, setting: str | bool) -> bool:
    if setting in ("auto",):
        return getattr(tokenizer, "chat_template", None) is not None
    if setting in (True, "true"):
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError("data.chat_template is true but the tokenizer has no chat template")
        return True
    return False
