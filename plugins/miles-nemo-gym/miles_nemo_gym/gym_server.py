"""Serve one NeMo Gym server (a resources server, an agent server, a model server) from the installed ``nemo-gym``
package. This file runs INSIDE the NeMo Gym venv (Python >= 3.12), by path: it imports ``nemo_gym`` and the
standard library only, never Miles.

    python gym_server.py resources_servers/example_session_state_mgmt [--host 127.0.0.1] [--port 0]
    python gym_server.py responses_api_agents/simple_agent --ref resources_server=http://127.0.0.1:8001 \\
        --ref model_server=http://127.0.0.1:8002 --set max_steps=8

It does what ``ng_run`` does for each of its servers, without the head server and the Ray cluster: it writes
NeMo Gym's global config (this server's entry, and one entry per ``--ref`` naming the server another URL
stands for) into the environment variables NeMo Gym's own child servers read it from, builds the server class
of ``<kind>/<type>/app.py`` with its config, and runs its FastAPI app with uvicorn. The socket is bound before
anything else, so ``--port 0`` takes a free port; once it listens, the first line on stdout is
``{"url": "http://host:port"}`` and every later output goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pathlib
import socket
import sys
import typing

KINDS = ("resources_servers", "responses_api_agents", "responses_api_models")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("server",
                        help="<kind>/<type> in the nemo-gym package, e.g. resources_servers/example_multi_step")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--name", default=None, help="the server's instance name (default: its type)")
    parser.add_argument("--entrypoint", default="app.py")
    parser.add_argument("--ref", action="append", default=[], metavar="FIELD=URL",
                        help="a config field that names another server (e.g. model_server), served at URL")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="another config field of the server, its value as JSON (or a plain string)")
    return parser.parse_args(argv)


def _split(item: str, option: str) -> tuple[str, str]:
    field, sep, value = item.partition("=")
    if not sep or not field:
        raise SystemExit(f"{option} {item!r}: expected FIELD=VALUE")
    return field, value


def _import_app(kind: str, server_type: str, entrypoint: str) -> typing.Any:
    """The module of ``<kind>/<type>/<entrypoint>`` in the nemo-gym package; exits naming the servers there when
    there is no such server."""
    module_name = f"{kind}.{server_type}.{entrypoint.removesuffix('.py')}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not module_name.startswith(str(exc.name)):
            raise  # the server itself imports something that is missing
    known = sorted(p.name for path in importlib.import_module(kind).__path__ for p in pathlib.Path(path).iterdir()
                   if (p / entrypoint).is_file())
    raise SystemExit(f"{kind}/{server_type}: no such server in nemo-gym; its {kind}: {', '.join(known)}")


def _server_class(module: typing.Any) -> type:
    """The concrete server class ``module`` defines (NeMo Gym's ``app.py`` files define exactly one)."""
    from nemo_gym.server_utils import SimpleServer

    found = [obj for obj in vars(module).values()
             if inspect.isclass(obj) and issubclass(obj, SimpleServer) and obj.__module__ == module.__name__
             and not inspect.isabstract(obj)]
    if len(found) != 1:
        raise SystemExit(f"{module.__name__}: expected one server class, found {[c.__name__ for c in found]}")
    return found[0]


def _ref_kind(config_cls: type, field: str) -> str:
    """The server kind a reference field of the config names (``ModelServerRef`` -> ``responses_api_models``)."""
    info = config_cls.model_fields.get(field)
    if info is None:
        raise SystemExit(f"--ref {field}: {config_cls.__name__} has no such field; "
                         f"its fields: {', '.join(config_cls.model_fields)}")
    type_field = getattr(info.annotation, "model_fields", {}).get("type")
    kinds = typing.get_args(type_field.annotation) if type_field is not None else ()
    if len(kinds) != 1 or kinds[0] not in KINDS:
        raise SystemExit(f"--ref {field}: this field does not name another server")
    return kinds[0]


def _global_config(args: argparse.Namespace, kind: str, server_type: str, config_cls: type, host: str,
                   port: int) -> dict[str, typing.Any]:
    from urllib.parse import urlsplit

    own: dict[str, typing.Any] = {"host": host, "port": port, "entrypoint": args.entrypoint}
    config: dict[str, typing.Any] = {"head_server": {"host": "127.0.0.1", "port": 0}}
    for item in args.set:
        field, value = _split(item, "--set")
        try:
            own[field] = json.loads(value)
        except json.JSONDecodeError:
            own[field] = value
    for item in args.ref:
        field, url = _split(item, "--ref")
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise SystemExit(f"--ref {field}={url}: expected http://host:port")
        ref_kind, name = _ref_kind(config_cls, field), f"miles_{field}"
        own[field] = {"type": ref_kind, "name": name}
        config[name] = {ref_kind: {"remote": {"host": parts.hostname, "port": parts.port, "entrypoint": "-"}}}
    config[args.name or server_type] = {kind: {server_type: own}}
    return config


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    kind, _, server_type = args.server.strip("/").partition("/")
    if kind not in KINDS or not server_type or "/" in server_type:
        raise SystemExit(f"{args.server!r}: expected <kind>/<type> with kind one of {', '.join(KINDS)}")
    module = _import_app(kind, server_type, args.entrypoint)
    server_cls = _server_class(module)
    config_cls = server_cls.model_fields["config"].annotation

    listener = socket.create_server((args.host, args.port))
    host, port = args.host, listener.getsockname()[1]
    global_config = _global_config(args, kind, server_type, config_cls, host, port)
    # Where NeMo Gym's child servers find their config: the whole dict, and this server's name in it.
    from nemo_gym.global_config import NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME, NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME

    os.environ[NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME] = json.dumps(global_config)
    os.environ[NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME] = args.name or server_type

    import uvicorn
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.global_config import get_global_config_dict
    from nemo_gym.server_utils import ServerClient

    client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=0),
                          global_config_dict=get_global_config_dict())
    server = server_cls(config=server_cls.load_config_from_global_config(), server_client=client)
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.setup_exception_middleware(app)

    print(json.dumps({"url": f"http://{host}:{port}"}), flush=True)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nobody reads stdout from here on
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1, timeout_keep_alive=30)
    uvicorn.Server(config).run(sockets=[listener])


if __name__ == "__main__":
    main()
