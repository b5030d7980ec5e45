"""Chat formats: how one model family talks, as data (registry kind ``chat_format``).

A :class:`ChatFormat` names the tokens that end a policy turn and stop generation, how a generated turn
joins the suffix the template renders after it, the tool-call id form and argument form, where reasoning
goes in a message, its tool parser and reasoning parser, and the training template Miles renders with
(shipped in ``miles/templates``) where the family's published template is not append-only.

:func:`bind` checks a format against a tokenizer (every token it names must be one token there) and
resolves the ids once; :func:`detect` picks the format a tokenizer speaks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.agentic.types import Message, ToolCall

__all__ = ["BoundFormat", "ChatFormat", "ReasoningSplit", "bind", "builtin_formats", "detect", "for_tokenizer",
           "generation_eos_ids", "resolve"]


@dataclass(frozen=True)
class ChatFormat:
    """One model family's chat format. Registered with ``miles_register_chat_formats``.

    ``end_of_turn``: the tokens that close an assistant turn in the rendered history (the first is the
    usual one); a generated turn that ends with any of them joins the suffix right after the history's
    closing token. ``stop_tokens``: further tokens at which generation stops (gpt-oss' ``<|call|>``,
    Llama's ``<|eom_id|>``). ``next_role_tokens``: stop tokens that open the next message too (GLM's
    ``<|observation|>`` and ``<|user|>``): the suffix after such a turn starts after that token, which the
    policy generated. ``tool_call_id``: ``call_{index}`` style (``{index}``: the call's position in the
    trajectory, ``{name}``: the tool), or ``alnum9`` (nine letters and digits, Mistral). ``arguments``:
    ``json`` (a JSON string, OpenAI's form) or ``mapping`` (a dict, what GLM's and Kimi's templates read).
    ``reasoning_field``: the message field parsed reasoning goes to (``reasoning_content``, ``thinking``),
    or None to leave it in the content; ``always_reasons``: the generation prompt opens the reasoning, so
    every turn has some. ``template``: a template shipped in ``miles/templates`` (by
    name) to render with instead of the tokenizer's own. ``identify``: tokens whose presence in a
    vocabulary makes the format a candidate; ``template_markers``: substrings of a tokenizer's own chat
    template that single it out among candidates. ``template_kwargs``: defaults for the template's
    variables (``model.chat_template_kwargs`` overrides them). ``differs_from_deployment``: what the
    training template renders differently from the published one (docs).
    """

    name: str
    end_of_turn: tuple[str, ...]
    tool_parser: str = "hermes"
    reasoning_parser: str | None = None
    stop_tokens: tuple[str, ...] = ()
    next_role_tokens: tuple[str, ...] = ()
    tool_call_id: str = "call_{index}"
    arguments: str = "json"
    reasoning_field: str | None = None
    always_reasons: bool = False  # the generation prompt opens the reasoning (QwQ, DeepSeek-R1)
    one_call_per_turn: bool = False  # generation stops after each call (gpt-oss' <|call|>): calls come one turn each
    template: str | None = None
    identify: tuple[str, ...] = ()
    template_markers: tuple[str, ...] = ()
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    differs_from_deployment: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        if not self.end_of_turn:
            raise ValueError(f"chat format {self.name!r}: end_of_turn must name at least one token")
        if self.arguments not in ("json", "mapping"):
            raise ValueError(f"chat format {self.name!r}: arguments must be 'json' or 'mapping', "
                             f"got {self.arguments!r}")
        if self.tool_call_id != "alnum9":
            fields = {f for _, f, _, _ in string.Formatter().parse(self.tool_call_id) if f}
            if not fields <= {"index", "name"}:
                raise ValueError(f"chat format {self.name!r}: tool_call_id may use {{index}} and {{name}}, "
                                 f"got {self.tool_call_id!r}")

    @property
    def all_stop_tokens(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.end_of_turn, *self.stop_tokens, *self.next_role_tokens)))

    def call_id(self, index: int, name: str, seed: str = "") -> str:
        """The id of the ``index``-th call of a trajectory (``seed``: the trajectory's key, for ``alnum9``)."""
        if self.tool_call_id == "alnum9":
            digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
            alphabet = string.ascii_letters + string.digits
            return "".join(alphabet[b % len(alphabet)] for b in digest[:9])
        return self.tool_call_id.format(index=index, name=name)

    def message_call(self, call: ToolCall) -> dict[str, Any]:
        """A parsed call in the ``tool_calls`` shape this format's template reads."""
        arguments = call.arguments if self.arguments == "mapping" else json.dumps(call.arguments, ensure_ascii=False)
        return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


@dataclass
class ReasoningSplit:
    """A generated turn's text cut into its reasoning (None when it has none) and the rest."""

    reasoning: str | None
    content: str


class ThinkTagReasoning:
    """``<think>...</think>`` before the answer (Qwen3, QwQ, DeepSeek-R1, GLM). The text around the tags keeps
    what the family's template puts there: ``strip`` characters are removed on both sides of each part.
    ``opened_by_prompt``: the generation prompt already holds ``<think>`` (QwQ, DeepSeek-R1), so a turn may
    start inside the reasoning. Registered as reasoning parser ``think``."""

    def __init__(self, open_tag: str = "<think>", close_tag: str = "</think>", strip: str = "\n",
                 opened_by_prompt: bool = False) -> None:
        self.open_tag, self.close_tag, self.strip, self.opened_by_prompt = open_tag, close_tag, strip, opened_by_prompt

    def split(self, text: str) -> ReasoningSplit:
        head, sep, rest = text.partition(self.close_tag)
        if not sep:
            if text.lstrip().startswith(self.open_tag):  # reasoning that never closed: all of it is reasoning
                return ReasoningSplit(text.lstrip()[len(self.open_tag):].strip(self.strip), "")
            return ReasoningSplit(None, text)
        start = head.find(self.open_tag)
        if start < 0 and not self.opened_by_prompt:
            return ReasoningSplit(None, text)
        reasoning = head[start + len(self.open_tag):] if start >= 0 else head
        return ReasoningSplit(reasoning.strip(self.strip), rest.lstrip(self.strip))


@dataclass(frozen=True)
class BoundFormat:
    """A format checked against one tokenizer: its token ids, its template text and keyword arguments."""

    format: ChatFormat
    tokenizer: Any
    template: str  # the Jinja text every rendering uses
    template_kwargs: dict[str, Any]
    end_of_turn_ids: frozenset[int]
    next_role_ids: frozenset[int]
    stop_ids: tuple[int, ...]  # the format's stop tokens and the checkpoint's EOS ids
    tool_parser: Any = None
    reasoning_parser: Any = None

    @property
    def name(self) -> str:
        return self.format.name

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.convert_ids_to_tokens(token_id)

    def request_stop_ids(self, user_stop_ids: Iterable[int] = ()) -> list[int]:
        """The ``stop_token_ids`` of every request of a trajectory."""
        return sorted({*user_stop_ids, *self.stop_ids})


def _token_id(tokenizer: Any, text: str) -> int | None:
    token_id = tokenizer.convert_tokens_to_ids(text)
    if not isinstance(token_id, int) or (token_id == tokenizer.unk_token_id and text != tokenizer.unk_token):
        return None
    return token_id


def generation_eos_ids(model_dir: str | Path | None) -> list[int]:
    """The EOS ids of a checkpoint's ``generation_config.json`` (an int or a list), or none."""
    if model_dir is None:
        return []
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def bind(fmt: ChatFormat, tokenizer: Any, *, template: str | None = None, template_kwargs: dict[str, Any] | None = None,
         eos_ids: Iterable[int] = (), build_parser: Callable[[str, str], Any] | None = None) -> BoundFormat:
    """Check ``fmt`` against ``tokenizer`` and resolve its ids.

    ``template`` (Jinja text) overrides the format's training template, which overrides the tokenizer's
    own. ``eos_ids`` are the checkpoint's generation EOS ids, added to the stop ids. ``build_parser(kind,
    name)`` builds the tool and reasoning parsers (the registry's build); without it they stay None.
    """
    from miles.models.hf import read_chat_template

    missing = [t for t in fmt.all_stop_tokens if _token_id(tokenizer, t) is None]
    if missing:
        raise ValueError(f"chat format {fmt.name!r} needs the token(s) {', '.join(missing)}, which the tokenizer "
                         f"does not have as single tokens")
    text = template or (read_chat_template(fmt.template) if fmt.template else getattr(tokenizer, "chat_template", None))
    if not text:
        raise ValueError(f"chat format {fmt.name!r} has no training template and the tokenizer has no chat template; "
                         f"set model.chat_template")
    ids = {t: _token_id(tokenizer, t) for t in fmt.all_stop_tokens}
    eos = {i for i in eos_ids if i is not None}
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    kwargs = {**fmt.template_kwargs, **(template_kwargs or {})}
    if fmt.arguments == "json" and _quotes_string_arguments(tokenizer, text, kwargs):
        fmt = dataclasses.replace(fmt, arguments="mapping")  # as a deployed server hands such a template the calls
    return BoundFormat(
        format=fmt, tokenizer=tokenizer, template=text, template_kwargs=kwargs,
        end_of_turn_ids=frozenset(ids[t] for t in fmt.end_of_turn),
        next_role_ids=frozenset(ids[t] for t in fmt.next_role_tokens),
        stop_ids=tuple(sorted({*ids.values(), *eos})),
        tool_parser=build_parser("tool_parser", fmt.tool_parser) if build_parser else None,
        reasoning_parser=build_parser("reasoning_parser", fmt.reasoning_parser)
        if build_parser and fmt.reasoning_parser else None,
    )


def _quotes_string_arguments(tokenizer: Any, template: str, kwargs: dict[str, Any]) -> bool:
    """Whether ``template`` JSON-encodes a call's arguments given as a JSON string (``arguments | tojson``), so that
    they render quoted twice (``"{\\"a\\": 2}"``): such a template reads them as a mapping. Told by rendering one
    call; a template that cannot render it keeps the format's form."""
    probe = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call_0", "type": "function", "function": {"name": "probe", "arguments": '{"probe": 1}'}}]},
             {"role": "tool", "tool_call_id": "call_0", "name": "probe", "content": "1"}]
    tools = [{"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {
        "probe": {"type": "integer"}}}}}]
    try:
        text = tokenizer.apply_chat_template(probe, tools=tools, tokenize=False, chat_template=template, **kwargs)
    except Exception:  # noqa: BLE001 - any refusal of the template's own: nothing to tell
        return False
    return '\\"probe\\"' in text


def detect(formats: dict[str, ChatFormat], tokenizer: Any) -> tuple[ChatFormat | None, list[str]]:
    """The format ``tokenizer`` speaks, and the candidates considered.

    A format is a candidate when the vocabulary has every token it names (``identify`` and its stop
    tokens). Among several, those whose ``template_markers`` all appear in the tokenizer's own chat
    template win; the most specific (most tokens named) then. Returns ``(None, candidates)`` when no
    format or several equally good ones fit.
    """
    own = getattr(tokenizer, "chat_template", None) or ""
    candidates = [f for f in formats.values()
                  if all(_token_id(tokenizer, t) is not None for t in (*f.identify, *f.all_stop_tokens))]
    if not candidates:
        return None, []
    # A vocabulary may hold the tokens of several families (Llama-3's and ChatML's): the template writes those of
    # the one it renders (a stop token, or the tokenizer's EOS by name)
    eos = getattr(tokenizer, "eos_token", None)
    written = [f for f in candidates if any(t in own or (t == eos and "eos_token" in own) for t in f.all_stop_tokens)]
    pool = written or candidates
    marked = [f for f in pool if f.template_markers and all(m in own for m in f.template_markers)]
    pool = marked or [f for f in pool if not f.template_markers] or pool
    best = max(len(set(f.identify) | set(f.all_stop_tokens)) for f in pool)
    top = [f for f in pool if len(set(f.identify) | set(f.all_stop_tokens)) == best]
    names = [f.name for f in candidates]
    return (top[0] if len(top) == 1 else None), names


_ALNUM9 = re.compile(r"^[A-Za-z0-9]{9}$")


def is_alnum9(call_id: str) -> bool:
    return bool(_ALNUM9.match(call_id))


def assistant_message(fmt: ChatFormat, content: str, reasoning: str | None, calls: list[ToolCall]) -> Message:
    """The assistant message a generated turn stands for, in the shape the format's template reads."""
    message: Message = {"role": "assistant", "content": content}
    if reasoning is not None:
        if fmt.reasoning_field:
            message[fmt.reasoning_field] = reasoning
    if calls:
        message["tool_calls"] = [fmt.message_call(c) for c in calls]
    return message


def builtin_formats() -> dict[str, ChatFormat]:
    """The builtin formats by name (without a plugin manager: for code that has only a tokenizer)."""
    from miles.agentic import formats

    return {f.name: f for f in formats.formats()}


def _builtin_parser(kind: str, name: str) -> Any:
    """A builtin parser of ``kind`` by name, without a plugin manager (what the builtin plugins register)."""
    from miles.agentic import formats
    from miles.agentic.tool_calls import HermesParser, PythonBlockParser

    generic: dict[str, Any] = {"hermes": HermesParser, "python_block": PythonBlockParser} \
        if kind == "tool_parser" else {"think": ThinkTagReasoning}
    return {**generic, **formats.parsers(kind)}[name]()


def generic_format(tokenizer: Any) -> ChatFormat:
    """A format for a tokenizer no builtin fits: its turns end at ``<|im_end|>``, ``<|eot_id|>`` or
    ``<end_of_turn>`` when it has one, else at EOS; Hermes tool calls."""
    for text in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        if _token_id(tokenizer, text) is not None:
            return ChatFormat(name="generic", end_of_turn=(text,))
    return ChatFormat(name="generic", end_of_turn=(tokenizer.eos_token,))


def for_tokenizer(tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> BoundFormat:
    """The builtin format ``tokenizer`` speaks (detected; else :func:`generic_format`), bound to it with the
    tokenizer's own chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; multi-turn rollouts render messages with one "
                         "(set model.chat_template, e.g. chatml_tools, or model.tokenizer.chat_template for a built "
                         "tokenizer)")
    fmt, _ = detect(builtin_formats(), tokenizer)
    return bind(fmt or generic_format(tokenizer), tokenizer, template=tokenizer.chat_template,
                template_kwargs=template_kwargs, build_parser=_builtin_parser)


def resolve(formats: dict[str, ChatFormat], choice: str, tokenizer: Any) -> tuple[ChatFormat | None, str]:
    """The format for ``model.chat_format`` (a name, or ``auto``: detected) and a line saying how it was chosen.

    ``auto`` gives None (and says why) when no format fits; several equally good candidates are an error
    naming them.
    """
    if choice != "auto":
        if choice not in formats:
            raise KeyError(choice)
        return formats[choice], f"chat format: {choice} (model.chat_format)"
    fmt, candidates = detect(formats, tokenizer)
    if fmt is not None:
        others = f"; candidates: {', '.join(candidates)}" if len(candidates) > 1 else ""
        return fmt, f"chat format: {fmt.name} (detected from the tokenizer{others})"
    if candidates:
        raise ValueError(f"the tokenizer fits several chat formats ({', '.join(candidates)}) and its "
                         f"chat template does not tell them apart; set model.chat_format to one of them")
    return None, "chat format: none detected (single-turn prompts use the tokenizer's chat template, if any)"
