"""The worker process: one verifiers env, serving rollouts and scores to Miles over JSON lines.

    serve --spec JSON                 load the env, print {"ready": true}, then answer requests on stdin
    describe --spec JSON [--limit N]  print {"tasks": [...], "bounded": ...} (or {"error": ...}) and exit: the first
                                      N tasks; without a limit, all of a finite taskset, the first of an infinite one

Requests (one JSON object a line, answered in any order, each answer carrying the request's ``id``):

- ``{"id", "op": "rollout", "task", "base_url"}``: one episode of the task with the model behind ``base_url``
  (a Miles session); answers ``{"id", "result": {"reward", "rewards", "metrics", "turns", "stop", "trace_id"}}``;
- ``{"id", "op": "score", "task", "prompt", "reply"}``: the task's rewards for one reply (single-turn);
- ``{"op": "cancel", "id"}``: stop that request (its answer is an error);
- ``{"op": "shutdown"}`` or the end of stdin: stop everything and exit.

A failure answers ``{"id", "error": message}``. stdout carries only these lines: file descriptor 1 is pointed at
stderr, so nothing the env or its harness programs print can corrupt the protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, TextIO

import verifiers.v1 as vf

from miles_verifiers_worker import uv
from miles_verifiers_worker.envs import Tasks, describe, load_env, outcome, score_reply
from miles_verifiers_worker.relay import Relay

MODEL = "policy"  # the model name harnesses send; Miles' session server serves the run's policy whatever it is


def main() -> None:
    parser = argparse.ArgumentParser(prog="miles-verifiers worker")
    parser.add_argument("mode", choices=["serve", "describe"])
    parser.add_argument("--spec", required=True, help="JSON: env, env_args")
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    out = _protocol_stream()
    logging.basicConfig(level=os.environ.get("MILES_VERIFIERS_LOG", "WARNING"), stream=sys.stderr,
                        format="verifiers worker %(levelname)s %(name)s: %(message)s")
    spec = json.loads(args.spec)
    with tempfile.TemporaryDirectory(prefix="miles-verifiers-") as scratch:
        os.environ["PATH"] = f"{uv.install(Path(scratch))}{os.pathsep}{os.environ.get('PATH', '')}"
        if args.mode == "describe":
            _write(out, _describe(spec, args.limit))
        else:
            asyncio.run(Server(spec, out).serve())


def _protocol_stream() -> TextIO:
    """A private copy of stdout for the protocol; fd 1 (inherited by every child process) becomes stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _write(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _describe(spec: dict[str, Any], limit: int | None) -> dict[str, Any]:
    try:
        env = load_env(spec)
        bounded = env.taskset.bounded
        head = Tasks(env).head(limit if limit is not None or bounded else 1)
        return {"tasks": [describe(t) for t in head], "bounded": bounded}
    except Exception as exc:  # reported to Miles, which names the config argument
        logging.debug("describe failed", exc_info=True)
        return {"error": _failure(exc)}


class Server:
    """Requests from stdin, each in its own task, inside the env's ``serving()`` context."""

    def __init__(self, spec: dict[str, Any], out: TextIO) -> None:
        self.spec, self.out = spec, out
        self.relay = Relay()
        self.running: dict[Any, asyncio.Task] = {}

    async def serve(self) -> None:
        try:
            self.env = load_env(self.spec)
            self.tasks = Tasks(self.env)
            self.context = vf.ModelContext(model=MODEL, client=vf.EvalClientConfig(
                base_url=await self.relay.start(), api_key_var="MILES_VERIFIERS_API_KEY"))
            async with self.env.serving():
                _write(self.out, {"ready": True})
                await self._read_requests()
                for task in list(self.running.values()):
                    task.cancel()
                await asyncio.gather(*self.running.values(), return_exceptions=True)
        except Exception as exc:
            logging.debug("worker failed", exc_info=True)
            _write(self.out, {"error": _failure(exc)})
        finally:
            await self.relay.stop()

    async def _read_requests(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=64 << 20)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        try:
            while line := await reader.readline():
                request = json.loads(line)
                op = request.get("op")
                if op == "shutdown":
                    return
                if op == "cancel":
                    if (task := self.running.get(request.get("id"))) is not None:
                        task.cancel()
                    continue
                self.running[request["id"]] = asyncio.create_task(self._answer(request))
        finally:
            transport.close()

    async def _answer(self, request: dict[str, Any]) -> None:
        try:
            if request["op"] == "rollout":
                result = await self._rollout(request["task"], request["base_url"])
            elif request["op"] == "score":
                result = await score_reply(self.tasks.get(request["task"]), request["prompt"], request["reply"])
            else:
                raise ValueError(f"unknown op {request['op']!r}")
            _write(self.out, {"id": request["id"], "result": result})
        except asyncio.CancelledError:
            _write(self.out, {"id": request["id"], "error": "cancelled"})
        except Exception as exc:
            logging.debug("request %s failed:\n%s", request["id"], traceback.format_exc())
            _write(self.out, {"id": request["id"], "error": _failure(exc)})
        finally:
            self.running.pop(request["id"], None)

    async def _rollout(self, ref: int | str, base_url: str) -> dict[str, Any]:
        """One episode whose every trace talks to ``base_url`` through the relay."""
        task = self.tasks.get(ref)
        routed: list[str] = []

        def route(trace: Any) -> None:
            self.relay.routes[trace.id] = base_url.rstrip("/")
            routed.append(trace.id)

        try:
            episode = await self.env.run_episode(task, self.context, on_trace=route)
        finally:
            for trace_id in routed:
                self.relay.routes.pop(trace_id, None)
        return outcome(episode)

