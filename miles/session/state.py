"""One session of the session server (:mod:`miles.session.server`): its messages and the exact tokens behind
them, and the mark that lets one completion of it run at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from miles.agentic.chat import Conversation, NotAppendOnly, first_differing_token
from miles.agentic.metrics import TITO_STATS, TOOL_STATS
from miles.session.openai_api import ApiError, ChatRequest
from miles.types import SampledWith

__all__ = ["Session", "running"]


@dataclass
class Session:
    """One trajectory: the messages so far and the tokens behind them (``response_ids`` holds every token after
    the first prompt; ``loss_mask`` is 1 on generated tokens, ``logprobs`` 0.0 elsewhere)."""

    id: str
    metadata: dict[str, Any] = field(default_factory=dict)
    conversation: Conversation | None = None  # set by the first completion; holds the messages (normalised)
    tools: list[dict[str, Any]] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)  # one per completion
    sampled_with: list[SampledWith] = field(default_factory=list)  # each completion's sampling parameters
    # on_mismatch split: the trajectory's earlier parts, each {prompt_ids, response_ids, loss_mask, logprobs,
    # weight_versions, sampled_with}; retokenize and split counted as a multi-turn rollout counts them
    segments: list[dict[str, Any]] = field(default_factory=list)
    tito: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TITO_STATS, 0))
    turns: int = 0
    status: str = "open"  # "truncated": the context is full; "aborted": the engine aborted a generation (ended)
    reason: str = ""
    finish_reason: str | None = None  # of the last completion
    last_text: str = ""  # the last completion's text (special tokens removed)
    tool_stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOOL_STATS, 0))
    # Why the last request was refused for the context length (400 context_length_exceeded); cleared by the next
    # completion. The agent rollout function makes such a trajectory a truncated sample.
    context_exceeded: str = ""
    last: tuple[ChatRequest, dict[str, Any]] | None = field(default=None, repr=False)  # the last request and answer
    _idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # set while no completion runs

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def busy(self) -> bool:
        """A completion is running."""
        return not self._idle.is_set()

    async def wait_idle(self) -> None:
        """Until no completion of this session runs (one whose client went away ends once the server notices)."""
        await self._idle.wait()

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.conversation.messages if self.conversation is not None else []

    @property
    def images(self) -> list[Any]:
        """A vision-language model's images of the session's tokens, in order (``ProcessedImage``)."""
        return self.conversation.images if self.conversation is not None else []

    def trajectory(self) -> dict[str, Any]:
        """What ``GET /sessions/{id}`` answers."""
        return {"id": self.id, "metadata": self.metadata, "status": self.status, "reason": self.reason,
                "finish_reason": self.finish_reason, "turns": self.turns, "prompt_ids": self.prompt_ids,
                "response_ids": self.response_ids, "loss_mask": self.loss_mask, "logprobs": self.logprobs,
                "weight_versions": self.weight_versions, "messages": self.messages, "tools": self.tools,
                "tool_stats": self.tool_stats, "context_exceeded": self.context_exceeded or None,
                "images": [image.ref for image in self.images], "tito": self.tito,
                "segments": [{k: v for k, v in part.items() if k != "sampled_with"} for part in self.segments]}

    def split(self, prompt_ids: list[int]) -> None:
        """End the trajectory's current part (kept in ``segments``) and go on from ``prompt_ids``."""
        self.segments.append({"prompt_ids": self.prompt_ids, "response_ids": self.response_ids,
                              "loss_mask": self.loss_mask, "logprobs": self.logprobs,
                              "weight_versions": self.weight_versions, "sampled_with": self.sampled_with})
        self.prompt_ids, self.response_ids, self.loss_mask, self.logprobs = list(prompt_ids), [], [], []
        self.weight_versions, self.sampled_with = [], []

    def resynced(self, conversation: Conversation, new: list[dict[str, Any]], on_mismatch: str
                 ) -> tuple[list[int], Conversation, int]:
        """The history rendered again with ``new`` (``conversation``: a fork of the session's), the tokens to follow
        those of the session that stay, and how many stay: all of it as a new part (split: 0), or from the first
        token that differs from the session's (retokenize, which a changed first prompt cannot take)."""
        rendered = conversation.resync(new)
        if on_mismatch == "split":
            return rendered, conversation, 0
        same = first_differing_token(self.prompt_ids + self.response_ids, rendered)
        if same < len(self.prompt_ids):
            raise NotAppendOnly("the chat template renders the session's first prompt otherwise now; "
                                "on_mismatch retokenize cannot re-render a changed prompt")
        return rendered[same:], conversation, same

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens after the prompt (retokenize: the rest is rendered again)."""
        del self.response_ids[length:], self.loss_mask[length:], self.logprobs[length:]
        self.sampled_with = [entry for entry in self.sampled_with if entry.start < length] or self.sampled_with[:1]

    def _append(self, ids: list[int], logprobs: list[float] | None, from_policy: bool) -> None:
        self.response_ids += ids
        self.loss_mask += [int(from_policy)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


@contextmanager
def running(session: Session) -> Iterator[None]:
    """Marks ``session`` busy for one completion (409 ``session_busy`` when another one runs)."""
    if session.busy:
        raise ApiError(409, "another completion of this session is running; a session's completions run one at a "
                            "time (its next prompt needs the previous answer)", code="session_busy")
    session._idle.clear()
    try:
        yield
    finally:
        session._idle.set()
