"""``miles router serve``: its flags, each checked when it is parsed (exit 2 naming the flag), and the command."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from miles.errors import ConfigError

__all__ = ["add_router_commands"]


def add_router_commands(sub: Any) -> None:
    """The ``router`` command and its ``serve`` subcommand, under the CLI's subparsers ``sub``."""
    router = sub.add_parser("router", help="the router in front of engines")
    router_sub = router.add_subparsers(dest="router_command", required=True)
    rserve = router_sub.add_parser("serve", help="serve one address in front of N SGLang-compatible engines")
    rserve.add_argument("--engine", action="append", required=True, type=_engine_url,
                        help="an engine URL (repeat for each)")
    rserve.add_argument("--host", default="127.0.0.1")
    rserve.add_argument("--port", type=_number(1, integer=True, high=65535), default=30100)
    rserve.add_argument("--health-interval-s", type=_number(0, above=True), default=1.0,
                        help="seconds between two health checks of an engine")
    rserve.add_argument("--max-failures", type=_number(1, integer=True), default=3,
                        help="failed health checks in a row that take an engine out of service")
    rserve.add_argument("--max-retries", type=_number(0, integer=True), default=3,
                        help="how many times a request whose engine failed is sent again (to an engine in service)")
    rserve.add_argument("--request-timeout-s", type=_number(0, above=True), default=600.0,
                        help="deadline of one request, retries and waiting for an engine included (503 after it)")
    rserve.add_argument("--no-engine-wait-s", type=_number(0), default=5.0,
                        help="once every engine has failed, how long after the last failure a request waits for one "
                             "to answer its health check again before it is answered 503 (0: at once)")
    rserve.add_argument("--admin-token", default="",
                        help="required on /abort_request and /flush_cache, and to serve beyond loopback; also sent "
                             "to the engines (default: MILES_ADMIN_TOKEN)")
    rserve.add_argument("--max-request-mib", type=_number(0, above=True), default=16.0,
                        help="body size limit of a request (MiB)")
    rserve.add_argument("--allowed-host", action="append", default=[], metavar="NAME[:PORT]",
                        help="another name clients reach the router by, accepted in the Host header (repeat; '*': any)")
    rserve.set_defaults(func=_cmd_router_serve)


def _cmd_router_serve(args: argparse.Namespace) -> int:
    from miles.engine.router_server import serve_router

    token = args.admin_token or os.environ.get("MILES_ADMIN_TOKEN", "")
    try:
        serve_router(args.engine, host=args.host, port=args.port, admin_token=token,
                     max_request_bytes=int(args.max_request_mib * 2**20), allowed_hosts=tuple(args.allowed_host),
                     health_interval_s=args.health_interval_s, max_failures=args.max_failures,
                     max_retries=args.max_retries, request_timeout_s=args.request_timeout_s,
                     no_engine_wait_s=args.no_engine_wait_s)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    except OSError as exc:  # the address is taken, or not this machine's
        raise ConfigError(f"--host {args.host} --port {args.port}: cannot listen there: {exc}") from exc
    return 0


def _number(low: float, *, above: bool = False, integer: bool = False, high: float = math.inf):
    """An argparse type: a finite number at least ``low`` (above it with ``above``), at most ``high``."""
    expected = f"{'an integer' if integer else 'a number'} {'above' if above else 'at least'} {low:g}"
    if high < math.inf:
        expected += f" and at most {high:g}"

    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def _engine_url(text: str) -> str:
    """An argparse type: an engine's base URL."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018  (a port that is not a number raises)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and not (parts.query or parts.fragment)
    except ValueError:
        valid = False
    if not valid:
        raise argparse.ArgumentTypeError(f"expected an engine's URL such as http://127.0.0.1:30000, got {text!r}")
    return text
