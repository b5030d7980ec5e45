"""The embedded engine served over HTTP with SGLang's protocol.

    miles engine serve --model DIR [--host 127.0.0.1] [--port 30000]

Endpoints: ``POST /generate`` (SGLang's request schema, one prompt or a batch), ``GET /health``,
``GET /model_info`` and ``/server_info`` (also under their old names ``/get_model_info``, ``/get_server_info``),
``POST /abort_request``, ``/flush_cache``, ``/pause_generation`` (SGLang's ``mode``), ``/continue_generation``,
``/release_memory_occupation`` and ``/resume_memory_occupation`` (SGLang's ``tags``), ``GET /health_generate``
(503 while the engine cannot generate), and the weight
updates ``/update_weights_from_disk``, ``/update_weights_from_tensor``, ``/init_weights_update_group`` +
``/update_weights_from_distributed``, and ``/update_weights_from_shm`` (a descriptor of tensors in a file under
/dev/shm that a trainer on this machine wrote; see :mod:`miles.weights.shm`; with a ``delta`` section only the
blocks that changed: :mod:`miles.weights.delta`, as are safetensors bytes whose metadata holds ``miles_delta``),
and ``GET /weights_checksum``; ``/server_info`` names
the machine (``host_id``) so that a trainer knows. Every answer is strict JSON; an error is ``{"error": ...}``
naming the field or the header, and the server keeps serving. A ``/generate`` batch is checked whole before any
of it runs (:mod:`miles.engine.generate_input`); a client that disconnects aborts its requests. What a request
must satisfy before it reaches an endpoint (host, origin, admin token, content type, size) is
:mod:`miles.engine.http_guard`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from safetensors.torch import load as load_safetensors

from miles.engine.http_guard import (
    MAX_REQUEST_BYTES, MAX_WEIGHT_REQUEST_BYTES, OCTET_STREAM, POLICY, WEIGHT_PATH, Policy, Refused, error_answer,
    guarded_app, json_answer, json_body, listen_hosts, read_body,
)
from miles.engine.generate_input import generate_requests
from miles.engine.local import EngineUnavailable, LocalEngine
from miles.engine.sampling import shown
from miles.weights.delta import (
    MAX_BLOCK_BYTES, DeltaRefused, check_delta, delta_blocks, delta_section, parse_delta, payload_blocks,
)
from miles.weights.delta import weights_checksum as delta_checksum
from miles.weights.shm import SHM_PATH, MappedWeightFile, host_id, parse_descriptor
from miles.weights.wire import BROADCAST_DTYPES, broadcast_tensors, decode_named_tensors, open_weight_group

__all__ = ["build_app", "app_runner", "serve", "MAX_REQUEST_BYTES", "MAX_WEIGHT_REQUEST_BYTES"]

ENGINE = web.AppKey("engine", LocalEngine)
GROUPS = web.AppKey("groups", dict)
SHM_FILE = web.AppKey("shm_file", list)  # [the last MappedWeightFile], kept mapped between updates
INT64_MAX = 2**63 - 1  # the largest weight version, and tensor size
MAX_WORLD = 1 << 20  # processes in a weight group


# -- generation ------------------------------------------------------------------------------------


async def generate(request: web.Request) -> web.Response:
    """Every element of a batch is checked before any is scheduled (400 naming the element and the field); a
    client that disconnects aborts its requests (the runner cancels this handler: :func:`app_runner`)."""
    body = await json_body(request)
    engine = request.app[ENGINE]
    try:
        requests, batched = generate_requests(body, engine)
    except EngineUnavailable as exc:  # memory released: not this request's fault, and not for long
        return error_answer(503, str(exc))
    except ValueError as exc:
        return error_answer(400, str(exc))
    answers = await asyncio.gather(*(engine.run(r) for r in requests))
    for answer in answers:  # which process answered: a router refuses answers of an engine restarted in place
        answer["meta_info"]["engine_instance"] = engine.instance
    return json_answer(answers if batched else answers[0])


# -- information and control -----------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    """Liveness: the server answers (also while its memory is released), with its weights' version and its
    ``instance`` (new in every engine process: a router tells a restarted engine by it, whatever its address)."""
    engine = request.app[ENGINE]
    return json_answer({"status": "ok", "weight_version": engine.weight_version, "instance": engine.instance})


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
        "vocab_size": engine.vocab_size, "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None), "preferred_sampling_params": None,
        "has_image_understanding": engine.vision is not None, "has_audio_understanding": False,
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
    mode = _field(body, "mode", f"one of {', '.join(PAUSE_MODES)}", lambda v: v in PAUSE_MODES, "in_place")
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
    rid = _field(body, "rid", "a string", lambda v: isinstance(v, str))
    abort_all = _field(body, "abort_all", "true or false", lambda v: isinstance(v, bool), False)
    if rid is None and not abort_all:
        return error_answer(400, "rid: name the request to abort, or send abort_all: true")
    count = request.app[ENGINE].abort(None if abort_all else rid)
    return json_answer({"success": True, "aborted": count})


def _field(body: Mapping[str, Any], name: str, expected: str, ok: Callable[[Any], bool], default: Any = None) -> Any:
    """``body[name]`` (``default`` when absent or null), refused with 400 naming it unless ``ok``."""
    value = body.get(name)
    if value is None:
        return default
    if not ok(value):
        raise Refused(400, f"{name}: expected {expected}, got {shown(value)}")
    return value


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high



# -- weights ---------------------------------------------------------------------------------------


def _update_options(fields: Mapping[str, Any]) -> tuple[int | None, bool]:
    """``weight_version`` and ``allow_non_finite`` from a JSON body or (raw tensors) the query string, whose
    values are strings: ``weight_version=7``, ``allow_non_finite=true``."""
    version, allow = fields.get("weight_version"), fields.get("allow_non_finite", False)
    if isinstance(version, str) and version.isascii() and version.isdigit() and len(version) <= 19:
        version = int(version)  # SGLang's spelling: a string of digits
    if version is not None and not _is_int(version, 0, INT64_MAX):
        raise ValueError(f"weight_version: expected an integer in [0, {INT64_MAX}] (or a string of its digits), "
                         f"got {shown(version)}")
    if not isinstance(fields, dict) and allow in ("true", "false"):  # the query string's spelling (a JSON body: true)
        allow = allow == "true"
    if not isinstance(allow, bool):
        raise ValueError(f"allow_non_finite: expected true or false, got {shown(allow)}")
    return version, allow


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


def _is_model_dir(path: Any) -> bool:
    try:
        return isinstance(path, str) and bool(path) and (Path(path) / "config.json").is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte
        return False


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = await json_body(request)
    path = body.get("model_path")
    if not _is_model_dir(path):
        return error_answer(400, f"model_path: expected an HF model directory (with a config.json), "
                                 f"got {shown(path)}")
    from miles.models.hf import load_weights

    def load() -> dict[str, torch.Tensor]:
        try:
            return load_weights(path)
        except Exception as exc:
            raise ValueError(f"model_path: could not load {path!r} ({type(exc).__name__}: {exc})") from exc

    return await _apply(request, load, body)


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    if request.content_type == OCTET_STREAM:  # raw safetensors bytes: no base64, no JSON
        raw = await read_body(request)
        try:
            tensors = load_safetensors(raw)
            section = delta_section(raw)  # a delta push: only the changed blocks (miles.weights.delta)
        except Exception as exc:
            return error_answer(400, f"body: not safetensors bytes ({type(exc).__name__}: {exc})")
        if section is not None:
            sizes = {name: t.numel() * t.element_size() for name, t in request.app[ENGINE].model.state_dict().items()}
            return await _apply_delta(request, request.query, section, list(sizes),
                                      lambda delta: payload_blocks(tensors, delta, sizes))
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
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if body.get(k) is None]
    if missing:
        return error_answer(400, f"missing field(s): {', '.join(missing)}")
    address = _field(body, "master_address", "a host name or address", lambda v: isinstance(v, str) and v != "")
    port = _field(body, "master_port", "a port in [1, 65535]", lambda v: _is_int(v, 1, 65535))
    world = _field(body, "world_size", f"an integer in [2, {MAX_WORLD}] (the trainer and the engines)",
                   lambda v: _is_int(v, 2, MAX_WORLD))
    # SGLang's rank = rank_offset + tp_rank; one rank here; the trainer is rank 0
    rank = _field(body, "rank_offset", f"an integer in [1, world_size - 1 = {world - 1}] (the trainer is rank 0)",
                  lambda v: _is_int(v, 1, world - 1))
    backend = _field(body, "backend", "'gloo'", lambda v: isinstance(v, str), "gloo")
    name = _group_name(body)
    try:
        group = await asyncio.get_running_loop().run_in_executor(
            None, lambda: open_weight_group(address, port, rank, world, backend))
    except Exception as exc:
        return error_answer(400, f"could not join the weight group: {type(exc).__name__}: {exc}")
    request.app[GROUPS][name] = group
    return json_answer({"success": True, "rank": rank})



def _group_name(body: Mapping[str, Any]) -> str:
    return _field(body, "group_name", "a string", lambda v: isinstance(v, str), "weight_update_group")


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = await json_body(request)
    group = request.app[GROUPS].get(_group_name(body))
    if group is None:
        return error_answer(400, "group_name: no such weight group; call /init_weights_update_group first")
    try:
        _update_options(body)  # refused before the broadcast rather than after it
        names, dtypes, shapes = _broadcast_layout(body, request.app[ENGINE])
    except ValueError as exc:
        return error_answer(400, str(exc))
    tensors = {n: torch.empty(s, dtype=BROADCAST_DTYPES[d]) for n, d, s in zip(names, dtypes, shapes)}
    await asyncio.get_running_loop().run_in_executor(None, broadcast_tensors, group, list(tensors.values()))
    return await _apply(request, lambda: tensors, body)


def _broadcast_layout(body: Mapping[str, Any], engine: LocalEngine) -> tuple[list[str], list[str], list[tuple]]:
    """The ``names``, ``dtypes`` and ``shapes`` of a ``/update_weights_from_distributed`` body, checked before
    the engine allocates what it receives (never more elements than the model has: such an update could never be
    applied)."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    for key, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(value, list):
            raise ValueError(f"{key}: expected a list (one entry per tensor), got {shown(value)}")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes, shapes: expected lists of the same length, got {len(names)}, "
                         f"{len(dtypes)}, {len(shapes)}")
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError("names: expected distinct tensor names (strings)")
    if bad := [d for d in dtypes if not isinstance(d, str) or d not in BROADCAST_DTYPES]:
        raise ValueError(f"dtypes: expected names among {', '.join(BROADCAST_DTYPES)}, got {shown(bad[0])}")
    if bad := [s for s in shapes if not isinstance(s, list) or not all(_is_int(d, 0, INT64_MAX) for d in s)]:
        raise ValueError(f"shapes: expected lists of sizes >= 0, got {shown(bad[0])}")
    if "weights" in engine.released:
        raise ValueError("the engine's weights are released (release_memory_occupation); resume them "
                         "(resume_memory_occupation) before an update")
    limit = sum(t.numel() for t in engine.model.state_dict().values())
    if (total := sum(math.prod(s) for s in shapes)) > limit:
        raise ValueError(f"shapes: {total} elements in all, more than the model's {limit}: no such update fits it")
    return names, dtypes, [tuple(s) for s in shapes]


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
    if "delta" in body:
        return await _apply_delta(request, body, body["delta"], d.names, lambda delta: delta_blocks(tensors, delta),
                                  lambda: mapped.rewritten(d))

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


async def _apply_delta(request: web.Request, options: Mapping[str, Any], section: Any, names: list[str],
                       blocks_of: Callable[[Any], list], rewritten: Callable[[], str | None] = lambda: None
                       ) -> web.Response:
    """A delta push (:mod:`miles.weights.delta`): only the changed blocks (``blocks_of(delta)``) are copied, once
    the engine's weights are found to be the delta's base; else 409 with ``full_push_needed``, nothing applied."""
    engine = request.app[ENGINE]
    try:
        version, allow = _update_options(options)
        if version is None:
            raise ValueError("weight_version: a delta push needs the version it makes")
        delta = parse_delta(section, names)
        blocks = blocks_of(delta)
        version = await asyncio.get_running_loop().run_in_executor(None, lambda: engine.update_weight_blocks(
            blocks, version, lambda params, held: check_delta(params, held, blocks, delta), allow))
    except DeltaRefused as exc:
        return json_answer({"error": str(exc), "full_push_needed": True, "weight_version": engine.weight_version}, 409)
    except ValueError as exc:
        return error_answer(400, str(exc))
    if (why := rewritten()) is not None:  # a writer that breaks the protocol: see update_weights_from_shm
        return error_answer(409, f"{why}; the weights were applied while it changed and may mix two versions")
    return json_answer({"success": True, "weight_version": version})


async def weights_checksum(request: web.Request) -> web.Response:
    """The checksum of the engine's weights (:func:`miles.weights.delta.weights_checksum`; ``block_bytes``: the
    blocks', 1 MiB by default) and their version: what a delta push checks."""
    engine, raw = request.app[ENGINE], request.query.get("block_bytes", str(1 << 20))
    if not (raw.isascii() and raw.isdigit() and len(raw) < 12 and 64 <= int(raw) <= MAX_BLOCK_BYTES
            and int(raw) % 64 == 0):
        return error_answer(400, f"block_bytes: expected a multiple of 64 from 64 to {MAX_BLOCK_BYTES}, "
                                 f"got {shown(raw)}")

    def read() -> tuple[int, str]:
        with engine.batcher.step_lock:  # no update half applied
            return engine.weight_version, delta_checksum(engine.model.state_dict(), int(raw))

    version, checksum = await asyncio.get_running_loop().run_in_executor(None, read)
    return json_answer({"weight_version": version, "checksum": checksum, "block_bytes": int(raw)})


# -- the application -------------------------------------------------------------------------------


def build_app(engine: LocalEngine, admin_token: str = "", *, max_request_bytes: int = MAX_REQUEST_BYTES,
              max_weight_request_bytes: int = MAX_WEIGHT_REQUEST_BYTES,
              allowed_hosts: tuple[str, ...] = ()) -> web.Application:
    """The HTTP application of ``engine``; see the module's docstring for the checks each request passes."""
    app = guarded_app(Policy(admin_token, max_request_bytes, max_weight_request_bytes,
                             frozenset(h.lower() for h in allowed_hosts)))
    app[ENGINE] = engine
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
    app.router.add_get("/weights_checksum", weights_checksum)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/release_memory_occupation", release_memory_occupation)
    app.router.add_post("/resume_memory_occupation", resume_memory_occupation)
    return app


def app_runner(app: web.Application) -> web.AppRunner:
    """The runner to serve the engine's application with: a client that disconnects cancels its handler, which
    aborts its requests in the engine, as SGLang does (aiohttp lets handlers run on by default)."""
    return web.AppRunner(app, handler_cancellation=True)


def serve(model: str, host: str = "127.0.0.1", port: int = 30000, seed: int = 0, admin_token: str = "", *,
          device: str = "cpu", dtype: str = "float32", max_request_bytes: int = MAX_REQUEST_BYTES,
          max_weight_request_bytes: int = MAX_WEIGHT_REQUEST_BYTES, allowed_hosts: tuple[str, ...] = (),
          engine_args: dict[str, Any] | None = None) -> None:
    """``engine_args``: more arguments of :class:`LocalEngine` (``max_batch_size``, ``prefix_cache_tokens``,
    ``exact_logprobs`` ...), as ``rollout.engine`` gives them."""
    allowed_hosts = listen_hosts(host, port, admin_token, allowed_hosts)
    limits = [("--max-request-mib", max_request_bytes), ("--max-weight-request-mib", max_weight_request_bytes)]
    for name, value in limits:
        if value <= 0:
            raise ValueError(f"{name}: expected a size above 0, got {value / 2**20:g}")
    engine = LocalEngine(**{"seed": seed, "device": device, "dtype": dtype, **(engine_args or {}), "background": True})
    engine.load_model(model)
    app = build_app(engine, admin_token, max_request_bytes=max_request_bytes,
                    max_weight_request_bytes=max_weight_request_bytes, allowed_hosts=allowed_hosts)
    print(f"miles engine serving {model} on http://{host}:{port}", flush=True)
    web.run_app(app, host=host, port=port, print=None, handler_cancellation=True)  # as app_runner
