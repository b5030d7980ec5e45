"""``miles view RUN_DIR``: the trajectory viewer (:mod:`miles.run.viewer`) over HTTP, on this machine by default.

Each page is made at its request from the files as they are then, so a run still being written shows its new
steps on reload. Besides the pages, the server gives out only the image files that the run's trajectories name
(``image?path=``, the path exactly as a file holds it); any other path is 404. Bound to a loopback address, it
answers only requests addressed to a loopback name (a web page elsewhere cannot read it by rebinding its name).
"""

from __future__ import annotations

import mimetypes
import re
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

from miles.errors import ConfigError
from miles.run.viewer import RunTrajectories, index_page, step_page

__all__ = ["serve", "image_url"]

_STEP_PAGE = re.compile(r"/step_(\d+)\.html")
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def image_url(ref: str) -> str:
    """Where a served page finds an image: a data URL is its own, a file comes from the server."""
    return ref if ref.startswith("data:") else "image?path=" + quote(ref, safe="")


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
        try:
            if url.path in ("/", "/index.html"):
                body = index_page(self.trajectories, live=True)
            elif (match := _STEP_PAGE.fullmatch(url.path)) and int(match[1]) in self.trajectories.steps():
                body = step_page(self.trajectories, int(match[1]), image_url)
            elif url.path == "/image":
                return self._image(parse_qs(url.query).get("path", [""])[0])
            else:
                return self._send(HTTPStatus.NOT_FOUND, b"not found\n")
        except (OSError, ValueError) as exc:  # a file removed or rewritten meanwhile, a line that is not JSON
            return self._send(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}\n".encode())
        self._send(HTTPStatus.OK, body.encode("utf-8"), "text/html; charset=utf-8")

    def _image(self, ref: str) -> None:
        if not ref or ref not in self.trajectories.image_paths():
            return self._send(HTTPStatus.NOT_FOUND, b"not an image this run's trajectories name\n")
        path = Path(ref.removeprefix("file://"))
        try:
            content = path.read_bytes()
        except OSError:
            return self._send(HTTPStatus.NOT_FOUND, b"the image file is gone\n")
        kind = mimetypes.guess_type(path.name)[0] or ""
        self._send(HTTPStatus.OK, content, kind if kind.startswith("image/") else "application/octet-stream")


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
