"""The embedded engine served over HTTP with SGLang's protocol.

    miles engine serve --model DIR [--host 127.0.0.1] [--port 30000]

Endpoints: ``POST /generate`` (one prompt or a batch), ``GET /health``, ``GET /get_model_info``,
``POST /abort_request``, ``/flush_cache``, ``/pause_generation``, ``/continue_generation``, and the
weight updates ``/update_weights_from_disk``, ``/update_weights_from_tensor``,
``/init_weights_update_group`` + ``/update_weights_from_distributed``. A malformed request gets
``400`` with ``{"error": ...}`` naming the field; the server keeps serving. Bound beyond loopback,
the admin and weight endpoints require ``Authorization: Bearer <admin token>``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aiohttp import web

import torch
from safetensors.torch import load as load_safetensors

from miles.engine.local import LocalEngine
from miles.engine.weights_io import DTYPES, broadcast_tensors, decode_named_tensors, open_weight_group

__all__ = ["build_app", "serve"]

ENGINE = web.AppKey("engine", LocalEngine)
TOKEN = web.AppKey("token", str)
GROUPS = web.AppKey("groups", dict)
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
ADMIN_PATHS = {
    "/abort_request", "/flush_cache", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
    "/update_weights_from_tensor", "/init_weights_update_group", "/update_weights_from_distributed",
}


@web.middleware
async def _admin_token(request: web.Request, handler):
    token = request.app[TOKEN]
    if token and request.path in ADMIN_PATHS and request.headers.get("Authorization") != f"Bearer {token}":
        return web.json_response({"error": "this endpoint needs 'Authorization: Bearer <admin token>'"}, status=401)
    return await handler(request)


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
    rid = body.get("rid")
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
    n = params.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return _bad_request(f"sampling_params.n: expected an integer >= 1, got {n!r}")
    params = {k: v for k, v in params.items() if k != "n"}
    if batched:
        rids = rid if isinstance(rid, list) and len(rid) == len(prompts) else [None] * len(prompts)
    else:
        rids = [rid]
    try:
        # n samples per prompt, prompt-major, as SGLang orders them
        answers = await asyncio.gather(*(
            engine.generate(p, params, bool(body.get("return_logprob", False)), rid=None if n > 1 else r)
            for p, r in zip(prompts, rids) for _ in range(n)
        ))
    except ValueError as exc:
        return _bad_request(str(exc))
    return web.json_response(answers if batched or n > 1 else answers[0])


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
    request.app[ENGINE].pause()
    return web.json_response({"success": True})


async def resume(request: web.Request) -> web.Response:
    request.app[ENGINE].resume()
    return web.json_response({"success": True})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = await _json_body(request)
    path = body.get("model_path")
    if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
        return _bad_request(f"model_path: expected an HF model directory, got {path!r}")
    from miles.models import load_model

    return await _apply(request, load_model(path).state_dict(), body)


async def abort_request(request: web.Request) -> web.Response:
    body = await _json_body(request)
    rid = body.get("rid")
    if rid is None and not body.get("abort_all"):
        return _bad_request("rid: name the request to abort, or send abort_all: true")
    count = request.app[ENGINE].abort(None if body.get("abort_all") else str(rid))
    return web.json_response({"success": True, "aborted": count})


async def _apply(request: web.Request, tensors: dict, body: dict) -> web.Response:
    engine = request.app[ENGINE]
    version = body.get("weight_version")
    if version is not None and not (isinstance(version, int) or str(version).isdigit()):
        return _bad_request(f"weight_version: expected an integer, got {version!r}")
    try:
        version = await asyncio.get_running_loop().run_in_executor(
            None, engine.update_weights, tensors, None if version is None else int(version))
    except ValueError as exc:
        return _bad_request(str(exc))
    return web.json_response({"success": True, "weight_version": version})


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    if request.content_type == "application/octet-stream":  # raw safetensors bytes: no base64, no JSON
        version = request.query.get("weight_version")
        try:
            tensors = load_safetensors(await request.read())
        except Exception as exc:
            return _bad_request(f"body: not safetensors bytes ({type(exc).__name__}: {exc})")
        return await _apply(request, tensors, {} if version is None else {"weight_version": version})
    body = await _json_body(request)
    payload = body.get("serialized_named_tensors")
    if not isinstance(payload, str):
        return _bad_request("serialized_named_tensors: expected a base64 string of safetensors bytes")
    try:
        tensors = decode_named_tensors(payload)
    except ValueError as exc:
        return _bad_request(str(exc))
    return await _apply(request, tensors, body)


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = await _json_body(request)
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
    if missing:
        return _bad_request(f"missing field(s): {', '.join(missing)}")
    rank = int(body["rank_offset"]) + 1  # the trainer is rank 0
    args = (body["master_address"], int(body["master_port"]), rank, int(body["world_size"]), body.get("backend", "gloo"))
    try:
        group = await asyncio.get_running_loop().run_in_executor(None, lambda: open_weight_group(*args))
    except Exception as exc:
        return _bad_request(f"could not join the weight group: {type(exc).__name__}: {exc}")
    request.app[GROUPS][body.get("group_name", "weight_update_group")] = group
    return web.json_response({"success": True, "rank": rank})


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = await _json_body(request)
    group = request.app[GROUPS].get(body.get("group_name", "weight_update_group"))
    if group is None:
        return _bad_request("group_name: no such weight group; call /init_weights_update_group first")
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)):
        return _bad_request("names, dtypes, shapes: expected three lists of the same length")
    if any(d not in DTYPES for d in dtypes):
        return _bad_request(f"dtypes: expected names among {', '.join(DTYPES)}, got {sorted(set(dtypes) - set(DTYPES))}")
    tensors = {n: torch.empty(tuple(s), dtype=DTYPES[d]) for n, d, s in zip(names, dtypes, shapes)}
    await asyncio.get_running_loop().run_in_executor(None, broadcast_tensors, group, list(tensors.values()))
    return await _apply(request, tensors, body)


def build_app(engine: LocalEngine, admin_token: str = "") -> web.Application:
    app = web.Application(client_max_size=1 << 30, middlewares=[_admin_token])
    app[ENGINE] = engine
    app[TOKEN] = admin_token
    app[GROUPS] = {}
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/pause_generation", pause)
    app.router.add_post("/continue_generation", resume)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/abort_request", abort_request)
    return app


def serve(model: str, host: str = "127.0.0.1", port: int = 30000, seed: int = 0, admin_token: str = "") -> None:
    if host not in LOOPBACK and not admin_token:
        raise ValueError(f"--host {host}: serving beyond loopback needs an admin token (--admin-token or MILES_ADMIN_TOKEN)")
    engine = LocalEngine(seed=seed, background=True)
    engine.load_model(model)
    print(f"miles engine serving {model} on http://{host}:{port}", flush=True)
    web.run_app(build_app(engine, admin_token), host=host, port=port, print=None)
