"""The ``openenv`` env: one OpenEnv episode per Miles trajectory, in process or on an OpenEnv server."""

from __future__ import annotations

from typing import Any

from miles import Action, EnvContext, Sample, StepResult

from miles_openenv.config import Settings, check, parse
from miles_openenv.mapping import ActionMapping, McpActions, make_mapping
from miles_openenv.sessions import InProcessSession, OpenEnvFailure, Outcome, RemoteSession

__all__ = ["OpenEnvEnv"]


class OpenEnvEnv:
    """Registered as env ``openenv``. Exactly one of:

    - ``env``: the import path of an OpenEnv ``Environment`` class, made with ``env_args`` for each
      trajectory and run in this process;
    - ``base_url``: an OpenEnv server; each trajectory is one WebSocket session (``/ws``) with it.

    ``action``: ``tool`` (default) offers the Action class's JSON schema as one tool named ``tool_name``
    (default: the class name in snake_case); each valid call is one step. ``text`` puts the turn's text into
    the Action's field ``action_field`` (default: its only field). ``mcp`` offers the tools an MCP environment
    lists, each call a ``CallToolAction``. ``action_class``: the Action class (default: the one ``step`` is
    annotated with in process, the server's ``/schema`` remotely).
    ``observation_field``: the observation's field shown to the model (default: all its fields as JSON).
    ``reward_from``: ``auto`` (the observation's reward; in process, when it has none, the environment's
    rubric's score of the step), ``observation`` or ``rubric``. ``reward_mode``: ``last`` reward or the
    ``sum`` of the episode's rewards. ``reset_args`` and ``reset_fields`` (fields of the data row) are
    passed to ``reset()``, with ``episode_id``. ``system_prompt`` comes first; ``include_prompt`` puts the
    sample's prompt before the reset observation. ``connect_timeout_s`` and ``message_timeout_s`` bound
    the server's answers.
    """

    def __init__(self, ctx: EnvContext, env: str | None = None, base_url: str | None = None,
                 env_args: dict[str, Any] | None = None, action: str = "tool", action_class: str | None = None,
                 action_field: str | None = None, tool_name: str | None = None, observation_field: str | None = None,
                 reward_from: str = "auto", reward_mode: str = "last", reset_args: dict[str, Any] | None = None,
                 reset_fields: list[str] | dict[str, str] | None = None, system_prompt: str | None = None,
                 include_prompt: bool = False, connect_timeout_s: float = 10.0,
                 message_timeout_s: float = 60.0) -> None:
        self.settings: Settings = parse({
            "env": env, "base_url": base_url, "env_args": env_args, "action": action, "action_class": action_class,
            "action_field": action_field, "tool_name": tool_name, "observation_field": observation_field,
            "reward_from": reward_from, "reward_mode": reward_mode, "reset_args": reset_args,
            "reset_fields": reset_fields, "system_prompt": system_prompt, "include_prompt": include_prompt,
            "connect_timeout_s": connect_timeout_s, "message_timeout_s": message_timeout_s})
        self.session = InProcessSession(self.settings) if env is not None else RemoteSession(self.settings)
        self.tools: list[dict[str, Any]] = []
        self._mapping: ActionMapping | None = None
        self._total: float | None = None  # the rewards so far (reward_mode: sum)

    @classmethod
    def check_args(cls, args: dict[str, Any]) -> None:
        """Config validation: the arguments fit together, the classes import, the environment takes
        ``env_args`` and ``reset_args``, and its Action suits ``action`` (a ValueError names the argument)."""
        check(args)

    async def reset(self, sample: Sample) -> list[dict[str, Any]]:
        where = self.settings.where
        if self.settings.action != "mcp":
            try:
                self._mapping = make_mapping(self.settings, await self.session.action_schema())
            except ValueError as exc:
                raise OpenEnvFailure(f"{where}: {exc}") from exc
        first = await self.session.reset(self._reset_kwargs(sample))
        if first.done:
            raise OpenEnvFailure(f"{where}: the episode ended at reset (done before any action)")
        if self.settings.action == "mcp":
            listed = (await self.session.list_tools()).observation.get("tools") or []
            if not listed:
                raise OpenEnvFailure(f"{where}: the MCP environment lists no tools")
            self._mapping = McpActions(listed)
        self.tools = self._mapping.tools
        messages = [{"role": "system", "content": self.settings.system_prompt}] if self.settings.system_prompt else []
        text = self._render(first)
        if self.settings.include_prompt:
            if isinstance(sample.prompt, list):
                messages += [dict(m) for m in sample.prompt]
            else:
                text = f"{sample.prompt}\n\n{text}"
        return [*messages, {"role": "user", "content": text}]

    async def step(self, action: Action) -> StepResult:
        payloads = self._mapping.payloads(action)
        if not payloads:
            return StepResult(observation=self._mapping.no_action())
        messages: list[dict[str, Any]] = []
        steps: list[dict[str, Any]] = []
        reward = None
        for payload, call in payloads:
            outcome = await self.session.step(payload)
            steps.append({"reward": outcome.reward, "done": outcome.done, "metadata": outcome.metadata})
            if outcome.reward is not None:
                self._total = (self._total or 0.0) + outcome.reward
                reward = self._total if self.settings.reward_mode == "sum" else outcome.reward
            if outcome.done:
                return StepResult(reward=reward, done=True, info={"openenv": steps})
            text = self._render(outcome)
            messages.append({"role": "tool", "name": call.name, "tool_call_id": call.id, "content": text}
                            if call is not None else {"role": "user", "content": text})
        return StepResult(observation=messages, reward=reward, info={"openenv": steps})

    async def close(self) -> None:
        await self.session.close()

    def _reset_kwargs(self, sample: Sample) -> dict[str, Any]:
        data = sample.metadata.get("data") or {}
        kwargs = dict(self.settings.reset_args)
        for argument, name in self.settings.reset_fields.items():
            if name not in data:
                raise OpenEnvFailure(f"{self.settings.where}: reset_fields: the sample's data has no field {name!r} "
                                     f"(for reset argument {argument!r}); its fields: {', '.join(data) or 'none'}")
            kwargs[argument] = data[name]
        if sample.metadata.get("trajectory"):  # the OpenEnv episode is named after the Miles trajectory
            kwargs.setdefault("episode_id", str(sample.metadata["trajectory"]))
        return kwargs

    def _render(self, outcome: Outcome) -> str:
        try:
            return self._mapping.render(outcome.observation, self.settings.observation_field)
        except KeyError as exc:
            raise OpenEnvFailure(f"{self.settings.where}: {exc.args[0]}") from None
