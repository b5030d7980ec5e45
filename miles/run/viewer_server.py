"""``miles view RUN_DIR``: the trajectory viewer (:mod:`miles.run.viewer`) over HTTP, on this machine by default.

Each page is made at its request from the files as they are then, so a run still being written shows its new
steps on reload. Besides the pages, the server gives out only image files inside the run directory
(``image?path=``, relative to it; :func:`miles.run.viewer.run_image` decides at each request, symlinks followed):
any other path is 404, the same answer whether or not such a file exists. Bound to a loopback address, it answers
only requests addressed to a loopback name (a web page elsewhere cannot read it by rebinding its name).
"""

from __future__ import annotations

import re
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

from miles.errors import ConfigError
from miles.run.viewer import ImageRefused, RunTrajectories, index_page, run_image, step_file, step_page

__all__ = ["serve"]

_STEP_PAGE = re.compile(r"/step_(\d{1,12})(?:_page(\d{1,12}))?\.html")
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def _host_name(header: str) -> str:
    """The name in a Host header, without the port (``[::1]:8000`` -> ``::1``)."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class _Handler(BaseHTTPRequestHandler):
    trajectories: RunTrajectories
    loopback: bool
    server_version = "miles-view"

    def log_message(self, format: str, *args: object) -> None:  # quiet: the terminal shows the URL only
        pass

    def _send(self, status: HTTPStatus, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.loopback and _host_name(self.headers.get("Host", "")).lower() not in _LOOPBACK_NAMES:
            return self._send(HTTPStatus.FORBIDDEN, b"miles view answers requests to a loopback name only\n")
        url = urlsplit(self.path)
        body: str | None = None
        try:
            if url.path in ("/", "/index.html"):
                body = index_page(self.trajectories, live=True)
            elif match := _STEP_PAGE.fullmatch(url.path):
                step, page = int(match[1]), int(match[2] or 1)
                if url.path[1:] == step_file(step, page):  # one name per page
                    body = step_page(self.trajectories, step, page, self._image_src)
            elif url.path == "/image":
                return self._image(parse_qs(url.query).get("path", [""])[0])
        except OSError as exc:  # a step file this user may not read or that went away meanwhile: named
            return self._send(HTTPStatus.INTERNAL_SERVER_ERROR, f"{exc}\n".encode())
        if body is None:
            return self._send(HTTPStatus.NOT_FOUND, b"not found\n")
        self._send(HTTPStatus.OK, body.encode("utf-8"), "text/html; charset=utf-8")

    def _image_src(self, path: Path, kind: str) -> str:
        """Where a served page finds an image file of the run: here, by its path in the run directory."""
        return "image?path=" + quote(path.relative_to(self.trajectories.root).as_posix(), safe="")

    def _image(self, name: str) -> None:
        try:
            path, kind = run_image(self.trajectories.root, name)
            content = path.read_bytes()
        except (ImageRefused, OSError):  # one answer for every refusal: it tells nothing of the files outside
            return self._send(HTTPStatus.NOT_FOUND, b"not an image file of this run\n")
        self._send(HTTPStatus.OK, content, kind)


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 0) -> None:
    """Serve ``run_dir``'s trajectories until Ctrl-C; prints the URL (``port`` 0: a free port)."""
    trajectories = RunTrajectories(run_dir, "miles view")
    handler = type("Handler", (_Handler,), {"trajectories": trajectories, "loopback": host in _LOOPBACK_NAMES})
    server_class = type("Server", (ThreadingHTTPServer,), {
        "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET, "daemon_threads": True})
    try:
        server = server_class((host, port), handler)
    except (OSError, OverflowError) as exc:  # the address is taken or not this machine's, a port out of range
        raise ConfigError(f"miles view: --host {host} --port {port}: cannot listen there: {exc}") from exc
    shown = f"[{host}]" if ":" in host else host
    print(f"miles view: {len(trajectories.steps())} step(s) of {trajectories.run_dir} at "
          f"http://{shown}:{server.server_address[1]}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
