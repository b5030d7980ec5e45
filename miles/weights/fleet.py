"""What a weight transport reaches engines through, stated as Protocols so that the weights import neither
the rollout plane nor the engines: :class:`miles.rollout.plane.RolloutPlane` is an :class:`Engines`, its
router (:class:`miles.engine.router.Router`) a :class:`Fleet` of :class:`Endpoint` s."""

from __future__ import annotations

from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["Endpoint", "Engines", "Fleet"]

T = TypeVar("T")


@runtime_checkable
class Endpoint(Protocol):
    """One engine served over HTTP."""

    url: str
    incarnation: int  # bumped each time it comes back after a failure
    weight_version: int  # the policy version it holds
    meta: dict[str, Any]  # what its launcher says of it: ``protocol`` ("sglang"), ``tp_size``


@runtime_checkable
class Fleet(Protocol):
    """Engines behind a router. An engine that fails a post is quarantined, the others go on, and it is
    re-admitted only after the transport's ``catch_up``; a refusal (HTTP 400) raises
    :class:`miles.errors.EngineRequestError`."""

    engines: list[Any]  # every engine, in service or not
    headers: dict[str, str]  # what each request carries (the admin token)
    request_timeout_s: float | None

    @property
    def healthy(self) -> list[Any]:
        """The engines in service; read it on the fleet's event loop, where no re-admission is half done."""

    def no_engine_left(self) -> Exception | None:
        """The error to raise when no engine can serve any more, else None."""

    async def post(self, engine: Any, path: str, body: dict[str, Any] | bytes, timeout_s: float | None = None,
                   params: dict[str, str] | None = None) -> Any:
        """POST JSON (a dict) or bytes to one engine."""

    async def post_all(self, path: str, body: dict[str, Any] | bytes, timeout_s: float | None = None,
                       params: dict[str, str] | None = None, engines: list[Any] | None = None) -> list[Any]:
        """POST to every engine in service (or to ``engines``); the answers of those that took it."""


@runtime_checkable
class Engines(Protocol):
    """Where a push goes: engines in this process (``remote`` false), or a :class:`Fleet` over HTTP."""

    local_engines: list[Any]  # each with ``update_weights(weights, version)`` and ``load_model(path)``
    router: Any  # a Fleet, when remote

    @property
    def remote(self) -> bool:
        """Whether the engines are served over HTTP (through ``router``)."""

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop the fleet lives on and wait for it."""

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start ``coro`` on that loop without waiting (a broadcast runs beside its posts)."""

    def post_all(self, path: str, body: dict[str, Any] | bytes, timeout_s: float | None = None,
                 params: dict[str, str] | None = None) -> list[Any]:
        """:meth:`Fleet.post_all` to the engines in service, waited for."""
