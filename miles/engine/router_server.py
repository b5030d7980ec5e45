"""The router served standalone, so that external agents reach N engines through one address.

    miles router serve --engine http://127.0.0.1:30000 --engine http://127.0.0.1:30001 [--port 30100]

Endpoints: ``POST /generate`` (``input_ids``, one prompt or a list of prompts, with ``sampling_params``,
``return_logprob`` and ``rid``; each prompt goes to the engine with the fewest requests outstanding), ``GET /health``
(503 while no engine is in service), ``GET /list_engines``, and the admin endpoints ``POST /abort_request`` and
``/flush_cache``, which reach every engine in service. Every request passes the engine server's checks first
(:mod:`miles.engine.http_guard`: Host 421, Origin 403, admin token 401, Content-Type 415, size 413, a body that
is JSON 400), under the same flags; the router sends its admin token to the engines too.

A request that no engine can serve is answered 503, ``{"error": ...}`` naming why and each engine with its last
error: every engine has failed and none answered a health check within ``--no-engine-wait-s`` of the last failure
(the router cannot know whether an engine will come back), no answer came within ``--request-timeout-s``, or it
failed on ``--max-retries`` + 1 engines. A request an engine refuses (400) gets that refusal.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from miles.engine.http_guard import (
    JSON, MAX_REQUEST_BYTES, Policy, Refused, guarded_app, json_answer, json_body, listen_hosts,
)
from miles.engine.router import NoHealthyEngine, Router
from miles.errors import EngineRequestError

__all__ = ["build_router_app", "serve_router"]

ROUTER = web.AppKey("router", Router)
ADMIN_PATHS = frozenset({"/abort_request", "/flush_cache"})  # to every engine in service
# Levels of JSON arrays and objects in a body: what the router forwards it encodes again, away from Python's
# recursion limit. No request of SGLang's protocol nests nearly this deep.
MAX_NESTING = 64


def _refusal(exc: EngineRequestError | NoHealthyEngine) -> Refused:
    """An engine's refusal passes on as 400; no engine to serve the request is 503."""
    return Refused(400 if isinstance(exc, EngineRequestError) else 503, str(exc))


async def generate(request: web.Request) -> web.Response:
    body = await json_body(request, max_depth=MAX_NESTING)
    prompts = body.get("input_ids")
    if not isinstance(prompts, list) or not prompts:
        raise Refused(400, "input_ids: expected a non-empty list of token ids, or a list of such lists")
    router = request.app[ROUTER]
    args: dict[str, Any] = {"sampling_params": body.get("sampling_params"),
                            "return_logprob": body.get("return_logprob", False)}
    try:
        if all(isinstance(x, list) for x in prompts):
            answers = await asyncio.gather(*(router.generate(ids, **args) for ids in prompts), return_exceptions=True)
            if errors := [a for a in answers if isinstance(a, BaseException)]:
                raise errors[0]
            return json_answer(answers)
        return json_answer(await router.generate(prompts, rid=body.get("rid"), **args))
    except (EngineRequestError, NoHealthyEngine) as exc:
        raise _refusal(exc) from exc


async def to_every_engine(request: web.Request) -> web.Response:
    """An admin request, posted to every engine in service; answers how many took it, and their answers."""
    body = await json_body(request, max_depth=MAX_NESTING)
    router = request.app[ROUTER]
    try:
        answers = await router.post_all(request.path, body)
    except (EngineRequestError, NoHealthyEngine) as exc:
        raise _refusal(exc) from exc
    if not answers:
        raise Refused(503, f"no engine in service took {request.path}: {router.describe()}")
    return json_answer({"success": True, "engines": len(answers), "answers": answers})


async def health(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    healthy = len(router.healthy)
    answer: dict[str, Any] = {"status": "ok" if healthy else "no healthy engine", "healthy_engines": healthy}
    if not healthy:
        answer["error"] = f"no engine in service: {router.describe()}"
    return json_answer(answer, 200 if healthy else 503)


async def list_engines(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    return json_answer({
        "engines": [{"url": e.url, "outstanding": e.outstanding, "served": e.served, "quarantined": e.quarantined,
                     "down": e.down, "last_error": e.last_error, "weight_version": e.weight_version}
                    for e in router.engines],
        "waiting_for_engine": router.waiting_for_engine,
        "stats": router.stats,
    })


def build_router_app(router: Router, *, admin_token: str = "", max_request_bytes: int = MAX_REQUEST_BYTES,
                     allowed_hosts: tuple[str, ...] = ()) -> web.Application:
    """The HTTP application of ``router``; see the module's docstring for the checks each request passes."""
    app = guarded_app(Policy(admin_token, max_request_bytes, max_request_bytes,
                             frozenset(h.lower() for h in allowed_hosts), server="router", admin_paths=ADMIN_PATHS,
                             body_types={path: (JSON,) for path in ADMIN_PATHS | {"/generate"}}))
    app[ROUTER] = router

    async def lifecycle(app: web.Application):
        await router.start()
        yield
        await router.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/generate", generate)
    for path in sorted(ADMIN_PATHS):
        app.router.add_post(path, to_every_engine)
    app.router.add_get("/health", health)
    app.router.add_get("/list_engines", list_engines)
    return app


def serve_router(engines: list[str], host: str = "127.0.0.1", port: int = 30100, *, admin_token: str = "",
                 max_request_bytes: int = MAX_REQUEST_BYTES, allowed_hosts: tuple[str, ...] = (),
                 **router_args: Any) -> None:
    """``router_args``: the :class:`Router`'s settings (``request_timeout_s``, ``no_engine_wait_s`` ...)."""
    allowed_hosts = listen_hosts(host, port, admin_token, allowed_hosts)
    if max_request_bytes <= 0:
        raise ValueError(f"--max-request-mib: expected a size above 0, got {max_request_bytes / 2**20:g}")
    router = Router(engines, admin_token=admin_token, settings_as_flags=True, **router_args)
    app = build_router_app(router, admin_token=admin_token, max_request_bytes=max_request_bytes,
                           allowed_hosts=allowed_hosts)
    print(f"miles router on http://{host}:{port} in front of {len(engines)} engine(s)", flush=True)
    web.run_app(app, host=host, port=port, print=None)
