"""The embedded engine served over HTTP with SGLang's protocol.

    miles engine serve --model DIR [--host 127.0.0.1] [--port 30000]

Endpoints: ``POST /generate`` (SGLang's request schema, one prompt or a batch), ``GET /health``,
``GET /model_info`` and ``/server_info`` (also under their old names ``/get_model_info``, ``/get_server_info``),
``POST /abort_request``, ``/flush_cache``, ``/pause_generation`` (SGLang's ``mode``), ``/continue_generation``,
``/release_memory_occupation`` and ``/resume_memory_occupation`` (SGLang's ``tags``), ``GET /health_generate``
(503 while the engine cannot generate), and the weight
updates ``/update_weights_from_disk``, ``/update_weights_from_tensor``, ``/init_weights_update_group`` +
``/update_weights_from_distributed``, and ``/update_weights_from_shm`` (a descriptor of tensors in a file under
/dev/shm that a trainer on this machine wrote; see :mod:`miles.weights.shm`); ``/server_info`` names
the machine (``host_id``) so that a trainer knows. Every answer is strict JSON; an error is ``{"error": ...}``
naming the field or the header, and the server keeps serving. What a request must satisfy before it reaches an endpoint
(host, origin, admin token, content type, size) is :mod:`miles.engine.http_guard`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from safetensors.torch import load as load_safetensors

from miles.engine.http_guard import (
    LOOPBACK, MAX_REQUEST_BYTES, MAX_WEIGHT_REQUEST_BYTES, OCTET_STREAM, POLICY, QUIET_MALFORMED, WEIGHT_PATH, Policy,
    error_answer, guard, json_answer, json_body, read_body,
)
from miles.engine.local import EngineUnavailable, LocalEngine
from miles.weights.shm import SHM_PATH, MappedWeightFile, host_id, parse_descriptor
from miles.weights.wire import DTYPES, broadcast_tensors, decode_named_tensors, open_weight_group

__all__ = ["build_app", "serve", "MAX_REQUEST_BYTES", "MAX_WEIGHT_REQUEST_BYTES"]

# SGLang's GenerateReqInput fields (sglang 0.5) and what the embedded engine does with each.
GENERATE_HONOURED = frozenset({
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "return_entropy", "return_routed_experts",
})
GENERATE_IGNORED = frozenset({  # bookkeeping and routing hints: accepted whatever their value
    "model", "log_metrics", "no_logs", "priority", "routing_key", "conversation_id", "custom_labels",
    "external_trace_header", "received_time", "extra_key", "cache_salt", "http_worker_ipc", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "kv_hints",
})
GENERATE_OFF_ONLY = frozenset({  # features the engine lacks: accepted when null, false, 0 or empty only
    "stream", "background", "return_bytes", "return_hidden_states",
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


ENGINE = web.AppKey("engine", LocalEngine)
GROUPS = web.AppKey("groups", dict)
SHM_FILE = web.AppKey("shm_file", list)  # [the last MappedWeightFile], kept mapped between updates


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
                     each("logprob_start_len", -1), each("top_logprobs_num", 0), each("return_routed_experts", False))
    shared = {"return_entropy": body.get("return_entropy") or False,
              "return_text_in_logprobs": body.get("return_text_in_logprobs") or False}
    jobs = []
    for prompt, params, rid, return_logprob, start, top, routed in per_prompt:
        if not isinstance(params, dict):
            raise ValueError("sampling_params: expected a JSON object (in a batch, or a list of one per prompt)")
        if rid is not None and not isinstance(rid, str):
            raise ValueError(f"rid: expected a string, got {rid!r}")
        n = params.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"sampling_params.n: expected an integer >= 1, got {n!r}")
        job = {"input_ids": prompt, "sampling_params": {k: v for k, v in params.items() if k != "n"},
               "rid": None if n > 1 else rid, "return_logprob": return_logprob, "logprob_start_len": start,
               "top_logprobs_num": top, "return_routed_experts": routed, **shared}
        jobs += [job] * n  # n samples per prompt, prompt-major, as SGLang orders them
    return jobs, batched or len(jobs) > len(prompts)


async def generate(request: web.Request) -> web.Response:
    body = await json_body(request)
    engine = request.app[ENGINE]
    try:
        jobs, batched = _generate_jobs(body, engine)
        answers = await asyncio.gather(*(engine.generate(**job) for job in jobs))
    except EngineUnavailable as exc:  # memory released: not this request's fault, and not for long
        return error_answer(503, str(exc))
    except ValueError as exc:
        return error_answer(400, str(exc))
    return json_answer(answers if batched else answers[0])


# -- information and control -----------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    """Liveness: the server answers (also while its memory is released)."""
    return json_answer({"status": "ok", "weight_version": request.app[ENGINE].weight_version})


async def health_generate(request: web.Request) -> web.Response:
    """Readiness, as SGLang's: 503 while the engine cannot generate (memory released, weights not pushed since)."""
    engine = request.app[ENGINE]
    if (why := engine.refusal()) is not None:
        return error_answer(503, why)
    return json_answer({"status": "ok", "weight_version": engine.weight_version})


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    config = engine.model.config
    return json_answer({
        "model_path": engine.model_path, "tokenizer_path": engine.model_path, "is_generation": True,
        "weight_version": engine.weight_version, "context_length": engine.context_length,
        "vocab_size": config.vocab_size, "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None), "preferred_sampling_params": None,
        "has_image_understanding": False, "has_audio_understanding": False,
    })


async def server_info(request: web.Request) -> web.Response:
    from miles._version import __version__

    engine, policy = request.app[ENGINE], request.app[POLICY]
    return json_answer({
        "model_path": engine.model_path, "tokenizer_path": engine.model_path, "context_length": engine.context_length,
        "dp_size": 1, "tp_size": 1, "pp_size": 1, "max_running_requests": engine.max_batch_size,
        "random_seed": engine.seed, "weight_version": engine.weight_version, "version": __version__,
        "frontend": "miles", "host_id": host_id(), "max_request_bytes": policy.max_request_bytes,
        "max_weight_request_bytes": policy.max_weight_request_bytes,
        # requests_finished, waiting_requests, running_requests, prefill_tokens_requested and _computed,
        # prefix_cache_tokens, ...
        "internal_states": [engine.stats()],
    })


async def flush_cache(request: web.Request) -> web.Response:
    await json_body(request)
    await asyncio.get_running_loop().run_in_executor(None, request.app[ENGINE].flush_cache)  # between two steps
    return json_answer({"success": True, "message": "the prefix cache is empty"})


PAUSE_MODES = ("in_place", "retract", "abort")


async def pause(request: web.Request) -> web.Response:
    """SGLang's ``mode``: ``in_place`` and ``retract`` hold what is in flight (the engine keeps its KV cache
    either way), ``abort`` ends it first. Without a mode the requests are held (SGLang aborts them)."""
    body = await json_body(request)
    mode = body.get("mode") or "in_place"
    if mode not in PAUSE_MODES:
        return error_answer(400, f"mode: expected one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    engine = request.app[ENGINE]
    if mode == "abort":
        engine.abort(None)
    engine.pause()
    return json_answer({"success": True})


async def release_memory_occupation(request: web.Request) -> web.Response:
    """SGLang's ``tags`` (``weights``, ``kv_cache``; null for both). Only when idle; /generate answers 503 until
    resumed, and after the weights are resumed until weights are pushed again."""
    body = await json_body(request)
    try:
        await asyncio.get_running_loop().run_in_executor(None, request.app[ENGINE].release_memory, body.get("tags"))
    except ValueError as exc:
        return error_answer(400, str(exc))
    return json_answer({"success": True, "released": sorted(request.app[ENGINE].released)})


async def resume_memory_occupation(request: web.Request) -> web.Response:
    body = await json_body(request)
    try:
        await asyncio.get_running_loop().run_in_executor(None, request.app[ENGINE].resume_memory, body.get("tags"))
    except ValueError as exc:
        return error_answer(400, str(exc))
    return json_answer({"success": True, "released": sorted(request.app[ENGINE].released)})


async def resume(request: web.Request) -> web.Response:
    await json_body(request)
    request.app[ENGINE].resume()
    return json_answer({"success": True})


async def abort_request(request: web.Request) -> web.Response:
    body = await json_body(request)
    rid = body.get("rid")
    if rid is None and not body.get("abort_all"):
        return error_answer(400, "rid: name the request to abort, or send abort_all: true")
    count = request.app[ENGINE].abort(None if body.get("abort_all") else str(rid))
    return json_answer({"success": True, "aborted": count})


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


class Rewritten(Exception):
    """The shared-memory file changed while the engine read it (answered 409: retry)."""


async def _apply(request: web.Request, load: Callable[[], dict[str, torch.Tensor]],
                 options: Mapping[str, Any]) -> web.Response:
    """Load the tensors ``load()`` returns (off the event loop) into the engine, as a whole or not at all."""
    engine = request.app[ENGINE]
    try:
        version, allow = _update_options(options)
        version = await asyncio.get_running_loop().run_in_executor(
            None, lambda: engine.update_weights(load(), version, allow_non_finite=allow))
    except ValueError as exc:
        return error_answer(400, str(exc))
    except Rewritten as exc:
        return error_answer(409, str(exc))
    return json_answer({"success": True, "weight_version": version})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = await json_body(request)
    path = body.get("model_path")
    if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
        return error_answer(400, f"model_path: expected an HF model directory, got {path!r}")
    from miles.models.hf import load_model

    def load() -> dict[str, torch.Tensor]:
        try:
            return load_model(path).state_dict()
        except Exception as exc:
            raise ValueError(f"model_path: could not load {path!r} ({type(exc).__name__}: {exc})") from exc

    return await _apply(request, load, body)


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    if request.content_type == OCTET_STREAM:  # raw safetensors bytes: no base64, no JSON
        raw = await read_body(request)
        try:
            tensors = load_safetensors(raw)
        except Exception as exc:
            return error_answer(400, f"body: not safetensors bytes ({type(exc).__name__}: {exc})")
        return await _apply(request, lambda: tensors, request.query)
    body = await json_body(request)
    payload = body.get("serialized_named_tensors")
    if not isinstance(payload, str):
        return error_answer(400, "serialized_named_tensors: expected a base64 string of safetensors bytes")
    try:
        tensors = decode_named_tensors(payload)
    except ValueError as exc:
        return error_answer(400, str(exc))
    return await _apply(request, lambda: tensors, body)


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = await json_body(request)
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
    if missing:
        return error_answer(400, f"missing field(s): {', '.join(missing)}")
    rank = int(body["rank_offset"])  # SGLang's rank = rank_offset + tp_rank; one rank here; the trainer is rank 0
    args = (body["master_address"], int(body["master_port"]), rank, int(body["world_size"]),
            body.get("backend", "gloo"))
    try:
        group = await asyncio.get_running_loop().run_in_executor(None, lambda: open_weight_group(*args))
    except Exception as exc:
        return error_answer(400, f"could not join the weight group: {type(exc).__name__}: {exc}")
    request.app[GROUPS][body.get("group_name", "weight_update_group")] = group
    return json_answer({"success": True, "rank": rank})


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = await json_body(request)
    group = request.app[GROUPS].get(body.get("group_name", "weight_update_group"))
    if group is None:
        return error_answer(400, "group_name: no such weight group; call /init_weights_update_group first")
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)):
        return error_answer(400, "names, dtypes, shapes: expected three lists of the same length")
    if any(d not in DTYPES for d in dtypes):
        return error_answer(400, f"dtypes: expected names among {', '.join(DTYPES)}, "
                                 f"got {sorted(set(dtypes) - set(DTYPES))}")
    tensors = {n: torch.empty(tuple(s), dtype=DTYPES[d]) for n, d, s in zip(names, dtypes, shapes)}
    await asyncio.get_running_loop().run_in_executor(None, broadcast_tensors, group, list(tensors.values()))
    return await _apply(request, lambda: tensors, body)


async def update_weights_from_shm(request: web.Request) -> web.Response:
    """Tensors from the trainer's file in /dev/shm, copied straight into the model; with ``snapshot`` (a
    catch-up, which a push may race) first into memory of the engine's own, so that a rewrite seen by the
    header's second check leaves nothing applied."""
    body = await json_body(request)
    cache = request.app[SHM_FILE]
    try:
        d = parse_descriptor(body)
        _update_options(body)  # refused now rather than after the header's check
        mapped = MappedWeightFile.open(d.path, cache[0] if cache else None)
        tensors = mapped.tensors(d)
    except ValueError as exc:
        return error_answer(400, str(exc))
    cache[:] = [mapped]
    if (why := mapped.rewritten(d)) is not None:
        return error_answer(409, why)

    def load() -> dict[str, torch.Tensor]:
        if not d.snapshot:
            return tensors
        copies = {name: t.clone() for name, t in tensors.items()}
        if (why := mapped.rewritten(d)) is not None:
            raise Rewritten(why)
        return copies

    answer = await _apply(request, load, body)
    if answer.status == 200 and not d.snapshot and (why := mapped.rewritten(d)) is not None:
        # Only a writer that breaks the protocol (a push that does not wait for its posts) gets here.
        return error_answer(409, f"{why}; the weights were applied while it changed and may mix two versions")
    return answer


# -- the application -------------------------------------------------------------------------------


def build_app(engine: LocalEngine, admin_token: str = "", *, max_request_bytes: int = MAX_REQUEST_BYTES,
              max_weight_request_bytes: int = MAX_WEIGHT_REQUEST_BYTES,
              allowed_hosts: tuple[str, ...] = ()) -> web.Application:
    """The HTTP application of ``engine``; see the module's docstring for the checks each request passes."""
    logger = logging.getLogger("aiohttp.server")
    if QUIET_MALFORMED not in logger.filters:
        logger.addFilter(QUIET_MALFORMED)
    app = web.Application(client_max_size=max(max_request_bytes, max_weight_request_bytes), middlewares=[guard])
    app[ENGINE] = engine
    app[POLICY] = Policy(admin_token, max_request_bytes, max_weight_request_bytes,
                         frozenset(h.lower() for h in allowed_hosts))
    app[GROUPS] = {}
    app[SHM_FILE] = []
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
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
    app.router.add_post(SHM_PATH, update_weights_from_shm)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/release_memory_occupation", release_memory_occupation)
    app.router.add_post("/resume_memory_occupation", resume_memory_occupation)
    return app


def serve(model: str, host: str = "127.0.0.1", port: int = 30000, seed: int = 0, admin_token: str = "", *,
          device: str = "cpu", dtype: str = "float32", max_request_bytes: int = MAX_REQUEST_BYTES,
          max_weight_request_bytes: int = MAX_WEIGHT_REQUEST_BYTES, allowed_hosts: tuple[str, ...] = ()) -> None:
    if host not in LOOPBACK and not admin_token:
        raise ValueError(f"--host {host}: serving beyond loopback needs an admin token "
                         f"(--admin-token or MILES_ADMIN_TOKEN)")
    limits = [("--max-request-mib", max_request_bytes), ("--max-weight-request-mib", max_weight_request_bytes)]
    for name, value in limits:
        if value <= 0:
            raise ValueError(f"{name}: expected a size above 0, got {value / 2**20:g}")
    engine = LocalEngine(seed=seed, background=True, device=device, dtype=dtype)
    engine.load_model(model)
    if host not in LOOPBACK | {"0.0.0.0", "::", ""}:  # the name it was started with, e.g. --host node7.cluster
        allowed_hosts = (*allowed_hosts, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    app = build_app(engine, admin_token, max_request_bytes=max_request_bytes,
                    max_weight_request_bytes=max_weight_request_bytes, allowed_hosts=allowed_hosts)
    print(f"miles engine serving {model} on http://{host}:{port}", flush=True)
    web.run_app(app, host=host, port=port, print=None)
