"""One OpenEnv episode, in this process or on an OpenEnv server: reset, step, close.

In process, the environment is made, reset, stepped and closed on a thread of its own, as an OpenEnv
server does it (an environment may be bound to the thread that made it), unless it implements
``reset_async``/``step_async``, which run on the event loop. Remotely, the episode is one session of
the server's WebSocket protocol (``/ws``) through OpenEnv's own client: the server makes an
environment for each connection and drops it when the connection closes, so the connection lives as long
as the episode and is never silently reopened (a new connection would be a new environment).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from miles_openenv.config import Settings, action_class_of, environment_class, import_object

__all__ = ["InProcessSession", "OpenEnvFailure", "Outcome", "RemoteSession"]


class OpenEnvFailure(RuntimeError):
    """An episode could not go on; the message names the environment or server and what happened."""


@dataclass
class Outcome:
    """What reset or one step gave: the observation's own fields, its reward (from the observation or the
    rubric, see ``reward_from``), whether the episode is over, and its metadata."""

    observation: dict[str, Any]
    reward: float | None = None
    done: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


class InProcessSession:
    """An instance of the ``Environment`` class at ``settings.env``, made with ``env_args``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.env_cls = environment_class(settings.env)
        if settings.action == "mcp":  # OpenEnv's MCP actions are told apart by their "type"
            from openenv.core.env_server.types import Action

            self.action_cls = Action
        else:
            self.action_cls = (import_object(settings.action_class, "action_class") if settings.action_class
                               else action_class_of(self.env_cls))
        self.env: Any = None
        self.steps = 0
        self._thread: ThreadPoolExecutor | None = None

    async def action_schema(self) -> dict[str, Any]:
        return self.action_cls.model_json_schema()

    async def reset(self, kwargs: dict[str, Any]) -> Outcome:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"openenv-{self.env_cls.__name__}")
        self.env = await _failing_as(self.settings, "making the environment",
                                     self._on_thread(self.env_cls, **self.settings.env_args))
        if self.settings.reward_from == "rubric" and getattr(self.env, "rubric", None) is None:
            raise OpenEnvFailure(f"{self.settings.where}: reward_from is 'rubric' but the environment has no rubric")
        async_reset = _overrides(self.env, "reset_async")
        params = inspect.signature(self.env.reset_async if async_reset else self.env.reset).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):  # as a server does: what reset() takes
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        observation = await _failing_as(self.settings, "reset", self.env.reset_async(**kwargs) if async_reset
                                        else self._on_thread(self.env.reset, **kwargs))
        return self._outcome(observation)

    async def step(self, payload: dict[str, Any]) -> Outcome:
        self.steps += 1
        action, observation = await self._act(payload, f"step {self.steps} (action {payload!r})")
        reward = await _failing_as(self.settings, "the rubric", self._rubric_reward(action, observation))
        return self._outcome(observation, reward)

    async def list_tools(self) -> Outcome:
        """The MCP environment's tools (its answer to a ``ListToolsAction``; not a step of the episode)."""
        _, observation = await self._act({"type": "list_tools"}, "listing the MCP tools")
        return self._outcome(observation)

    async def _act(self, payload: dict[str, Any], what: str) -> tuple[Any, Any]:
        """The Action of ``payload`` (as a server reads it) and the observation the environment answers with."""
        from openenv.core.env_server.serialization import deserialize_action
        from pydantic import ValidationError

        try:
            action = deserialize_action(payload, self.action_cls)
        except ValidationError as exc:
            raise OpenEnvFailure(f"{self.settings.where}: the action {payload!r} is not a valid "
                                 f"{self.action_cls.__name__}: {exc}") from exc
        if _overrides(self.env, "step_async"):
            stepping = self.env.step_async(action)
        else:
            stepping = self._on_thread(self.env.step, action)
        return action, await _failing_as(self.settings, what, stepping)

    async def close(self) -> None:
        env, thread, self.env, self._thread = self.env, self._thread, None, None
        try:
            if env is not None:
                await asyncio.get_running_loop().run_in_executor(thread, env.close)
        finally:
            if thread is not None:
                thread.shutdown(wait=False)

    async def _on_thread(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def _rubric_reward(self, action: Any, observation: Any) -> float | None:
        """The step's reward when the rubric gives it: always (``rubric``), or when the observation has none
        and the environment has a rubric (``auto``)."""
        rubric, mode = getattr(self.env, "rubric", None), self.settings.reward_from
        if rubric is None or mode == "observation" or (mode == "auto" and observation.reward is not None):
            return observation.reward
        score = rubric(action, observation)
        return await score if inspect.isawaitable(score) else score

    def _outcome(self, observation: Any, reward: float | None = None) -> Outcome:
        from openenv.core.env_server.types import Observation

        if not isinstance(observation, Observation):
            raise OpenEnvFailure(f"{self.settings.where}: the environment returned {type(observation).__name__}, "
                                 f"expected an OpenEnv Observation")
        fields = observation.model_dump(mode="json", exclude={"done", "reward", "metadata"})
        return Outcome(fields, _number(reward), bool(observation.done), dict(observation.metadata or {}))


class RemoteSession:
    """A WebSocket session with the OpenEnv server at ``settings.base_url``, opened by reset."""

    _schemas: dict[str, dict[str, Any]] = {}  # the servers' Action schemas (GET /schema), by URL

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.action_cls = import_object(settings.action_class, "action_class") if settings.action_class else None
        self._client: Any = None
        self.steps = 0
        self._exits = contextlib.AsyncExitStack()

    async def action_schema(self) -> dict[str, Any]:
        if self.action_cls is not None:
            return self.action_cls.model_json_schema()
        url = self.settings.base_url
        if url not in self._schemas:
            import httpx

            http_url = "http" + url[2:] if url.startswith("ws") else url
            try:
                async with httpx.AsyncClient(timeout=self.settings.connect_timeout_s) as client:
                    answer = await client.get(f"{http_url}/schema")
                    answer.raise_for_status()
                    self._schemas[url] = answer.json()["action"]
            except Exception as exc:
                raise OpenEnvFailure(f"{self.settings.where}: cannot read the action schema (GET /schema): "
                                     f"{type(exc).__name__}: {exc}") from exc
        return self._schemas[url]

    async def reset(self, kwargs: dict[str, Any]) -> Outcome:
        self._client = _session_client_class()(base_url=self.settings.base_url,
                                               connect_timeout_s=self.settings.connect_timeout_s,
                                               message_timeout_s=self.settings.message_timeout_s)
        await _failing_as(self.settings, "connecting", self._exits.enter_async_context(self._client))
        return self._outcome(await _failing_as(self.settings, "reset", self._client.reset(**kwargs)))

    async def step(self, payload: dict[str, Any]) -> Outcome:
        self.steps += 1
        stepping = self._client.step(payload)
        return self._outcome(await _failing_as(self.settings, f"step {self.steps} (action {payload!r})", stepping))

    async def list_tools(self) -> Outcome:
        """The MCP environment's tools (its answer to a ``ListToolsAction``; not a step of the episode)."""
        listing = self._client.step({"type": "list_tools"})
        return self._outcome(await _failing_as(self.settings, "listing the MCP tools", listing))

    async def close(self) -> None:
        self._client = None
        await self._exits.aclose()

    @staticmethod
    def _outcome(result: Any) -> Outcome:
        observation = {k: v for k, v in (result.observation or {}).items() if k != "metadata"}
        metadata = result.metadata or (result.observation or {}).get("metadata") or {}
        return Outcome(observation, _number(result.reward), bool(result.done), dict(metadata))


@functools.cache
def _session_client_class() -> type:
    """OpenEnv's generic client, held to the one connection an episode lives on (made on first use: OpenEnv
    imports slowly)."""
    from openenv.core.generic_client import GenericEnvClient
    from websockets.protocol import State

    class SessionClient(GenericEnvClient):
        """A :class:`GenericEnvClient` that connects once: where the stock client reconnects after the server
        closed the socket, and so would carry on with a fresh environment, this one raises."""

        _connected = False

        async def _ensure_connected(self) -> None:
            if not self._connected:
                await super()._ensure_connected()
                self._connected = True
            elif self._ws is None or self._ws.state is not State.OPEN:
                raise ConnectionError("the server closed this episode's WebSocket session (its environment is "
                                      "gone; a new connection would be a new environment)")

    return SessionClient


async def _failing_as(settings: Settings, what: str, awaitable: Any) -> Any:
    """Await ``awaitable``; an exception becomes an :class:`OpenEnvFailure` naming the environment or server,
    what was being done and the exception (an OpenEnvFailure passes through)."""
    try:
        return await awaitable
    except OpenEnvFailure:
        raise
    except Exception as exc:
        text = str(exc) or ("no answer within message_timeout_s" if isinstance(exc, TimeoutError) else "(no message)")
        raise OpenEnvFailure(f"{settings.where}: {what} failed: {type(exc).__name__}: {text}") from exc


def _overrides(env: Any, method: str) -> bool:
    from openenv.core.env_server.interfaces import Environment

    return getattr(type(env), method) is not getattr(Environment, method)


def _number(reward: Any) -> float | None:
    return None if reward is None else float(reward)
