"""One engine as the router sees it: its address, its load, its health and the weights it holds."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineEndpoint"]


@dataclass(eq=False)
class EngineEndpoint:
    url: str
    outstanding: int = 0
    served: int = 0
    failures: int = 0  # consecutive failed health checks
    quarantined: bool = False  # not given requests: failed, or back but not yet caught up
    down: bool = False  # failed, and has not answered a health check since
    gone: bool = False  # cannot come back
    incarnation: int = 0  # bumped each time a failed engine answers again: later errors from before are not its own
    down_since: float = 0.0  # when it went down (time.monotonic())
    last_error: str = ""
    weight_version: int = -1
    instance: str | None = None  # the process it answers as (the embedded engine's health and answers say)
    resolve: Callable[[], Awaitable[str]] | None = None  # a fresh URL after a restart (Ray actors)
    meta: dict[str, Any] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)  # one health check at a time
