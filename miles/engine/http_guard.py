"""What every request to the engine server (and the standalone router) must satisfy, and how it is answered.

Checked in this order: a ``Host`` among this server's names (loopback, the address it was reached on,
``--allowed-host``; else 421, against DNS rebinding), no ``Origin`` but this server's own (else 403, so a
web page cannot drive the engine), the admin token on the admin and weight endpoints when one is set (else
401), ``Content-Type: application/json`` on a POST with a body (``application/octet-stream`` too for
``/update_weights_from_tensor``; else 415), and a body within the size limit of its endpoint (else 413).
Every answer is strict JSON: a non-finite float becomes null. Which endpoints are admin endpoints and which
content types each reads are the server's :class:`Policy` (the engine's by default).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

__all__ = ["Policy", "POLICY", "Refused", "guard", "guarded_app", "listen_hosts", "QUIET_MALFORMED", "json_answer",
           "error_answer", "read_body", "json_body", "MAX_REQUEST_BYTES", "MAX_WEIGHT_REQUEST_BYTES", "LOOPBACK",
           "WEIGHT_PATH", "OCTET_STREAM", "JSON"]

MAX_REQUEST_BYTES = 16 << 20
MAX_WEIGHT_REQUEST_BYTES = 1 << 30
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
ADMIN_PATHS = frozenset({
    "/abort_request", "/flush_cache", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
    "/update_weights_from_tensor", "/init_weights_update_group", "/update_weights_from_distributed",
    "/update_weights_from_shm", "/release_memory_occupation", "/resume_memory_occupation",
    "/weights_checksum",  # a GET, but it reads every weight
})
WEIGHT_PATH = "/update_weights_from_tensor"  # the one endpoint that carries tensors, with a limit of its own
JSON = "application/json"
OCTET_STREAM = "application/octet-stream"
BODY_TYPES = {**{path: (JSON,) for path in ADMIN_PATHS | {"/generate"}}, WEIGHT_PATH: (JSON, OCTET_STREAM)}



@dataclass(frozen=True)
class Policy:
    """What a request must satisfy (see the module's docstring)."""

    admin_token: str = ""
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_weight_request_bytes: int = MAX_WEIGHT_REQUEST_BYTES
    allowed_hosts: frozenset[str] = frozenset()  # extra Host names ("name" or "name:port"); "*": any
    server: str = "engine"  # what the refusals call this server
    admin_paths: frozenset[str] = ADMIN_PATHS  # the endpoints that need the admin token
    body_types: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: BODY_TYPES)  # what each POST reads


POLICY = web.AppKey("policy", Policy)


# -- answers ---------------------------------------------------------------------------------------


def json_answer(data: Any, status: int = 200) -> web.Response:
    """A strict JSON answer: a non-finite float becomes null, never the invalid bare ``NaN``."""
    try:
        text = json.dumps(data, allow_nan=False)
    except ValueError:
        text = json.dumps(finite(data), allow_nan=False)
    return web.Response(text=text, status=status, content_type=JSON)


def finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def error_answer(status: int, message: str) -> web.Response:
    return json_answer({"error": message}, status)


class Refused(Exception):
    """A request refused while it is read; becomes ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# -- the checks every request passes ---------------------------------------------------------------


def _split_host(value: str) -> tuple[str, int | None]:
    """``name:port``, ``[v6]:port`` or a bare name, as (lower-case name without brackets, port or None)."""
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:
        name, port = value, ""
    return name.lower(), int(port) if port.isdigit() else None


def _host_refusal(request: web.Request, policy: Policy) -> str | None:
    """Why the ``Host`` header is not this server (a DNS-rebinding page sends its own name), or None."""
    host = request.headers.get("Host")
    if host is None or "*" in policy.allowed_hosts:
        return None
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    local_ip, local_port = (sockname[0].lower().removeprefix("::ffff:"), sockname[1]) if sockname else ("", None)
    name, port = _split_host(host)
    if host.lower() in policy.allowed_hosts or name in policy.allowed_hosts:
        return None
    if name in LOOPBACK | {local_ip} and (port == local_port or (port is None and local_port == 80)):
        return None
    return (f"Host {host!r} is not this server's address (expected {', '.join(sorted(LOOPBACK | {local_ip}))} "
            f"with port {local_port}); if you reach the {policy.server} by another name, start it with "
            f"--allowed-host NAME")


def _origin_refusal(request: web.Request, policy: Policy) -> str | None:
    """Why the ``Origin`` header (sent by browsers) is not this server's own origin, or None."""
    origin = request.headers.get("Origin")
    if origin is None or origin == f"http://{request.host}":
        return None
    return (f"Origin {origin!r} is not this server's origin: the {policy.server} does not answer cross-site "
            f"requests from web pages; call it from a program, which sends no Origin header")


def _content_type_refusal(request: web.Request, policy: Policy) -> str | None:
    """Why a POST's ``Content-Type`` is not what its endpoint reads, or None (a POST without a body needs none)."""
    expected = policy.body_types.get(request.path)
    if expected is None:
        return None
    if "Content-Type" not in request.headers:
        if not request.body_exists:
            return None
    elif request.content_type in expected:
        return None
    got = request.headers.get("Content-Type", "none")
    return f"Content-Type: expected {' or '.join(expected)} for {request.path}, got {got}"


def _limit(request: web.Request) -> tuple[int, str]:
    policy = request.app[POLICY]
    if request.path == WEIGHT_PATH:
        return policy.max_weight_request_bytes, "--max-weight-request-mib"
    return policy.max_request_bytes, "--max-request-mib"


def _too_large(request: web.Request) -> Refused:
    limit, flag = _limit(request)
    return Refused(413, f"request body over the limit of {limit} bytes ({limit / 2**20:g} MiB) for {request.path}; "
                         f"raise it with {flag}")


@web.middleware
async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
    policy = request.app[POLICY]
    if (why := _host_refusal(request, policy)) is not None:
        return error_answer(421, why)
    if (why := _origin_refusal(request, policy)) is not None:
        return error_answer(403, why)
    token = policy.admin_token
    if token and request.path in policy.admin_paths and not hmac.compare_digest(
            request.headers.get("Authorization", "").encode(), f"Bearer {token}".encode()):
        return error_answer(401, "this endpoint needs 'Authorization: Bearer <admin token>'")
    if request.method == "POST":
        if (why := _content_type_refusal(request, policy)) is not None:
            return error_answer(415, why)
        if (request.content_length or 0) > _limit(request)[0]:
            return error_answer(413, str(_too_large(request)))
    try:
        return await handler(request)
    except Refused as exc:
        return error_answer(exc.status, str(exc))
    except web.HTTPException as exc:  # aiohttp's own (404, 405): JSON like every other answer
        if exc.status < 400:
            raise
        return error_answer(exc.status, f"{exc.reason}: {request.method} {request.path}")
    except Exception as exc:  # a bug: logged with its traceback, answered as JSON
        logging.getLogger(__name__).exception("%s %s failed", request.method, request.path)
        return error_answer(500, f"internal error: {type(exc).__name__}: {exc}")


class _QuietMalformedRequests(logging.Filter):
    """aiohttp logs a traceback for every request it cannot parse. SGLang's router opens each connection with
    an HTTP/2 preface (``PRI * HTTP/2.0``) and falls back to HTTP/1.1 on the 400 it gets: drop that record;
    any other malformed request is logged as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, BadHttpMessage):
            return True
        if "PRI" in str(exc):
            return False
        record.msg, record.args, record.exc_info = f"{record.getMessage()}: {exc.message}", (), None
        return True


QUIET_MALFORMED = _QuietMalformedRequests()


def guarded_app(policy: Policy) -> web.Application:
    """An application whose every request passes :func:`guard` under ``policy``."""
    logger = logging.getLogger("aiohttp.server")
    if QUIET_MALFORMED not in logger.filters:
        logger.addFilter(QUIET_MALFORMED)
    app = web.Application(client_max_size=max(policy.max_request_bytes, policy.max_weight_request_bytes),
                          middlewares=[guard])
    app[POLICY] = policy
    return app


def listen_hosts(host: str, port: int, admin_token: str, allowed_hosts: tuple[str, ...]) -> tuple[str, ...]:
    """The Host names a server started with ``--host host --port port`` accepts beyond its own addresses: the
    name it was started with (e.g. ``--host node7.cluster``) and ``allowed_hosts``. Serving beyond loopback
    needs an admin token (``ValueError`` otherwise)."""
    if host not in LOOPBACK and not admin_token:
        raise ValueError(f"--host {host}: serving beyond loopback needs an admin token "
                         f"(--admin-token or MILES_ADMIN_TOKEN)")
    if host not in LOOPBACK | {"0.0.0.0", "::", ""}:
        allowed_hosts = (*allowed_hosts, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return allowed_hosts


# -- bodies ----------------------------------------------------------------------------------------


async def read_body(request: web.Request) -> bytes:
    """The body, refused with 413 once it passes its endpoint's limit (chunked bodies included)."""
    limit = _limit(request)[0]
    body = bytearray()
    async for chunk in request.content.iter_chunked(1 << 20):
        body += chunk
        if len(body) > limit:
            raise _too_large(request)
    return bytes(body)


async def json_body(request: web.Request, max_depth: int | None = None) -> dict[str, Any]:
    """The JSON object of the body; an empty body is ``{}``. With ``max_depth``, a body whose arrays and
    objects lie more than that many levels within each other is refused (a server that encodes the body again
    must not meet Python's recursion limit there)."""
    raw = await read_body(request)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more than 4300 digits
        raise Refused(400, f"body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise Refused(400, "body is nested too deeply to parse (JSON arrays and objects within each other "
                           f"{sys.getrecursionlimit()} levels or more)") from exc
    if not isinstance(body, dict):
        raise Refused(400, "body must be a JSON object")
    if max_depth is not None and _deeper_than(body, max_depth):
        raise Refused(400, f"body is nested too deeply: JSON arrays and objects within each other more than "
                           f"{max_depth} levels")
    return body


def _deeper_than(value: Any, levels: int) -> bool:
    """Whether ``value`` holds lists and dicts more than ``levels`` deep (walked level by level, no recursion)."""
    level = [value] if isinstance(value, (list, dict)) else []  # the containers at this depth
    for _ in range(levels):
        if not level:
            return False
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x) if isinstance(v, (list, dict))]
    return bool(level)
