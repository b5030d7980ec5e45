"""The ``nemo_gym`` environment: a NeMo Gym resources server, driven over HTTP, as a Miles env.

    rollout:
      fn: {name: multi_turn, max_turns: 8}
      env: {name: nemo_gym, base_url: "http://127.0.0.1:8001"}
    data: {prompt_key: responses_create_params}
    reward: {name: env}

Per trajectory, as NeMo Gym's own agents do: ``POST /seed_session`` with the task (the sample's
``responses_create_params`` and the row's other fields, see :mod:`miles_nemo_gym.task`), keeping the session
cookie the server sets for every later request of this trajectory only; each valid tool call is ``POST
/<tool name>`` with the call's arguments, the answer's body the tool message; when the model answers without a
tool call (or after ``max_steps`` turns) ``POST /verify`` with the task and the episode as a Response, whose
``reward`` ends the trajectory.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp

from miles import Action, EnvContext, StepResult, ToolResult
from miles_nemo_gym.responses import (
    ResponsesError, assistant_items, input_to_messages, make_response, tools_to_chat, tools_to_responses,
)
from miles_nemo_gym.task import task_of

__all__ = ["NemoGymEnv", "NemoGymError", "tools_from_openapi"]

RESERVED = frozenset({"seed_session", "verify", "aggregate_metrics", "mcp", "openapi.json", "docs"})
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class NemoGymError(RuntimeError):
    """The resources server failed a request (unreachable, or an answer that is not what NeMo Gym promises)."""


class NemoGymEnv:
    """Registered as env ``nemo_gym``; see the module's docstring.

    ``base_url``: the resources server (``http://host:port``). ``tools``: where the tools offered to the model
    come from: ``row`` (default: the sample's ``responses_create_params.tools``, as NeMo Gym datasets carry
    them), ``openapi`` (every endpoint of the server's ``/openapi.json`` but NeMo Gym's own, with its request
    body's schema), or a list of function schemas (Responses or chat shape) for every sample. ``max_steps``:
    verify after this many turns even when the last one called tools (default: the rollout's ``max_turns``,
    so that the last turn is verified). ``timeout_s``: per request.
    ``label_field``: the row field that ``data.label_key`` took out of the row (it goes back into /verify).
    """

    def __init__(self, ctx: EnvContext, base_url: str, tools: str | list[dict[str, Any]] = "row",
                 max_steps: int | None = None, timeout_s: float = 300.0, label_field: str | None = None) -> None:
        self.check_args({"base_url": base_url, "tools": tools, "max_steps": max_steps, "timeout_s": timeout_s,
                         "label_field": label_field})
        self.base_url, self.tool_source = base_url.rstrip("/"), tools
        self.max_steps, self.timeout_s, self.label_field = max_steps, float(timeout_s), label_field
        self.ctx_max_turns = ctx.max_turns
        self.tools: list[dict[str, Any]] = []
        self._http: aiohttp.ClientSession | None = None
        self._params: dict[str, Any] = {}
        self._row: dict[str, Any] = {}
        self._output: list[dict[str, Any]] = []  # the episode as Response output items, for /verify
        self._steps = 0

    @staticmethod
    def check_args(args: dict[str, Any]) -> None:
        """Config validation (a ValueError names the argument)."""
        base_url = args.get("base_url")
        if not isinstance(base_url, str) or not re.match(r"^https?://[^/\s]+", base_url):
            raise ValueError(f"base_url: expected the resources server's URL, e.g. http://127.0.0.1:8001, "
                             f"got {base_url!r}")
        tools = args.get("tools", "row")
        if isinstance(tools, (list, tuple)):
            try:
                tools_to_chat(list(tools))
            except ResponsesError as exc:
                raise ValueError(str(exc)) from None
        elif tools not in ("row", "openapi"):
            raise ValueError(f"tools: expected 'row', 'openapi' or a list of function schemas, got {tools!r}")
        max_steps = args.get("max_steps")
        if max_steps is not None and not (isinstance(max_steps, int) and not isinstance(max_steps, bool)
                                          and max_steps >= 1):
            raise ValueError(f"max_steps: expected an integer >= 1 (or null), got {max_steps!r}")
        timeout_s = args.get("timeout_s", 1)
        if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > 0):
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        label_field = args.get("label_field")
        if label_field is not None and not (isinstance(label_field, str) and label_field):
            raise ValueError(f"label_field: expected the name of a row field (or null), got {label_field!r}")

    # -- the episode ------------------------------------------------------------------------------------

    async def reset(self, sample: Any) -> list[dict[str, Any]]:
        self._params, self._row = task_of(sample, self.label_field)
        messages = input_to_messages(self._params["input"], self._params.get("instructions"))
        self._http = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True),  # cookies of 127.0.0.1 too
                                           timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        self.tools = await self._tools()
        if self.tool_source != "row":  # what the model is offered is what /verify is told it was offered
            self._params["tools"] = tools_to_responses(self.tools)
        await self._post("seed_session", {**self._row, "responses_create_params": self._params}, required=True)
        return messages

    async def step(self, action: Action) -> StepResult:
        self._steps += 1
        calls = [{"id": f"call_{self._steps}_{i}", "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(action.tool_calls)]
        self._output += assistant_items({"content": "" if calls else action.text, "tool_calls": calls})
        if not action.tool_calls:
            return await self._verify()
        messages, results = [], []
        for call, item in zip(action.tool_calls, calls):
            result = await self._call_tool(call.name, call.arguments)
            results.append(result)
            messages.append({"role": "tool", "name": call.name, "tool_call_id": call.id, "content": result.content})
            self._output.append({"type": "function_call_output", "call_id": item["id"], "output": result.content})
        limit = self.max_steps if self.max_steps is not None else self.ctx_max_turns
        if limit is not None and self._steps >= limit:
            verified = await self._verify()
            verified.info["tool_results"] = results
            return verified
        return StepResult(observation=messages, info={"tool_results": results})

    async def close(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.close()

    # -- requests -------------------------------------------------------------------------------------

    async def _tools(self) -> list[dict[str, Any]]:
        if isinstance(self.tool_source, (list, tuple)):
            tools = tools_to_chat(list(self.tool_source))
        elif self.tool_source == "openapi":
            tools = tools_from_openapi(await self._get_json("openapi.json"))
        else:
            tools = tools_to_chat(self._params.get("tools"), "responses_create_params.tools")
        for tool in tools:
            name = tool["function"]["name"]
            if name in RESERVED or not _TOOL_NAME.match(name):
                raise ResponsesError(f"tool {name!r}: not a name a resources server endpoint can have (letters, "
                                     f"digits, _ . -; not one of NeMo Gym's own: {', '.join(sorted(RESERVED))})")
        return tools

    async def _call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        try:
            status, text = await self._post(name, arguments)
        except asyncio.TimeoutError:
            return ToolResult(f"error: the tool call timed out after {self.timeout_s:g} s", ok=False, timed_out=True)
        return ToolResult(text, ok=status < 400)

    async def _verify(self) -> StepResult:
        response = make_response(self._params, self._output)
        body = {**self._row, "responses_create_params": self._params, "response": response}
        _, text = await self._post("verify", body, required=True)
        verdict = _json(text, f"{self.base_url}/verify")
        reward = verdict.get("reward") if isinstance(verdict, dict) else None
        if not isinstance(reward, (int, float)) or isinstance(reward, bool):
            raise NemoGymError(f"POST {self.base_url}/verify answered without a numeric 'reward': {text[:300]}")
        scalars = {k: v for k, v in verdict.items()
                   if k != "reward" and isinstance(v, (int, float, str, bool)) and k not in self._row}
        return StepResult(reward=float(reward), done=True, info={"verify": scalars})

    async def _post(self, endpoint: str, body: Any, *, required: bool = False) -> tuple[int, str]:
        """POST ``body`` to ``endpoint`` with this trajectory's cookies: (status, text). A failure to reach the
        server raises; so does an error status when ``required`` (a tool's error status is its answer)."""
        url = f"{self.base_url}/{endpoint}"
        if self._http is None:
            raise NemoGymError(f"POST {url}: the environment is closed (or was never reset)")
        try:
            async with self._http.post(url, json=body) as answer:
                status, text = answer.status, await answer.text()
        except aiohttp.ClientError as exc:
            raise NemoGymError(f"POST {url} failed: the resources server is unreachable or broke the connection "
                               f"({type(exc).__name__}: {exc})") from exc
        if required and status >= 400:
            raise NemoGymError(f"POST {url} answered {status}: {text[:500]}")
        return status, text

    async def _get_json(self, endpoint: str) -> Any:
        url = f"{self.base_url}/{endpoint}"
        try:
            async with self._http.get(url) as answer:
                status, text = answer.status, await answer.text()
        except aiohttp.ClientError as exc:
            raise NemoGymError(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc
        if status >= 400:
            raise NemoGymError(f"GET {url} answered {status}: {text[:300]}")
        return _json(text, url)


def tools_from_openapi(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat tools for a resources server's endpoints from its OpenAPI spec: every POST but NeMo Gym's own
    (``seed_session``, ``verify``, ...), its parameters the request body's schema (``$ref``\\ s resolved), its
    description the endpoint's docstring (or summary)."""
    components = spec.get("components", {}).get("schemas", {})

    def resolve(node: Any, depth: int = 0) -> Any:
        if depth > 32:
            raise ResponsesError("openapi.json: schemas nest deeper than 32 levels (a recursive model?)")
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
                return resolve(components[ref.rsplit("/", 1)[1]], depth + 1)
            return {k: resolve(v, depth + 1) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v, depth + 1) for v in node]
        return node

    tools = []
    for path, operations in spec.get("paths", {}).items():
        name, post = path.strip("/"), operations.get("post")
        if post is None or name in RESERVED or not _TOOL_NAME.match(name):
            continue
        body = post.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        parameters = resolve(body) if body else {"type": "object", "properties": {}}
        tools.append({"type": "function", "function": {
            "name": name, "description": post.get("description") or post.get("summary") or "",
            "parameters": parameters}})
    return tools


def _json(text: str, url: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise NemoGymError(f"{url} answered with something that is not JSON ({exc}): {text[:300]}") from exc
