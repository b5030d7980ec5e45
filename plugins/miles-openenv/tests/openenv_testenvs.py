"""OpenEnv environments for the tests, written against OpenEnv's own classes (served by ``openenv_serve.py``):
a countdown that takes several steps (``Environment``, ``Action``, ``Observation``, ``Rubric``) and an MCP
environment whose tools add numbers (``MCPEnvironment`` over a FastMCP server)."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from fastmcp import FastMCP
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics import Rubric
from pydantic import Field


class CountAction(Action):
    """Say the next number of the countdown."""

    said: str = Field(description="the number you say")


class CountObservation(Observation):
    """What the countdown says next."""

    message: str = Field(default="", description="the environment's words")
    step: int = Field(default=0, description="actions taken so far")


class FractionRight(Rubric):
    """The fraction of the numbers said right so far (read from the observation's metadata)."""

    def forward(self, action: Any, observation: Any) -> float:
        return observation.metadata["right"] / observation.metadata["start"]


class Countdown(Environment):
    """Say the numbers from ``start`` down to 1, one per step. The episode ends after ``start`` steps with the
    reward ``floor + (1 - floor) * fraction said right`` (``floor``: what saying anything earns).

    ``rubric``: ``none``; ``unapplied`` (the environment has a :class:`FractionRight` rubric but leaves the
    observation's reward empty, for the trainer to apply); ``shadowed`` (it has one and still sets its own
    reward). ``label`` starts every message. ``live`` counts the instances not closed yet, in this process.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True
    live: ClassVar[int] = 0
    _lock = threading.Lock()

    def __init__(self, start: int = 3, floor: float = 0.0, label: str = "", rubric: str = "none") -> None:
        super().__init__(rubric=FractionRight() if rubric != "none" else None)
        self.start, self.floor, self.label, self.rubric_mode = start, floor, label, rubric
        self._state = State()
        self.said: list[str] = []
        self.closed = False
        with self._lock:
            Countdown.live += 1

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              start: int | None = None) -> CountObservation:
        self.start = int(start) if start is not None else self.start
        self._state = State(episode_id=episode_id, step_count=0)
        self.said = []
        return CountObservation(message=f"{self.label}count down from {self.start}")

    def step(self, action: CountAction, timeout_s: float | None = None, **kwargs: Any) -> CountObservation:
        if len(self.said) >= self.start:
            raise ValueError("the countdown is over; reset first")
        self.said.append(action.said.strip())
        self._state.step_count += 1
        right = sum(said == str(self.start - i) for i, said in enumerate(self.said))
        done = len(self.said) == self.start
        observation = CountObservation(
            message=f"{self.label}say {self.start - len(self.said)}" if not done else f"{self.label}done",
            step=len(self.said), done=done, metadata={"right": right, "start": self.start})
        if self.rubric_mode != "unapplied" and done:
            observation.reward = self.floor + (1 - self.floor) * right / self.start
        return observation

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with self._lock:
                Countdown.live -= 1


class AddUp(MCPEnvironment):
    """An MCP environment: add up 2, 3 and 4 with the ``add`` tool, then give the sum to ``answer``, which ends
    the episode with reward 1.0 when it is 9 (else 0.0)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    live: ClassVar[int] = 0
    _lock = threading.Lock()

    def __init__(self) -> None:
        mcp = FastMCP("add-up")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool()
        def answer(total: int) -> str:
            """Give the sum; this ends the episode."""
            self.answered = total
            return "noted"

        super().__init__(mcp)
        self.answered: int | None = None
        self._state = State()
        self.closed = False
        with self._lock:
            AddUp.live += 1

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> Observation:
        self.answered, self._state = None, State(episode_id=episode_id)
        return CountObservation(message="add up 2, 3 and 4")

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        raise ValueError(f"AddUp takes tool calls only, got {type(action).__name__}")

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._judge(await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._judge(super().step(action, timeout_s=timeout_s, **kwargs))

    def _judge(self, observation: Observation) -> Observation:
        if self.answered is not None:
            observation.done, observation.reward = True, float(self.answered == 9)
        return observation

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        super().close()
        if not self.closed:
            self.closed = True
            with self._lock:
                AddUp.live -= 1
