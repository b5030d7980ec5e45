"""The ``agent`` rollout function: an agent harness written against the OpenAI client drives each trajectory
through a session of the session server, and the session's recorded tokens become the sample.

    rollout: {fn: {name: agent, agent: my_pkg.agents:solve, max_turns: 4}}

``agent`` is the import path of ``async def solve(base_url, sample, **agent_args) -> reward | None``; the other
arguments are passed to it. ``base_url`` is what ``openai.AsyncOpenAI(base_url=..., api_key=...)`` takes (the
session's ``/v1``); the server generates with the run's engine and ``rollout.sampling`` and finds tool calls
with ``rollout.tool_parser``. A reward the agent returns is ``sample.metadata["env_reward"]`` (the ``env``
reward uses it).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles import import_object
from miles.agentic.tool_calls import HermesParser
from miles.rollout.context import RolloutContext
from miles.lazy import lazy_module
from miles.session.state import Session
from miles.types import Sample, SampleStatus

# the server (aiohttp) is imported when a rollout starts one: `miles config` reads Agent's arguments without it
server_module = lazy_module("miles.session.server")

__all__ = ["Agent"]


@dataclass
class _Shared:
    """A session server on one event loop, shared by the samples in flight there."""

    server: server_module.SessionServer
    started: asyncio.Future  # the base URL
    users: int = 0


class Agent:
    """Registered as rollout function ``agent``. One session server per event loop (and rollout context) is
    started with the first sample and stopped when the last one in flight finishes: Miles may run each step in
    a fresh event loop."""

    def __init__(self, agent: str, **agent_args: Any) -> None:
        self.path, self.agent_args = agent, agent_args
        self.fn = self.check_args({"agent": agent, **agent_args})
        self._servers: dict[tuple[asyncio.AbstractEventLoop, int], _Shared] = {}

    @staticmethod
    def check_args(args: dict[str, Any]) -> Callable[..., Any]:
        """Config validation: the agent imports, is an async function and takes the node's other arguments,
        and its own ``check_args(agent_args)``, when it has one, accepts them (a ValueError names what is wrong)."""
        args = dict(args)
        fn = _load(args.pop("agent"), args)
        check = getattr(fn, "check_args", None)
        if callable(check):
            check(args)
        return fn

    async def __call__(self, sample: Sample, ctx: RolloutContext) -> Sample:
        key = (asyncio.get_running_loop(), id(ctx))
        shared = self._servers.get(key)
        if shared is None:
            server = server_module.SessionServer(ctx.engine, ctx.tokenizer, ctx.tool_parser or HermesParser(),
                                                 ctx.sampling_params, ctx.context_length, chat_format=ctx.chat_format,
                                                 images=ctx.images, on_mismatch=ctx.tito_on_mismatch)
            shared = self._servers[key] = _Shared(server, asyncio.ensure_future(server.start()))
        shared.users += 1
        session = None
        try:
            base_url = await asyncio.shield(shared.started)
            session = shared.server.open({"group_index": sample.group_index, "index": sample.index})
            try:
                reward = await self.fn(f"{base_url}/sessions/{session.id}/v1", sample, **self.agent_args)
            except Exception as exc:
                reward, error = None, f"rollout: agent {self.path} raised {type(exc).__name__}: {exc}"
            else:
                error = _reward_problem(self.path, reward)
            _fill(sample, session, error, ctx.tito_on_mismatch)
            if sample.trainable and reward is not None:
                sample.metadata["env_reward"] = reward
            return sample
        finally:
            if session is not None:
                shared.server.sessions.pop(session.id, None)
            shared.users -= 1
            if shared.users == 0:
                if self._servers.get(key) is shared:
                    del self._servers[key]
                with contextlib.suppress(Exception):  # a server that failed to start failed its samples already
                    await shared.started
                await shared.server.stop()


def _fill(sample: Sample, session: Session, error: str | None, on_mismatch: str = "split") -> None:
    """The session's trajectory as the sample's tokens, status and tool statistics; its earlier parts when the
    template rendered the history otherwise (split), and the rendering of the finished conversation held against
    its tokens (counted; under ``fail`` a difference fails the sample, as in ``multi_turn``)."""
    if session.status == "aborted":  # nothing of it is kept: the agent starts over when the sample is continued
        sample.status, sample.reason = SampleStatus.ABORTED, f"partial rollout: {session.reason}"
        return
    # A prompt refused for the context length ends the trajectory there, whether the agent caught the 400 or let it
    # raise: its turns so far are a truncated sample, as when a generation reaches the context length.
    overflowed = bool(session.context_exceeded) and session.turns > 0
    if not overflowed and (error is not None or session.turns == 0):
        reason = session.reason or session.context_exceeded
        sample.fail(error or f"rollout: the agent made no chat completion{f' ({reason})' if reason else ''}")
        return
    sample.prompt_ids = list(session.prompt_ids)
    sample.response_ids, sample.loss_mask = list(session.response_ids), list(session.loss_mask)
    sample.rollout_logprobs, sample.weight_versions = list(session.logprobs), list(session.weight_versions)
    sample.sampled_with = list(session.sampled_with)
    sample.segments = [Sample(prompt_ids=part["prompt_ids"], group_index=sample.group_index, index=sample.index,
                              prompt=sample.prompt, label=sample.label, response_ids=part["response_ids"],
                              loss_mask=part["loss_mask"], rollout_logprobs=part["logprobs"],
                              status=SampleStatus.COMPLETED, reason="split: the template renders the history "
                              "otherwise", weight_versions=part["weight_versions"],
                              sampled_with=part["sampled_with"]) for part in session.segments]
    sample.metadata["tito"] = dict(session.tito)
    final = session.conversation.finish() if session.conversation is not None else None
    if final is not None:  # the finished conversation renders otherwise (counted; a failure under `fail`)
        sample.metadata["tito"]["final_mismatches"] += 1
        sample.metadata["tito_final"] = str(final)
    sample.images = list(session.images)
    sample.turns, sample.response_text = session.turns, session.last_text
    sample.metadata["tools"] = dict(session.tool_stats)
    if session.status == "truncated" or overflowed:
        sample.status, sample.reason = SampleStatus.TRUNCATED, session.reason or session.context_exceeded
    elif session.finish_reason == "length":
        sample.status, sample.reason = SampleStatus.TRUNCATED, "max_tokens reached in the last turn"
    else:
        sample.status = SampleStatus.COMPLETED
    if final is not None and on_mismatch == "fail":
        sample.fail(f"rollout: {final} (rollout.tito.on_mismatch=fail)")


def _reward_problem(path: str, reward: Any) -> str | None:
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if reward is None or number(reward) or isinstance(reward, dict) and all(number(v) for v in reward.values()):
        return None
    return f"rollout: agent {path} returned {reward!r}; expected a number, a dict of numbers, or None"


def _load(path: str, agent_args: dict[str, Any]) -> Callable[..., Any]:
    """The agent function at ``path``, checked to be callable as ``fn(base_url, sample, **agent_args)``."""
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"agent: expected an import path 'package.module:function', got {path!r}")
    try:
        obj = import_object(path)
    except ValueError as exc:
        raise ValueError(f"agent: {exc}") from exc.__cause__
    if not inspect.iscoroutinefunction(obj):
        raise ValueError(f"agent: {path!r} must be an async function (async def run(base_url, sample, ...)), "
                         f"got {type(obj).__name__}")
    try:
        inspect.signature(obj).bind("http://base/v1", None, **agent_args)
    except TypeError as exc:
        raise ValueError(f"agent {path!r} cannot be called as {obj.__name__}(base_url, sample"
                         f"{''.join(f', {k}=...' for k in agent_args)}): {exc}") from exc
    return obj
