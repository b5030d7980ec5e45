"""NeMo Gym agent servers as Miles rollouts, for Miles' ``agent`` rollout function:

    rollout:
      fn: {name: agent, agent: "miles_nemo_gym.agent:run", agent_url: "http://127.0.0.1:8002", adapter_port: 8003}
    data: {prompt_key: responses_create_params}
    reward: {name: env}

For each sample, :func:`run` calls the agent server's ``POST /run`` with the task (the sample's
``responses_create_params`` and the row's other fields, see :mod:`miles_nemo_gym.task`), the way NeMo Gym's
rollout collection does. The agent server seeds its resources server, runs its loop, calling its model server
with the Responses API, and verifies. Its model server must be ``http://<adapter_host>:<adapter_port>``: the
:class:`~miles_nemo_gym.adapter.ResponsesAdapter` that :func:`run` serves there, which turns each call into a
chat completion of this sample's Miles session, so Miles records the exact tokens. The reward is the one
``/run`` answers; the verifier's other plain fields go to ``sample.metadata["nemo_gym"]``.

One adapter listens per event loop and port while samples run, like Miles' session server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

import aiohttp

from miles_nemo_gym.adapter import SESSION_KEY, ResponsesAdapter
from miles_nemo_gym.env import NemoGymError
from miles_nemo_gym.task import task_of

__all__ = ["run", "check_args"]


async def run(base_url: str, sample: Any, *, agent_url: str, adapter_port: int, adapter_host: str = "127.0.0.1",
              timeout_s: float = 600.0, label_field: str | None = None) -> float:
    """One rollout of the NeMo Gym agent server at ``agent_url`` through the Miles session at ``base_url``;
    returns the reward ``/run`` answers. ``timeout_s`` bounds the whole ``/run`` request."""
    check_args({"agent_url": agent_url, "adapter_port": adapter_port, "adapter_host": adapter_host,
                "timeout_s": timeout_s, "label_field": label_field})
    params, row = task_of(sample, label_field)
    shared = await _acquire(adapter_host, adapter_port)
    key = shared.adapter.register(base_url)
    try:
        params["metadata"] = {**(params.get("metadata") or {}), SESSION_KEY: key}
        url = f"{agent_url.rstrip('/')}/run"
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True),
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            try:
                async with http.post(url, json={**row, "responses_create_params": params}) as answer:
                    status, text = answer.status, await answer.text()
            except asyncio.TimeoutError:
                raise NemoGymError(f"POST {url} did not answer within {timeout_s:g} s (timeout_s)") from None
            except aiohttp.ClientError as exc:
                raise NemoGymError(f"POST {url} failed: the agent server is unreachable or broke the connection "
                                   f"({type(exc).__name__}: {exc})") from exc
    finally:
        shared.adapter.unregister(key)
        await _release(shared)
    if status >= 400:
        raise NemoGymError(f"POST {url} answered {status}: {text[:1000]}")
    try:
        verdict = json.loads(text)
    except json.JSONDecodeError:
        verdict = None
    reward = verdict.get("reward") if isinstance(verdict, dict) else None
    if not isinstance(reward, (int, float)) or isinstance(reward, bool):
        raise NemoGymError(f"POST {url} answered without a numeric 'reward': {text[:300]}")
    sample.metadata["nemo_gym"] = {k: v for k, v in verdict.items() if k != "reward" and k not in row
                                   and isinstance(v, (int, float, str, bool))}
    return float(reward)


def check_args(args: dict[str, Any]) -> None:
    """Validation of the agent's arguments (a ValueError names the argument)."""
    agent_url = args.get("agent_url")
    if not isinstance(agent_url, str) or not re.match(r"^https?://[^/\s]+", agent_url):
        raise ValueError(f"agent_url: expected the NeMo Gym agent server's URL, e.g. http://127.0.0.1:8002, "
                         f"got {agent_url!r}")
    port = args.get("adapter_port")
    if not (isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535):
        raise ValueError(f"adapter_port: expected the port the agent server's model_server points at "
                         f"(1-65535), got {port!r}")
    if not isinstance(args.get("adapter_host", "127.0.0.1"), str):
        raise ValueError(f"adapter_host: expected a host name or address, got {args['adapter_host']!r}")
    timeout_s = args.get("timeout_s", 1)
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    label_field = args.get("label_field")
    if label_field is not None and not (isinstance(label_field, str) and label_field):
        raise ValueError(f"label_field: expected the name of a row field (or null), got {label_field!r}")


run.check_args = check_args  # type: ignore[attr-defined]  # for a config check that looks for it


@dataclass
class _Shared:
    adapter: ResponsesAdapter
    started: asyncio.Future
    users: int = 0


_ADAPTERS: dict[tuple[asyncio.AbstractEventLoop, str, int], _Shared] = {}


async def _acquire(host: str, port: int) -> _Shared:
    """The adapter listening on ``host:port`` in this event loop, started by the first sample that needs it."""
    key = (asyncio.get_running_loop(), host, port)
    shared = _ADAPTERS.get(key)
    if shared is None:
        adapter = ResponsesAdapter()
        shared = _ADAPTERS[key] = _Shared(adapter, asyncio.ensure_future(adapter.start(host, port)))
    shared.users += 1
    try:
        await asyncio.shield(shared.started)
    except OSError as exc:
        await _release(shared)
        raise NemoGymError(f"the Responses adapter cannot listen on {host}:{port} (adapter_host, adapter_port): "
                           f"{exc}") from exc
    except BaseException:
        await _release(shared)
        raise
    return shared


async def _release(shared: _Shared) -> None:
    """One sample less; the last one stops the adapter."""
    shared.users -= 1
    if shared.users == 0:
        for key, value in list(_ADAPTERS.items()):
            if value is shared:
                del _ADAPTERS[key]
        with contextlib.suppress(Exception):  # one that failed to start failed its samples already
            await shared.started
        await shared.adapter.stop()
