"""The ``math`` reward: the response's final answer against the label, equal as numbers or expressions.

The answer is found here, with regular expressions (:func:`extract_answer`); two plain numbers are
compared here too. Anything else goes to math-verify (sympy), which runs in a process of its own
(:mod:`miles.rewards._math_worker`): a comparison past ``compare_timeout_s`` kills that process, so a symbolic
blow-up costs its time limit and nothing more, in whatever thread the reward runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction
from typing import Any

from miles.rewards.labels import require_label
from miles.types import Sample

__all__ = ["extract_answer", "math_reward", "same_value"]

MAX_ANSWER_CHARS = 1000  # a longer "answer" is not one: scored 0 without parsing it
STARTUP_TIMEOUT_S = 60.0  # the comparison process imports sympy once
MAX_IDLE_WORKERS = 4
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_worker.py")  # the comparison process

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_PHRASE = re.compile(r"(?:\banswer\b(?:\s+is\b[ \t]*:?|\s*[:=])|####)[ \t]*(?:\*\*)?[ \t]*", re.IGNORECASE)
_PROSE = re.compile(r"(?<![\\{A-Za-z])[A-Za-z]{3,}")  # a word, not a LaTeX command: "$5 for a pen and $"
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?%?|-?\.\d+")
_SENTENCE_END = re.compile(r"[.;!?](?=\s|$)|,\s+(?=[A-Za-z]{2,})|\n")
_PLAIN = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_FRACTION = re.compile(r"(-?\d+)\s*/\s*(\d+)|(-)?\\[dt]?frac\{(\d+)\}\{(\d+)\}")


def math_reward(sample: Sample, boxed_only: bool = False, compare_timeout_s: float = 5.0) -> float:
    """1.0 when the response's final answer equals the label as a number or an expression, else 0.0.

    The answer is the last ``\\boxed{...}``; without one (and unless ``boxed_only``), what follows the
    last "answer is" / "answer:" / "####" up to the end of its sentence, else the last ``$...$`` span
    (that is not prose: currency signs pair up too), else the last number. ``compare_timeout_s``
    bounds a symbolic comparison. The answer found, and why it scored 0 when no comparison decided it
    (none found, a time-out), are in ``sample.metadata["reward_info"]``.
    """
    gold = _gold(sample.label)
    answer = extract_answer(sample.response_text, boxed_only=boxed_only)
    if answer is None:
        sample.metadata["reward_info"] = {"reason": "no \\boxed{} answer" if boxed_only else "no answer found"}
        return 0.0
    if len(answer) > MAX_ANSWER_CHARS:
        sample.metadata["reward_info"] = {"reason": f"answer longer than {MAX_ANSWER_CHARS} characters"}
        return 0.0
    equal, problem = same_value(gold, answer, compare_timeout_s)
    sample.metadata["reward_info"] = {"answer": answer, **({"reason": problem} if problem else {})}
    return float(equal)


def _check_math_args(args: dict[str, Any]) -> None:
    if not args["compare_timeout_s"] > 0:
        raise ValueError(f"compare_timeout_s: expected a positive number of seconds, "
                         f"got {args['compare_timeout_s']!r}")
    if importlib.util.find_spec("math_verify") is None:
        raise ValueError("the math reward needs math-verify: "
                         "pip install math-verify==0.9.0 antlr4-python3-runtime==4.13.2")


math_reward.check_args = _check_math_args  # type: ignore[attr-defined]
math_reward.label_types = (str, int, float)  # type: ignore[attr-defined]  # miles.hookspecs.NeedsLabel


# -- finding the answer -------------------------------------------------------------------------------------


def extract_answer(text: str, boxed_only: bool = False) -> str | None:
    """The final answer in a response (see :func:`math_reward`), stripped of ``$`` and a final period;
    None when there is none."""
    boxed = last_boxed(text)
    if boxed is not None or boxed_only:
        return _clean(boxed) if boxed is not None else None
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if phrases:
        rest = text[phrases[-1].end():]
        end = _SENTENCE_END.search(rest)
        answer = _clean(rest[: end.start()] if end else rest)
        if answer:
            return answer
    spans = [next(g for g in span.groups() if g is not None) for span in _MATH_SPAN.finditer(text)]
    spans = [_clean(span) for span in spans if not _PROSE.search(span)]
    if spans and spans[-1]:
        return spans[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(" ", "") if numbers else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox``) whose braces close; escaped braces
    (``\\{``) do not count."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, i = 1, match.end()
        while i < len(text):
            char = text[i]
            if char == "\\":
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth == 0:
                return text[match.end():i]
            i += 1
    return None


def _clean(answer: str) -> str:
    answer = answer.strip().strip("*").strip()
    while len(answer) >= 2 and answer[0] == answer[-1] == "$":
        answer = answer[1:-1].strip()
    return answer.rstrip(".").strip()


def _gold(label: Any) -> str:
    text = str(require_label(label, math_reward.label_types))
    boxed = last_boxed(text)
    if boxed is None and "####" in text:  # a worked solution ending "#### 72" (GSM8K's answer column)
        return _clean(text.rsplit("####", 1)[1])
    return _clean(boxed if boxed is not None else text)


# -- comparing ----------------------------------------------------------------------------------------------


def same_value(gold: str, answer: str, timeout_s: float = 5.0) -> tuple[bool, str | None]:
    """(whether ``answer`` equals ``gold``, why it could not be decided or None).

    Equal strings and plain numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``; relative tolerance
    1e-6) are decided here; the rest by math-verify in the comparison process, within ``timeout_s``.
    """
    if _squash(gold) == _squash(answer):
        return True, None
    gold_number, answer_number = _plain_number(gold), _plain_number(answer)
    if gold_number is not None and answer_number is not None:
        return abs(gold_number - answer_number) <= Fraction(1, 10**6) * max(1, abs(gold_number)), None
    return _POOL.compare(gold, answer, timeout_s)


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _plain_number(text: str) -> Fraction | None:
    text = text.strip()
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    if _PLAIN.fullmatch(text):
        return Fraction(text)
    fraction = _FRACTION.fullmatch(text)
    if fraction is None:
        return None
    num, den, sign, latex_num, latex_den = fraction.groups()
    num, den = (num, den) if num is not None else (f"{sign or ''}{latex_num}", latex_den)
    return Fraction(int(num), int(den)) if int(den) else None


class _Worker:
    """One comparison process: a JSON request per line in, a JSON reply per line out."""

    def __init__(self) -> None:
        # -P: the script's folder is not put on sys.path (this package's modules would shadow others)
        self.proc = subprocess.Popen([sys.executable, "-P", WORKER_SCRIPT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, close_fds=True)
        self._buffer = b""
        ready = self._read_line(time.monotonic() + STARTUP_TIMEOUT_S)
        if ready is None or json.loads(ready).get("ready") is not True:
            self.kill()
            raise RuntimeError(f"the math comparison process did not start within {STARTUP_TIMEOUT_S:g} s (is "
                               f"math-verify installed? pip install math-verify==0.9.0 antlr4-python3-runtime==4.13.2)")

    def ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """The reply, or None when none came within ``timeout_s``."""
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        line = self._read_line(time.monotonic() + timeout_s)
        return None if line is None else json.loads(line)

    def _read_line(self, deadline: float) -> bytes | None:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the math comparison process exited (code {self.proc.wait()})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


class _WorkerPool:
    """Comparison processes, started when first needed and shared by all threads; a process that runs
    past its time limit is killed and a new one is started for the next comparison. Idle processes exit
    when this process does (their stdin closes)."""

    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def compare(self, gold: str, answer: str, timeout_s: float) -> tuple[bool, str | None]:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        worker = worker or _Worker()
        try:
            reply = worker.ask({"gold": gold, "answer": answer, "timeout_s": timeout_s}, timeout_s)
        except BaseException:
            worker.kill()
            raise
        if reply is None:
            worker.kill()
            return False, f"comparison timed out after {timeout_s:g} s"
        with self._lock:
            if len(self._idle) < MAX_IDLE_WORKERS:
                self._idle.append(worker)
                worker = None
        if worker is not None:
            worker.kill()
        return bool(reply["equal"]), reply.get("error")


_POOL = _WorkerPool()
