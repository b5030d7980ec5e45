"""The embedded engine served over HTTP with SGLang's protocol.

    miles engine serve --model DIR [--host 127.0.0.1] [--port 30000]

Implemented endpoints: ``POST /generate`` (one prompt or a batch), ``GET /health``,
``GET /get_model_info``, ``POST /flush_cache``, ``POST /pause_generation``,
``POST /continue_generation`` and ``POST /update_weights_from_disk``. A malformed request gets
``400`` with ``{"error": ...}`` naming the field; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aiohttp import web

from miles.engine.local import LocalEngine

__all__ = ["build_app", "serve"]

ENGINE = web.AppKey("engine", LocalEngine)
RESUMED = web.AppKey("resumed", asyncio.Event)


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"body is not valid JSON: {exc}"}),
                                 content_type="application/json") from exc
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=json.dumps({"error": "body must be a JSON object"}), content_type="application/json")
    return body


async def generate(request: web.Request) -> web.Response:
    body = await _json_body(request)
    engine = request.app[ENGINE]
    unknown = sorted(set(body) - {"input_ids", "sampling_params", "return_logprob", "rid", "stream"})
    if unknown:
        return _bad_request(f"unknown field(s) {', '.join(map(repr, unknown))}; expected input_ids, sampling_params, return_logprob")
    if body.get("stream"):
        return _bad_request("stream: streaming is not supported by the embedded engine")
    input_ids = body.get("input_ids")
    batched = isinstance(input_ids, list) and bool(input_ids) and all(isinstance(x, list) for x in input_ids)
    prompts = input_ids if batched else [input_ids]
    if not isinstance(input_ids, list) or not input_ids:
        return _bad_request("input_ids: expected a non-empty list of token ids, or a list of such lists")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        return _bad_request("sampling_params: expected a JSON object")
    await request.app[RESUMED].wait()
    try:
        answers = await asyncio.gather(
            *(engine.generate(p, params, bool(body.get("return_logprob", False))) for p in prompts)
        )
    except ValueError as exc:
        return _bad_request(str(exc))
    return web.json_response(answers if batched else answers[0])


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "weight_version": request.app[ENGINE].weight_version})


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response({
        "model_path": engine.model_path, "is_generation": True, "weight_version": engine.weight_version,
        "context_length": engine.context_length, "vocab_size": engine.model.config.vocab_size,
    })


async def flush_cache(request: web.Request) -> web.Response:
    return web.json_response({"success": True, "message": "the embedded engine keeps no cache across requests"})


async def pause(request: web.Request) -> web.Response:
    request.app[RESUMED].clear()
    return web.json_response({"success": True})


async def resume(request: web.Request) -> web.Response:
    request.app[RESUMED].set()
    return web.json_response({"success": True})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = await _json_body(request)
    path = body.get("model_path")
    if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
        return _bad_request(f"model_path: expected an HF model directory, got {path!r}")
    engine = request.app[ENGINE]
    from miles.models import load_model

    try:
        version = engine.update_weights(load_model(path).state_dict())
    except ValueError as exc:
        return _bad_request(str(exc))
    return web.json_response({"success": True, "message": f"loaded {path}", "weight_version": version})


def build_app(engine: LocalEngine) -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app[ENGINE] = engine
    resumed = asyncio.Event()
    resumed.set()
    app[RESUMED] = resumed
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/pause_generation", pause)
    app.router.add_post("/continue_generation", resume)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    return app


def serve(model: str, host: str = "127.0.0.1", port: int = 30000, seed: int = 0) -> None:
    engine = LocalEngine(seed=seed)
    engine.load_model(model)
    print(f"miles engine serving {model} on http://{host}:{port}", flush=True)
    web.run_app(build_app(engine), host=host, port=port, print=None)
