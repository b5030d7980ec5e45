"""The router served standalone, so that external agents reach N engines through one address.

    miles router serve --engine http://127.0.0.1:30000 --engine http://127.0.0.1:30001 [--port 30100]
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from miles.engine.router import NoHealthyEngine, Router
from miles.errors import EngineRequestError

__all__ = ["build_router_app", "serve_router"]

ROUTER = web.AppKey("router", Router)


async def generate(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except json.JSONDecodeError as exc:
        return web.json_response({"error": f"body is not valid JSON: {exc}"}, status=400)
    if not isinstance(body, dict) or not isinstance(body.get("input_ids"), list) or not body["input_ids"]:
        return web.json_response({"error": "input_ids: expected a non-empty list of token ids"}, status=400)
    router = request.app[ROUTER]
    args: dict[str, Any] = {"sampling_params": body.get("sampling_params"),
                            "return_logprob": bool(body.get("return_logprob"))}
    try:
        if all(isinstance(x, list) for x in body["input_ids"]):
            answers = await asyncio.gather(*(router.generate(ids, **args) for ids in body["input_ids"]))
            return web.json_response(list(answers))
        return web.json_response(await router.generate(body["input_ids"], rid=body.get("rid"), **args))
    except EngineRequestError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    except NoHealthyEngine as exc:
        return web.json_response({"error": str(exc)}, status=503)


async def health(request: web.Request) -> web.Response:
    healthy = len(request.app[ROUTER].healthy)
    return web.json_response({"status": "ok" if healthy else "no healthy engine", "healthy_engines": healthy},
                             status=200 if healthy else 503)


async def list_engines(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    return web.json_response({
        "engines": [{"url": e.url, "outstanding": e.outstanding, "served": e.served, "quarantined": e.quarantined,
                     "weight_version": e.weight_version} for e in router.engines],
        "stats": router.stats,
    })


def build_router_app(router: Router) -> web.Application:
    app = web.Application()
    app[ROUTER] = router

    async def lifecycle(app: web.Application):
        await router.start()
        yield
        await router.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/list_engines", list_engines)
    return app


def serve_router(engines: list[str], host: str = "127.0.0.1", port: int = 30100, **router_args: Any) -> None:
    print(f"miles router on http://{host}:{port} in front of {len(engines)} engine(s)", flush=True)
    web.run_app(build_router_app(Router(engines, **router_args)), host=host, port=port, print=None)
