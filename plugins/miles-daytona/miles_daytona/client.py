"""The Daytona SDK's client, shared on each event loop, and its errors in the terms Miles' base expects.

One ``AsyncDaytona`` per event loop serves every sandbox open on it (one connection pool and one event
socket, however many sandboxes run), and the class-level calls (list, delete by id, the start-up probe)
while they last: it is made by the first user and closed when the last one lets go. The SDK reads its
settings from the environment (``DAYTONA_API_KEY``, ``DAYTONA_API_URL``, ``DAYTONA_TARGET``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from collections.abc import AsyncIterator, Iterator

from daytona import AsyncDaytona, DaytonaError
from daytona.common.errors import (
    DaytonaAuthenticationError,
    DaytonaConnectionError,
    DaytonaForbiddenError,
    DaytonaValidationError,
)

from miles.agentic import PermanentError

__all__ = ["API_URL_ENV", "acquire", "api_url", "borrowed", "release", "sdk_errors"]

API_URL_ENV = "DAYTONA_API_URL"
DEFAULT_API_URL = "https://app.daytona.io/api"  # the SDK's, when DAYTONA_API_URL is unset
PERMANENT_STATUSES = {400, 401, 403, 404, 422}  # a bad key, template or request: retrying cannot help


class _Shared:
    def __init__(self, client: AsyncDaytona) -> None:
        self.client, self.users = client, 0


_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Shared] = weakref.WeakKeyDictionary()


def api_url() -> str:
    """Where the SDK sends its requests."""
    return os.environ.get(API_URL_ENV) or DEFAULT_API_URL


def acquire() -> AsyncDaytona:
    """This event loop's client, made on first use; every call is matched by one :func:`release`."""
    loop = asyncio.get_running_loop()
    shared = _clients.get(loop)
    if shared is None:
        with sdk_errors():
            shared = _clients[loop] = _Shared(AsyncDaytona())
    shared.users += 1
    return shared.client


async def release(client: AsyncDaytona) -> None:
    """Let go of ``client``; the last user closes it (its connections and event socket)."""
    loop = asyncio.get_running_loop()
    shared = _clients.get(loop)
    if shared is None or shared.client is not client:
        return
    shared.users -= 1
    if shared.users == 0:
        del _clients[loop]  # a user that comes meanwhile makes a new one rather than get a closing one
        await client.close()


@contextlib.asynccontextmanager
async def borrowed() -> AsyncIterator[AsyncDaytona]:
    """The shared client for the length of one class-level call."""
    client = acquire()
    try:
        with sdk_errors():
            yield client
    finally:
        await release(client)


@contextlib.contextmanager
def sdk_errors() -> Iterator[None]:
    """Raise the SDK's errors as Miles' base class expects them: :class:`PermanentError` for what
    retrying cannot fix (credentials, a bad snapshot or request), ``ConnectionError`` naming the
    service's address when it cannot be reached; anything else as it is (a transient error)."""
    try:
        yield
    except DaytonaError as exc:
        status = exc.status_code
        if isinstance(exc, (DaytonaAuthenticationError, DaytonaForbiddenError)) or status in (401, 403):
            raise PermanentError(f"{_status(exc)}{exc} (at {api_url()}; check DAYTONA_API_KEY)") from exc
        if isinstance(exc, DaytonaValidationError) or status in PERMANENT_STATUSES:
            raise PermanentError(f"{_status(exc)}{exc}") from exc
        if isinstance(exc, DaytonaConnectionError):
            raise ConnectionError(f"cannot reach {api_url()} ({API_URL_ENV}): {exc}") from exc
        raise


def _status(exc: DaytonaError) -> str:
    return f"HTTP {exc.status_code}: " if exc.status_code else ""
