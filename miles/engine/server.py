"""The embedded engine served over HTTP with SGLang's protocol.

    miles engine serve --model DIR [--host 127.0.0.1] [--port 30000]

Endpoints: ``POST /generate`` (SGLang's request schema, one prompt or a batch), ``GET /health``,
``GET /model_info`` and ``/server_info`` (also under their old names ``/get_model_info``, ``/get_server_info``),
``POST /abort_request``, ``/flush_cache``, ``/pause_generation``, ``/continue_generation``, and the weight
updates ``/update_weights_from_disk``, ``/update_weights_from_tensor``, ``/init_weights_update_group`` +
``/update_weights_from_distributed``. Every answer is strict JSON; an error is ``{"error": ...}`` naming the
field or the header, and the server keeps serving.

What a request must look like, checked in this order: a ``Host`` among this server's names (loopback, the
address it was reached on, ``--allowed-host``; else 421), no ``Origin`` but this server's own (else 403, so a
web page cannot drive the engine), the admin token on the admin and weight endpoints when one is set (else
401), ``Content-Type: application/json`` on a POST with a body (``application/octet-stream`` too for
``/update_weights_from_tensor``; else 415), and a body within the size limit of its endpoint (else 413).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from safetensors.torch import load as load_safetensors

from miles.engine.local import LocalEngine
from miles.engine.weights_io import DTYPES, broadcast_tensors, decode_named_tensors, open_weight_group

__all__ = ["build_app", "serve", "MAX_REQUEST_BYTES", "MAX_WEIGHT_REQUEST_BYTES"]

MAX_REQUEST_BYTES = 16 << 20
MAX_WEIGHT_REQUEST_BYTES = 1 << 30
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
ADMIN_PATHS = {
    "/abort_request", "/flush_cache", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
    "/update_weights_from_tensor", "/init_weights_update_group", "/update_weights_from_distributed",
}
WEIGHT_PATH = "/update_weights_from_tensor"  # the one endpoint that carries tensors, with a limit of its own
JSON = "application/json"
OCTET_STREAM = "application/octet-stream"
BODY_TYPES = {**{path: (JSON,) for path in ADMIN_PATHS | {"/generate"}}, WEIGHT_PATH: (JSON, OCTET_STREAM)}

# SGLang's GenerateReqInput fields (sglang 0.5) and what the embedded engine does with each.
GENERATE_HONOURED = frozenset({
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "return_entropy",
})
GENERATE_IGNORED = frozenset({  # bookkeeping and routing hints: accepted whatever their value
    "model", "log_metrics", "no_logs", "priority", "routing_key", "conversation_id", "custom_labels",
    "external_trace_header", "received_time", "extra_key", "cache_salt", "http_worker_ipc", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "kv_hints",
})
GENERATE_OFF_ONLY = frozenset({  # features the engine lacks: accepted when null, false, 0 or empty only
    "stream", "background", "return_bytes", "return_hidden_states", "return_routed_experts",
    "routed_experts_start_len", "return_indexer_topk", "return_prompt_token_ids", "token_ids_logprob",
    "return_sampling_mask", "sampling_logprobs_mode", "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs", "lora_path", "lora_id", "custom_logit_processor", "session_id",
    "session_params", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
    "use_audio_in_video", "video_config", "modalities", "watermark", "positional_embed_overrides",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
    "require_reasoning", "max_thinking_tokens", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
    "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
    "images_config", "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool",
})


@dataclass(frozen=True)
class Policy:
    """What a request must satisfy (see the module's docstring)."""

    admin_token: str = ""
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_weight_request_bytes: int = MAX_WEIGHT_REQUEST_BYTES
    allowed_hosts: frozenset[str] = frozenset()  # extra Host names ("name" or "name:port"); "*": any


ENGINE = web.AppKey("engine", LocalEngine)
POLICY = web.AppKey("policy", Policy)
GROUPS = web.AppKey("groups", dict)


# -- answers ---------------------------------------------------------------------------------------


def _json(data: Any, status: int = 200) -> web.Response:
    """A strict JSON answer: a non-finite float becomes null, never the invalid bare ``NaN``."""
    try:
        text = json.dumps(data, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(data), allow_nan=False)
    return web.Response(text=text, status=status, content_type=JSON)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


class _Refused(Exception):
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
            f"with port {local_port}); if you reach the engine by another name, start it with --allowed-host NAME")


def _origin_refusal(request: web.Request) -> str | None:
    """Why the ``Origin`` header (sent by browsers) is not this server's own origin, or None."""
    origin = request.headers.get("Origin")
    if origin is None or origin == f"http://{request.host}":
        return None
    return (f"Origin {origin!r} is not this server's origin: the engine does not answer cross-site requests "
            f"from web pages; call it from a program, which sends no Origin header")


def _content_type_refusal(request: web.Request) -> str | None:
    """Why a POST's ``Content-Type`` is not what its endpoint reads, or None (a POST without a body needs none)."""
    expected = BODY_TYPES.get(request.path)
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


def _too_large(request: web.Request) -> _Refused:
    limit, flag = _limit(request)
    return _Refused(413, f"request body over the limit of {limit} bytes ({limit / 2**20:g} MiB) for {request.path}; "
                         f"raise it with {flag}")


@web.middleware
async def _guard(request: web.Request, handler: Any) -> web.StreamResponse:
    policy = request.app[POLICY]
    if (why := _host_refusal(request, policy)) is not None:
        return _error(421, why)
    if (why := _origin_refusal(request)) is not None:
        return _error(403, why)
    token = policy.admin_token
    if token and request.path in ADMIN_PATHS and not hmac.compare_digest(
            request.headers.get("Authorization", "").encode(), f"Bearer {token}".encode()):
        return _error(401, "this endpoint needs 'Authorization: Bearer <admin token>'")
    if request.method == "POST":
        if (why := _content_type_refusal(request)) is not None:
            return _error(415, why)
        if (request.content_length or 0) > _limit(request)[0]:
            return _error(413, str(_too_large(request)))
    try:
        return await handler(request)
    except _Refused as exc:
        return _error(exc.status, str(exc))
    except web.HTTPException as exc:  # aiohttp's own (404, 405): JSON like every other answer
        if exc.status < 400:
            raise
        return _error(exc.status, f"{exc.reason}: {request.method} {request.path}")
    except Exception as exc:  # a bug: logged with its traceback, answered as JSON
        logging.getLogger(__name__).exception("%s %s failed", request.method, request.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


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


_QUIET = _QuietMalformedRequests()


# -- bodies ----------------------------------------------------------------------------------------


async def _read_body(request: web.Request) -> bytes:
    """The body, refused with 413 once it passes its endpoint's limit (chunked bodies included)."""
    limit = _limit(request)[0]
    body = bytearray()
    async for chunk in request.content.iter_chunked(1 << 20):
        body += chunk
        if len(body) > limit:
            raise _too_large(request)
    return bytes(body)


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The JSON object of the body; an empty body is ``{}``."""
    raw = await _read_body(request)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _Refused(400, f"body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _Refused(400, "body must be a JSON object")
    return body


# -- generation ------------------------------------------------------------------------------------


def _generate_jobs(body: dict[str, Any], engine: LocalEngine) -> tuple[list[dict[str, Any]], bool]:
    """SGLang's ``/generate`` request as keyword arguments of ``engine.generate``, one per sample, and whether
    the answer is a list. A ValueError names the field."""
    unknown = sorted(set(body) - GENERATE_HONOURED - GENERATE_IGNORED - GENERATE_OFF_ONLY)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}; expected SGLang's /generate fields "
                         f"(input_ids or text, sampling_params, return_logprob, rid, ...)")
    refused = sorted(k for k in GENERATE_OFF_ONLY & set(body) if body[k] not in (None, False, 0, "", [], {}))
    if refused:
        raise ValueError(", ".join(f"{k}: the embedded engine cannot honour {json.dumps(body[k])}" for k in refused)
                         + "; send null or false (or leave it out)")
    if (body.get("text") is None) == (body.get("input_ids") is None):
        raise ValueError("input_ids, text: send exactly one of them (token ids, or text to tokenize)")
    if body.get("text") is not None:
        text = body["text"]
        batched = isinstance(text, list)
        prompts = [engine.tokenize(t) for t in (text if batched else [text])]
        if batched and not prompts:
            raise ValueError("text: expected a string, or a non-empty list of strings")
    else:
        input_ids = body["input_ids"]
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids: expected a non-empty list of token ids, or a list of such lists")
        batched = all(isinstance(x, list) for x in input_ids)
        prompts = input_ids if batched else [input_ids]

    def each(name: str, default: Any) -> list[Any]:  # in a batch, a list holds one value per prompt
        value = body.get(name)
        if batched and isinstance(value, list):
            if len(value) != len(prompts):
                raise ValueError(f"{name}: expected one entry per prompt ({len(prompts)}), got {len(value)}")
            return [default if v is None else v for v in value]
        if name == "rid" and batched and value is not None:
            raise ValueError("rid: a batch needs a list of rids, one per prompt")
        return [default if value is None else value] * len(prompts)

    per_prompt = zip(prompts, each("sampling_params", {}), each("rid", None), each("return_logprob", False),
                     each("logprob_start_len", -1), each("top_logprobs_num", 0))
    shared = {"return_entropy": body.get("return_entropy") or False,
              "return_text_in_logprobs": body.get("return_text_in_logprobs") or False}
    jobs = []
    for prompt, params, rid, return_logprob, start, top in per_prompt:
        if not isinstance(params, dict):
            raise ValueError("sampling_params: expected a JSON object (in a batch, or a list of one per prompt)")
        if rid is not None and not isinstance(rid, str):
            raise ValueError(f"rid: expected a string, got {rid!r}")
        n = params.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"sampling_params.n: expected an integer >= 1, got {n!r}")
        job = {"input_ids": prompt, "sampling_params": {k: v for k, v in params.items() if k != "n"},
               "rid": None if n > 1 else rid, "return_logprob": return_logprob, "logprob_start_len": start,
               "top_logprobs_num": top, **shared}
        jobs += [job] * n  # n samples per prompt, prompt-major, as SGLang orders them
    return jobs, batched or len(jobs) > len(prompts)


async def generate(request: web.Request) -> web.Response:
    body = await _json_body(request)
    engine = request.app[ENGINE]
    try:
        jobs, batched = _generate_jobs(body, engine)
        answers = await asyncio.gather(*(engine.generate(**job) for job in jobs))
    except ValueError as exc:
        return _error(400, str(exc))
    return _json(answers if batched else answers[0])


# -- information and control -----------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok", "weight_version": request.app[ENGINE].weight_version})


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    config = engine.model.config
    return _json({
        "model_path": engine.model_path, "tokenizer_path": engine.model_path, "is_generation": True,
        "weight_version": engine.weight_version, "context_length": engine.context_length,
        "vocab_size": config.vocab_size, "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None), "preferred_sampling_params": None,
        "has_image_understanding": False, "has_audio_understanding": False,
    })


async def server_info(request: web.Request) -> web.Response:
    from miles import __version__

    engine, policy = request.app[ENGINE], request.app[POLICY]
    return _json({
        "model_path": engine.model_path, "tokenizer_path": engine.model_path, "context_length": engine.context_length,
        "dp_size": 1, "tp_size": 1, "pp_size": 1, "max_running_requests": engine.max_batch_size,
        "random_seed": engine.seed, "weight_version": engine.weight_version, "version": __version__,
        "frontend": "miles", "max_request_bytes": policy.max_request_bytes,
        "max_weight_request_bytes": policy.max_weight_request_bytes,
        "internal_states": [engine.stats()],  # requests_finished, waiting_requests, running_requests, ...
    })


async def flush_cache(request: web.Request) -> web.Response:
    await _json_body(request)
    return _json({"success": True, "message": "the embedded engine keeps no cache across requests"})


async def pause(request: web.Request) -> web.Response:
    await _json_body(request)
    request.app[ENGINE].pause()
    return _json({"success": True})


async def resume(request: web.Request) -> web.Response:
    await _json_body(request)
    request.app[ENGINE].resume()
    return _json({"success": True})


async def abort_request(request: web.Request) -> web.Response:
    body = await _json_body(request)
    rid = body.get("rid")
    if rid is None and not body.get("abort_all"):
        return _error(400, "rid: name the request to abort, or send abort_all: true")
    count = request.app[ENGINE].abort(None if body.get("abort_all") else str(rid))
    return _json({"success": True, "aborted": count})


# -- weights ---------------------------------------------------------------------------------------


def _update_options(fields: Mapping[str, Any]) -> tuple[int | None, bool]:
    """``weight_version`` and ``allow_non_finite`` from a JSON body or (raw tensors) the query string."""
    version, allow = fields.get("weight_version"), fields.get("allow_non_finite", False)
    if version is not None and not (isinstance(version, int) and not isinstance(version, bool)
                                    or isinstance(version, str) and version.isdigit()):
        raise ValueError(f"weight_version: expected an integer, got {version!r}")
    if isinstance(allow, str) and allow in ("true", "false"):  # the query string's spelling
        allow = allow == "true"
    if not isinstance(allow, bool):
        raise ValueError(f"allow_non_finite: expected true or false, got {allow!r}")
    return None if version is None else int(version), allow


async def _apply(request: web.Request, load: Callable[[], dict[str, torch.Tensor]],
                 options: Mapping[str, Any]) -> web.Response:
    """Load the tensors ``load()`` returns (off the event loop) into the engine, as a whole or not at all."""
    engine = request.app[ENGINE]
    try:
        version, allow = _update_options(options)
        version = await asyncio.get_running_loop().run_in_executor(
            None, lambda: engine.update_weights(load(), version, allow_non_finite=allow))
    except ValueError as exc:
        return _error(400, str(exc))
    return _json({"success": True, "weight_version": version})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = await _json_body(request)
    path = body.get("model_path")
    if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
        return _error(400, f"model_path: expected an HF model directory, got {path!r}")
    from miles.models import load_model

    def load() -> dict[str, torch.Tensor]:
        try:
            return load_model(path).state_dict()
        except Exception as exc:
            raise ValueError(f"model_path: could not load {path!r} ({type(exc).__name__}: {exc})") from exc

    return await _apply(request, load, body)


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    if request.content_type == OCTET_STREAM:  # raw safetensors bytes: no base64, no JSON
        raw = await _read_body(request)
        try:
            tensors = load_safetensors(raw)
        except Exception as exc:
            return _error(400, f"body: not safetensors bytes ({type(exc).__name__}: {exc})")
        return await _apply(request, lambda: tensors, request.query)
    body = await _json_body(request)
    payload = body.get("serialized_named_tensors")
    if not isinstance(payload, str):
        return _error(400, "serialized_named_tensors: expected a base64 string of safetensors bytes")
    try:
        tensors = decode_named_tensors(payload)
    except ValueError as exc:
        return _error(400, str(exc))
    return await _apply(request, lambda: tensors, body)


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = await _json_body(request)
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
    if missing:
        return _error(400, f"missing field(s): {', '.join(missing)}")
    rank = int(body["rank_offset"]) + 1  # the trainer is rank 0
    args = (body["master_address"], int(body["master_port"]), rank, int(body["world_size"]), body.get("backend", "gloo"))
    try:
        group = await asyncio.get_running_loop().run_in_executor(None, lambda: open_weight_group(*args))
    except Exception as exc:
        return _error(400, f"could not join the weight group: {type(exc).__name__}: {exc}")
    request.app[GROUPS][body.get("group_name", "weight_update_group")] = group
    return _json({"success": True, "rank": rank})


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = await _json_body(request)
    group = request.app[GROUPS].get(body.get("group_name", "weight_update_group"))
    if group is None:
        return _error(400, "group_name: no such weight group; call /init_weights_update_group first")
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)):
        return _error(400, "names, dtypes, shapes: expected three lists of the same length")
    if any(d not in DTYPES for d in dtypes):
        return _error(400, f"dtypes: expected names among {', '.join(DTYPES)}, got {sorted(set(dtypes) - set(DTYPES))}")
    tensors = {n: torch.empty(tuple(s), dtype=DTYPES[d]) for n, d, s in zip(names, dtypes, shapes)}
    await asyncio.get_running_loop().run_in_executor(None, broadcast_tensors, group, list(tensors.values()))
    return await _apply(request, lambda: tensors, body)


# -- the application -------------------------------------------------------------------------------


def build_app(engine: LocalEngine, admin_token: str = "", *, max_request_bytes: int = MAX_REQUEST_BYTES,
              max_weight_request_bytes: int = MAX_WEIGHT_REQUEST_BYTES,
              allowed_hosts: tuple[str, ...] = ()) -> web.Application:
    """The HTTP application of ``engine``; see the module's docstring for the checks each request passes."""
    logger = logging.getLogger("aiohttp.server")
    if _QUIET not in logger.filters:
        logger.addFilter(_QUIET)
    app = web.Application(client_max_size=max(max_request_bytes, max_weight_request_bytes), middlewares=[_guard])
    app[ENGINE] = engine
    app[POLICY] = Policy(admin_token, max_request_bytes, max_weight_request_bytes,
                         frozenset(h.lower() for h in allowed_hosts))
    app[GROUPS] = {}
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/pause_generation", pause)
    app.router.add_post("/continue_generation", resume)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post(WEIGHT_PATH, update_weights_from_tensor)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/abort_request", abort_request)
    return app


def serve(model: str, host: str = "127.0.0.1", port: int = 30000, seed: int = 0, admin_token: str = "", *,
          max_request_bytes: int = MAX_REQUEST_BYTES, max_weight_request_bytes: int = MAX_WEIGHT_REQUEST_BYTES,
          allowed_hosts: tuple[str, ...] = ()) -> None:
    if host not in LOOPBACK and not admin_token:
        raise ValueError(f"--host {host}: serving beyond loopback needs an admin token (--admin-token or MILES_ADMIN_TOKEN)")
    limits = [("--max-request-mib", max_request_bytes), ("--max-weight-request-mib", max_weight_request_bytes)]
    for name, value in limits:
        if value <= 0:
            raise ValueError(f"{name}: expected a size above 0, got {value / 2**20:g}")
    engine = LocalEngine(seed=seed, background=True)
    engine.load_model(model)
    if host not in LOOPBACK | {"0.0.0.0", "::", ""}:  # the name it was started with, e.g. --host node7.cluster
        allowed_hosts = (*allowed_hosts, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    app = build_app(engine, admin_token, max_request_bytes=max_request_bytes,
                    max_weight_request_bytes=max_weight_request_bytes, allowed_hosts=allowed_hosts)
    print(f"miles engine serving {model} on http://{host}:{port}", flush=True)
    web.run_app(app, host=host, port=port, print=None)
