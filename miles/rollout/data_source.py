"""Prompts from local JSONL files (each line as JSON reads it) or Parquet files (read through ``datasets``), and the
checks made on them before a run starts: every row has a prompt, every label fits the run's reward
(:func:`check_labels`), and the tokenizer can encode the text (:func:`check_unknown_tokens`). Rows are named by
their 1-based line in a JSONL file (blank lines counted), by their 1-based row number in a Parquet file.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.errors import DataError
from miles.models.images import MAX_PIXELS, ImageProblem, content_text, image_refs, load_image
from miles.models.vision import ImageEncoder, ProcessedImage
from miles.rewards.labels import LabelNeed, is_empty_label, label_problem, show_label

__all__ = ["Prompt", "PromptSource", "Rows", "check_images", "check_labels", "check_unknown_tokens",
           "encode_prompt", "encode_rows", "read_rows", "unknown_token_id", "where_in_file"]

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Prompt:
    index: int  # row in the source file, from 0
    prompt: Any  # text, or a list of chat messages
    label: Any
    prompt_ids: list[int]
    extra: dict[str, Any] = field(default_factory=dict)  # the row's other columns (for envs, SFT traces)
    line: int | None = None  # where the row is in its file: 1-based line of a JSONL file, row of a Parquet file
    images: tuple[ProcessedImage, ...] = ()  # a vision-language model's: one per image span of prompt_ids


class Rows(list):
    """The rows of a data file (dicts), with ``lines[i]``, where row ``i`` is in the file: its 1-based line in a
    JSONL file, its 1-based row number in a Parquet file. A slice keeps the lines of its rows."""

    def __init__(self, rows: Iterable[dict[str, Any]] = (), lines: Iterable[int] = (),
                 path: Path | None = None) -> None:
        super().__init__(rows)
        self.lines = list(lines)
        self.path = path  # the file, which errors name
        self.folder = path.parent if path is not None else None  # relative image paths are taken from it

    def __getitem__(self, item: Any) -> Any:
        if isinstance(item, slice):
            return Rows(super().__getitem__(item), self.lines[item], self.path)
        return super().__getitem__(item)


def data_file_problem(path: str | Path) -> str | None:
    """What makes ``path`` no data file Miles reads (it is not there, or not JSONL or Parquet); None when it is one.
    Checked before anything heavy is imported (``miles config``, the start of ``miles train``)."""
    path = Path(path)
    if not path.is_file():
        return f"data file {str(path)!r} does not exist (expected a .jsonl or .parquet file)"
    if path.suffix.lower() not in _FORMATS:
        return f"data file {str(path)!r}: unsupported extension {path.suffix!r}; expected .jsonl or .parquet"
    return None


def read_rows(path: str | Path, prompt_key: str, label_key: str | None, images: bool = False) -> Rows:
    """All rows of a JSONL or Parquet file, checked to hold ``prompt_key`` (and ``label_key``), every row with
    every column of the file (None where a JSONL row has not got it). Every image the prompts name is checked;
    prompts with images are refused unless ``images`` (the model is a vision-language model).

    A JSONL line is taken as JSON reads it: a label ``"007"`` stays that string and ``7`` an integer, where
    ``datasets`` would make both numbers of one type (``7.0``, or ``7`` for ``"007"`` in a column of mixed types)."""
    path = Path(path)
    if problem := data_file_problem(path):
        raise DataError(problem)
    builder = _FORMATS[path.suffix.lower()]
    if builder == "json":
        lines, raw = zip(*_read_jsonl(path))
    else:
        raw = _read_parquet(path)
        lines = tuple(range(1, len(raw) + 1))
    columns = list(dict.fromkeys(key for row in raw for key in row))
    for key, what in ((prompt_key, "data.prompt_key"), (label_key, "data.label_key")):
        if key is not None and key not in columns:
            raise DataError(
                f"data file {str(path)!r}: rows have no {key!r} column ({what}); its columns are: "
                f"{', '.join(columns)}. Set {what} to the column that holds it."
            )
    _check_prompts_present(path, raw, lines, prompt_key)
    rows = Rows(({column: row.get(column) for column in columns} for row in raw), lines, path)
    if (holding := check_images(rows, path, prompt_key)) and not images:
        first = next(line for row, line in zip(rows, lines) if image_refs(row[prompt_key]))
        raise DataError(f"data file {str(path)!r}, line {first}: the prompt holds images ({holding} prompt(s) of the "
                        f"file do), and the model is text-only (its config has no vision tower). Train a "
                        f"vision-language model (model.build.arch: qwen2_5_vl, or a Qwen2.5-VL model.path), or "
                        f"leave the image parts out of data.prompt_key's messages")
    return rows


def _check_prompts_present(path: Path, rows: Sequence[dict[str, Any]], lines: Sequence[int], prompt_key: str) -> None:
    """Every row holds a prompt: refuse, naming the lines, rows without the key (missing) or with an empty one."""
    missing = [line for row, line in zip(rows, lines) if prompt_key not in row]
    empty = [line for row, line in zip(rows, lines) if prompt_key in row and row[prompt_key] in (None, "", [])]
    problems = []
    if missing:
        problems.append(f"{_places(path, missing)} {'has' if len(missing) == 1 else 'have'} no {prompt_key!r} "
                        f"(missing)")
    if empty:
        problems.append(f"{_places(path, empty)} {'has' if len(empty) == 1 else 'have'} an empty {prompt_key!r} "
                        f"(null, \"\" or [])")
    if problems:
        raise DataError(f"data file {str(path)!r}: {'; '.join(problems)}. Every row needs a prompt "
                        f"(data.prompt_key): text, or a list of chat messages")


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import datasets

    datasets.disable_progress_bars()
    try:
        dataset = datasets.load_dataset("parquet", data_files=str(path), split="train", keep_in_memory=True)
    except Exception as exc:
        raise DataError(f"data file {str(path)!r} could not be read as parquet: {type(exc).__name__}: {exc}") from exc
    if len(dataset) == 0:
        raise DataError(f"data file {str(path)!r} has no rows")
    return dataset.to_list()


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(1-based line, row) of every non-blank line; a line that is not a JSON object is an error naming it."""
    rows = []
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
            rows.append((number, row))
    if not rows:
        raise DataError(f"data file {str(path)!r} has no rows (it is empty); expected one JSON object per line")
    return rows


def _places(path: str | Path, numbers: Sequence[int], limit: int = 10) -> str:
    """``lines 3, 8`` (a JSONL file) or ``rows 3, 8`` (Parquet); past ``limit``, the first ones and the count."""
    unit = "row" if str(path).lower().endswith(".parquet") else "line"
    shown = ", ".join(map(str, numbers[:limit]))
    if len(numbers) > limit:
        shown += f", ... ({len(numbers)} in all)"
    return f"{unit}{'s' if len(numbers) > 1 else ''} {shown}"


def where_in_file(path: str | Path, prompt: Prompt) -> str:
    """Where a prompt is in its file (``line 38``); ``row N`` from its index when its line is not known."""
    return _places(path, [prompt.line]) if prompt.line is not None else f"row {prompt.index + 1}"


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
                chat_template: str | bool, images: "ImageEncoder | None" = None) -> list[Prompt]:
    """Every row as a :class:`Prompt`, its token ids encoded once (through the chat template when used); with
    ``images`` (a vision-language model's), each prompt's images read and its image spans widened."""
    use_template = _use_chat_template(tokenizer, chat_template)
    lines = getattr(rows, "lines", None) or [None] * len(rows)
    prompts = []
    for i, (row, line) in enumerate(zip(rows, lines)):
        try:
            ids, held = encode_prompt(tokenizer, row[prompt_key], use_template), ()
        except Exception as exc:
            from miles.models.hf import chat_template_problem

            if (problem := chat_template_problem(exc)) is None:  # not the template's code: a bug, with its traceback
                raise
            path = getattr(rows, "path", None)
            place = f"data file {str(path)!r}, " if path is not None else ""
            raise DataError(f"{place}{f'line {line}' if line else f'row {i + 1}'}: the chat template cannot render "
                            f"this prompt: at its line {problem[0]}, {problem[1]} (the template of "
                            f"model.chat_template, else the tokenizer's own; data.chat_template: false encodes "
                            f"prompts without it)") from None
        if images is not None and (refs := image_refs(row[prompt_key])):
            try:
                ids, held = images.encode(ids, refs, getattr(rows, "folder", None))
            except (ImageProblem, ValueError) as exc:
                raise DataError(f"{f'line {line}' if line else f'row {i + 1}'}: {exc}") from exc
        prompts.append(Prompt(i, row[prompt_key], row.get(label_key) if label_key else None, ids,
                              {k: v for k, v in row.items() if k not in (prompt_key, label_key)}, line, held))
    return prompts


# -- checks before a run starts -------------------------------------------------------------------------------


def check_labels(prompts: Sequence[Prompt], path: str | Path, label_key: str, need: LabelNeed) -> None:
    """Refuse data (a :class:`DataError` naming the file and lines) whose labels cannot be used by what needs them
    (``need``: the run's reward, the SFT warm-up): no label at all, rows without one, or labels of another type."""
    if not prompts:
        return
    path = str(path)
    if all(q.label is None for q in prompts):
        others = sorted({key for q in prompts for key in q.extra})
        columns = f"its other columns are: {', '.join(others)}" if others else "it has no other column"
        instead = "" if need.who else ", or use a reward that needs none"
        raise DataError(
            f"data file {path!r}: no row has a {label_key!r} (data.label_key), the reference answer that "
            f"{need.subject} needs; {columns}. Set data.label_key to the column that holds them{instead}")
    missing = [q.line or q.index + 1 for q in prompts if is_empty_label(q.label)]
    wrong = [(q, problem) for q in prompts
             if not is_empty_label(q.label) and (problem := label_problem(q.label, need.types)) is not None]
    problems = []
    if missing:
        problems.append(f"{_places(path, missing)} ({len(missing)} of {len(prompts)} rows) "
                        f"{'has' if len(missing) == 1 else 'have'} no {label_key!r} (data.label_key; missing, null or "
                        f"empty), which {need.subject} needs")
    if wrong:
        first, problem = wrong[0]
        also = [q.line or q.index + 1 for q, _ in wrong[1:]]
        problems.append(f"{where_in_file(path, first)}: {need.subject} cannot use its {label_key!r}: "
                        f"{problem}{f' ({_places(path, also)} too)' if also else ''}")
    if len(problems) == 2:  # both kinds at once, so that one run names every row to fix
        raise DataError(f"data file {path!r}: {problems[0]}; and {problems[1]}. Add or correct the labels, or remove "
                        f"those rows")
    if missing:
        raise DataError(f"data file {path!r}: {problems[0]}. Add the labels, or remove those rows")
    if wrong:
        raise DataError(f"data file {path!r}, {problems[0]}")


def check_images(rows: Rows, path: str | Path, prompt_key: str, max_pixels: int = MAX_PIXELS) -> int:
    """Every image the rows' prompts name (:func:`miles.models.images.image_refs`) is read whole and fits the rules
    of :func:`miles.models.images.load_image`; a :class:`DataError` names the file, the 1-based line and the image
    of every bad one (the first 5). Returns how many prompts hold images."""
    problems, holding = [], 0
    for row, line in zip(rows, rows.lines):
        refs = image_refs(row.get(prompt_key))
        holding += bool(refs)
        for number, ref in enumerate(refs, 1):
            try:
                load_image(ref, Path(path).parent, max_pixels=max_pixels)
            except ImageProblem as exc:
                problems.append(f"line {line}, image {number} of the prompt: {exc}")
    if problems:
        more = f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise DataError(f"data file {str(path)!r}: {len(problems)} image(s) cannot be read:\n  "
                        + "\n  ".join(problems[:5]) + more)
    return holding


def unknown_token_id(tokenizer: Any) -> int | None:
    """The token a tokenizer puts for text it cannot encode; None when it has none, or when that token is also its
    end, start or padding token (byte-level BPE tokenizers name ``<|endoftext|>`` so, and never produce it for text:
    every byte has a token)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return None
    others = {getattr(tokenizer, f"{kind}_token_id", None) for kind in ("eos", "bos", "pad")}
    return None if unk in others else unk


def check_unknown_tokens(prompts: Sequence[Prompt], tokenizer: Any, path: str | Path, max_frac: float) -> int:
    """How many prompts hold the tokenizer's unknown token (text it cannot encode, which the model never sees).
    Above ``max_frac`` of them (``data.max_unk_prompt_frac``) a :class:`DataError`; below, a line on stderr."""
    unk = unknown_token_id(tokenizer)
    found = [q for q in prompts if unk is not None and unk in q.prompt_ids]
    if not found:
        return 0
    path = str(path)
    example = (f"{where_in_file(path, found[0])} ({show_label(found[0].prompt)}): "
               f"{_unknown_characters(found[0].prompt, tokenizer, unk)}")
    if len(found) > 1:
        example += f"; also {_places(path, [q.line or q.index + 1 for q in found[1:]])}"
    what = (f"{len(found)} of {len(prompts)} prompt(s) of data file {path!r} hold text the tokenizer cannot encode, "
            f"which becomes {tokenizer.unk_token!r} (the model never sees it)")
    if len(found) / len(prompts) > max_frac:
        raise DataError(f"{what}: {example}. At most data.max_unk_prompt_frac={max_frac:g} of the prompts may; "
                        f"normalise the text (e.g. Unicode NFKC), use a tokenizer that covers it, or raise "
                        f"data.max_unk_prompt_frac")
    print(f"data: {what}: {example} (allowed: data.max_unk_prompt_frac={max_frac:g})", file=sys.stderr)
    return len(found)


def _unknown_characters(prompt: Any, tokenizer: Any, unk: int, limit: int = 5) -> str:
    """The characters of a prompt's text that the tokenizer cannot encode, each with its code point."""
    text = prompt if isinstance(prompt, str) else " ".join(
        content_text(m.get("content"), " ") if isinstance(m, dict) else str(m) for m in prompt)
    unknown = [c for c in dict.fromkeys(text) if unk in tokenizer(c, add_special_tokens=False)["input_ids"]]
    if not unknown:
        return "its text encodes, the chat template's does not (model.chat_template, data.chat_template)"
    shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in unknown[:limit])
    return shown + (f" and {len(unknown) - limit} more" if len(unknown) > limit else "")


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
