"""Miles' sandbox on E2B: one E2B cloud sandbox per trajectory, driven through E2B's Python SDK.

:class:`E2BSandbox` is a :class:`miles.agentic.RemoteSandbox`: the base class creates the sandbox on first
use (with retries), limits how many live at once, caps outputs, tags every sandbox ``miles=1`` and
``miles-run=<run id>`` and deletes it on close, at the run's end and by ``gc``. This module only says how
each of those steps is done with the SDK's ``AsyncSandbox``:

- create: ``AsyncSandbox.create(template, timeout=lifetime_s, metadata=tags, allow_internet_access=...)``,
  with the SDK's own response retries off so that ``create_retries`` alone decides how often Miles tries;
- commands: ``commands.run(cmd, cwd=..., background=True)`` (E2B runs it with ``/bin/bash -l -c``), waited
  for within ``timeout_s`` and killed by its pid when that passes;
- files: ``files.write`` (an octet-stream upload; E2B makes the parent folders) and ``files.read``;
- delete: ``kill``; leftovers: ``AsyncSandbox.list(query=SandboxQuery(metadata=tags))``, page by page.

Where the SDK connects is its own business: ``E2B_API_KEY``, ``E2B_DOMAIN`` and ``E2B_API_URL`` (and
``E2B_SANDBOX_URL``, which sends every sandbox's traffic to one address) are read by the SDK itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
from typing import Any, Iterator

import httpx  # the SDK's HTTP layer: its transport errors say that the service could not be reached
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    ConnectionConfig,
    InvalidArgumentException,
    SandboxException,
    SandboxQuery,
    ServiceBusyException,
    TemplateException,
)

from miles.agentic import PermanentError, RemoteSandbox

__all__ = ["E2BError", "E2BSandbox"]

PERMANENT_STATUSES = (400, 401, 403, 404, 422)  # answers to a create that trying again cannot change
KILL_GRACE_S = 10.0  # E2B ends a command's stream this long after Miles' own timeout, should the kill be lost
LIST_PAGE = 100  # sandboxes per page when looking for leftovers


class E2BSandbox(RemoteSandbox):
    """An E2B sandbox (``rollout.sandbox: {name: e2b, template: base}``).

    ``template``: the E2B template (name or id) the sandbox starts from; it needs ``bash`` and, for
    ``execute_python_code``, ``python3`` (the default ``base`` template has both). ``internet``: let
    commands reach the internet (off by default, like Miles' local sandbox). ``user``: who runs the
    commands and owns the files (E2B's default ``user``, whose home holds the default ``workdir``; ``root``
    for ``mounts`` or a ``workdir`` outside it). The other arguments are
    :class:`miles.agentic.RemoteSandbox`'s (``workdir``, ``max_concurrent``, ``lifetime_s`` ...).
    """

    provider = "e2b"
    credentials = ("E2B_API_KEY",)
    default_workdir = "/home/user/work"  # in the home of E2B's default user, who runs the commands
    service_url_env = "E2B_API_URL"

    def __init__(self, *, template: str = "base", internet: bool = False, user: str = "user",
                 run_id: str | None = None, **common: Any) -> None:
        # run_id is named, not left in **common: the runner passes the run's id to factories that name it.
        self.check_own({"template": template, "internet": internet, "user": user})
        super().__init__(run_id=run_id, **common)
        self.template, self.internet, self.user = template, internet, user

    # -- configuration -------------------------------------------------------------------------------

    @classmethod
    def check_args(cls, args: dict[str, Any]) -> None:
        """Config validation: credentials, no debug mode, known arguments, each in range (ValueError)."""
        super().check_args(args)
        if os.environ.get("E2B_DEBUG", "false").lower() == "true":  # the SDK's own test of the variable
            raise ValueError("E2B_DEBUG=true points the E2B SDK at one envd on localhost without creating "
                             "sandboxes, so trajectories would share it; unset E2B_DEBUG for the e2b sandbox")
        known = cls.argument_names()
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown argument{'s' * (len(unknown) > 1)} {', '.join(unknown)} of the e2b "
                             f"sandbox; expected some of: {', '.join(sorted(known))}")
        cls.check_own(args)

    @classmethod
    def argument_names(cls) -> set[str]:
        """Every argument the constructor takes: its own and the common ones of RemoteSandbox."""
        own = inspect.signature(cls.__init__).parameters.values()
        common = inspect.signature(RemoteSandbox.__init__).parameters.values()
        return {p.name for p in [*own, *common] if p.kind is p.KEYWORD_ONLY}

    @staticmethod
    def check_own(args: dict[str, Any]) -> None:
        template = args.get("template", "base")
        if not isinstance(template, str) or not template.strip():
            raise ValueError(f"template: expected the name or id of an E2B template, got {template!r}")
        if not isinstance(args.get("internet", False), bool):
            raise ValueError(f"internet: expected true or false, got {args['internet']!r}")
        user = args.get("user", "user")
        if not isinstance(user, str) or not user.strip():
            raise ValueError(f"user: expected the name of a user of the template (user, root), got {user!r}")

    @classmethod
    def describe(cls, **config: Any) -> str:
        internet = "with" if config.get("internet") else "without"
        return (f"e2b sandboxes from template {config.get('template', 'base')!r} {internet} internet, created "
                f"through {service_address()}, at most {config.get('max_concurrent', 16)} at once, deleted at "
                f"the end of each trajectory and of the run")

    # -- provider hooks ------------------------------------------------------------------------------

    async def _create(self, labels: dict[str, str], lifetime_s: float) -> AsyncSandbox:
        with sdk_errors(None, permanent=True):  # the base says "could not create a sandbox"
            return await AsyncSandbox.create(
                template=self.template, timeout=max(1, math.ceil(lifetime_s)), metadata=labels,
                allow_internet_access=self.internet, retries=0, request_timeout=self.create_timeout_s)

    async def _exec(self, handle: AsyncSandbox, command: str, *, cwd: str,
                    timeout_s: float) -> tuple[str, str, int | None, bool]:
        with sdk_errors(f"run a command in E2B sandbox {handle.sandbox_id}", handle.envd_api_url):
            process = await handle.commands.run(command, background=True, cwd=cwd, user=self.user,
                                                timeout=timeout_s + KILL_GRACE_S,
                                                request_timeout=self.connect_timeout_s)
            try:
                result = await asyncio.wait_for(process.wait(), timeout_s)
            except CommandExitException as exc:  # a non-zero exit code, which is an answer like any other
                return exc.stdout, exc.stderr, exc.exit_code, False
            except asyncio.TimeoutError:
                await self._kill(handle, process)
                return process.stdout or "", process.stderr or "", None, True
            return result.stdout, result.stderr, result.exit_code, False

    async def _write(self, handle: AsyncSandbox, path: str, data: bytes) -> None:
        with sdk_errors(f"write {path} in E2B sandbox {handle.sandbox_id}", handle.envd_api_url):
            await handle.files.write(path, data, user=self.user, use_octet_stream=True,
                                     request_timeout=self.connect_timeout_s)

    async def _read(self, handle: AsyncSandbox, path: str) -> bytes:
        with sdk_errors(f"read {path} in E2B sandbox {handle.sandbox_id}", handle.envd_api_url):
            return bytes(await handle.files.read(path, format="bytes", user=self.user,
                                                 request_timeout=self.connect_timeout_s))

    async def _delete(self, handle: AsyncSandbox) -> None:
        await self._delete_id(handle.sandbox_id)

    @classmethod
    async def _list(cls, labels: dict[str, str]) -> list[str]:
        with sdk_errors("list E2B sandboxes"):
            pages = AsyncSandbox.list(query=SandboxQuery(metadata=labels), limit=LIST_PAGE)
            ids: list[str] = []
            while pages.has_next:
                # E2B filters by metadata; checked again so that gc never deletes a sandbox not tagged so
                ids += [box.sandbox_id for box in await pages.next_items()
                        if labels.items() <= (box.metadata or {}).items()]
            return ids

    @classmethod
    async def _delete_id(cls, sandbox_id: str) -> None:
        with sdk_errors(f"delete E2B sandbox {sandbox_id}"):
            await AsyncSandbox.kill(sandbox_id)  # False when it is gone already: nothing left to do

    @classmethod
    async def _probe(cls) -> None:
        """One authenticated list call, naming the address in every error (the run's start reports it)."""
        with sdk_errors(f"list E2B sandboxes at {service_address()}", where="the service", permanent=True):
            await AsyncSandbox.list(limit=1).next_items()

    # -- internals -----------------------------------------------------------------------------------

    async def _kill(self, handle: AsyncSandbox, process: Any) -> None:
        """Kill a command that ran out of time and stop listening to it (best effort: a kill that is
        lost still ends with E2B's own deadline on the stream, ``KILL_GRACE_S`` later)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.commands.kill(process.pid), self.connect_timeout_s)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(process.disconnect(), self.connect_timeout_s)


def service_address() -> str:
    """Where the SDK sends its API calls, and which setting says so (for messages)."""
    source = ("E2B_API_URL" if os.environ.get("E2B_API_URL") else
              "E2B_DOMAIN" if os.environ.get("E2B_DOMAIN") else "the SDK's default; set by E2B_DOMAIN or E2B_API_URL")
    return f"{ConnectionConfig().api_url} ({source})"


class E2BError(RuntimeError):
    """A call to E2B failed; the message says which call, on which sandbox, and what E2B or the SDK said."""


@contextlib.contextmanager
def sdk_errors(what: str | None, where: str | None = None, permanent: bool = False) -> Iterator[None]:
    """Turn the SDK's exceptions into ones that say what failed (``could not <what>``, when given):
    :class:`E2BError`, naming the address when the service could not be reached, or
    :class:`PermanentError` for answers that trying again cannot change (refused credentials; where
    ``permanent``, a bad request, template or argument)."""
    failed = f"could not {what}: " if what else ""
    try:
        yield
    except (httpx.TransportError, ConnectionError) as exc:
        raise E2BError(f"{failed}cannot reach {where or service_address()}: {type(exc).__name__}: {exc}") from exc
    except AuthenticationException as exc:
        raise PermanentError(f"{failed}the service refused the credentials (E2B_API_KEY): {exc}") from exc
    except (SandboxException, ServiceBusyException) as exc:
        if permanent and (isinstance(exc, (InvalidArgumentException, TemplateException))
                          or getattr(exc, "status_code", None) in PERMANENT_STATUSES):
            raise PermanentError(f"{failed}{type(exc).__name__}: {exc}") from exc
        raise E2BError(f"{failed}{type(exc).__name__}: {exc}") from exc
