"""Ray for Miles: a local instance started on demand (on 127.0.0.1, capped object store, temp folder
under the run directory), or an existing cluster joined with ``cluster.address``; shut down at exit.

Nothing of a local instance outlives its run: a reaper (:mod:`miles._ray_reaper`) kills what is left of it
when the run ends, however it ends; temp folders that runs SIGKILLed together with their reaper left under
/tmp are removed when the next run starts Ray."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from miles.errors import RunError

__all__ = ["RayCluster", "describe_capacity", "describe_nodes", "dead_node"]

_LOCAL_AMOUNT = 10_000.0  # of each custom resource on a local instance: more than any run reserves
# Ray's unix socket lies under its temp folder at session_<date>_<time>_<microseconds>_<pid>/sockets/plasma_store,
# 64 characters with the longest pid (7 digits), and AF_UNIX paths hold 107 bytes.
_RAY_SOCKET = "/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store"
_SHORT_TEMP = "/tmp/miles-ray-"  # + 10 hex digits: where the temp folder goes when the run directory is too deep


class RayCluster:
    def __init__(self, cfg: Any, run_dir: Path, num_cpus: int | None = None) -> None:
        """Join ``cfg.address``, or start a local instance that offers the custom resources the config
        places engines and training workers by (``cluster.engine_resources``/``train_resources``), in plenty:
        on one machine every node label is this machine."""
        import ray

        self.ray = ray
        self.address = cfg.address
        self.started_here = False
        self._reaper: subprocess.Popen | None = None
        if ray.is_initialized():
            return
        sigterm = signal.getsignal(signal.SIGTERM)
        kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": "WARNING", "log_to_driver": True}
        if self.address:
            host = self.address.removeprefix("ray://").rsplit(":", 1)[0]
            if host in ("127.0.0.1", "localhost"):
                kwargs["_node_ip_address"] = "127.0.0.1"  # a cluster on this machine's loopback
            try:
                ray.init(address=self.address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise RunError(f"cluster.address: cannot join the Ray cluster at {self.address!r}: {exc}") from exc
        else:
            temp_dir = self.temp_dir_for(run_dir)
            self._reaper = _start_reaper(temp_dir)  # first: it names the folder, which keeps it from the sweep
            try:
                _remove_abandoned_temp_dirs()
                temp_dir.mkdir(parents=True, exist_ok=True)
                os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
                # Ray starts its workers at nice 15, and the engines and training workers are its workers: beside
                # any process at nice 0 (the driver, sandboxes, a compile) they got a few percent of a core
                os.environ.setdefault("RAY_worker_niceness", "0")
                custom = {name: _LOCAL_AMOUNT for name in {**(cfg.get("engine_resources") or {}),
                                                             **(cfg.get("train_resources") or {})}}
                ray.init(num_cpus=num_cpus or cfg.num_cpus or os.cpu_count(),
                         object_store_memory=cfg.object_store_mb * 2**20, _temp_dir=str(temp_dir),
                         _node_ip_address="127.0.0.1", resources=custom or None, **kwargs)
            except BaseException:
                self._stop_reaper()
                raise
        self.started_here = True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, sigterm)  # ray.init installs its own, which exits without our clean-up

    MAX_TEMP_DIR = 107 - len(_RAY_SOCKET)  # characters

    @staticmethod
    def temp_dir_for(run_dir: Path) -> Path:
        """``<run_dir>/ray``, or a short folder under /tmp when that path is too long for Ray's sockets."""
        temp_dir = (run_dir / "ray").resolve()
        if len(str(temp_dir).encode()) > RayCluster.MAX_TEMP_DIR:
            temp_dir = Path(f"{_SHORT_TEMP}{hashlib.sha1(str(temp_dir).encode()).hexdigest()[:10]}")
        return temp_dir

    @property
    def multi_node(self) -> bool:
        return bool(self.address)

    def shutdown(self) -> None:
        if self.started_here and self.ray.is_initialized():
            self.ray.shutdown()
        self._stop_reaper()

    def _stop_reaper(self) -> None:
        if self._reaper is not None:  # it kills what is left, removes a folder under /tmp, and exits
            self._reaper.stdin.close()
            self._reaper.wait()
            self._reaper = None


def _start_reaper(temp_dir: Path) -> subprocess.Popen:
    """The reaper of the instance about to start in ``temp_dir`` (see :mod:`miles._ray_reaper`): started first,
    so that a run killed while Ray starts leaves nothing either."""
    from miles import _ray_reaper

    remove = ["--remove"] if str(temp_dir).startswith(_SHORT_TEMP) else []
    return subprocess.Popen([sys.executable, "-I", _ray_reaper.__file__, str(temp_dir), *remove],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _remove_abandoned_temp_dirs() -> None:
    """Temp folders under /tmp that no process uses: left by runs killed together with their reaper."""
    from miles._ray_reaper import unused

    folders = [str(f) for f in Path(_SHORT_TEMP).parent.glob(Path(_SHORT_TEMP).name + "*") if f.is_dir()]
    for folder in unused(folders):
        shutil.rmtree(folder, ignore_errors=True)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def describe_capacity(ray: Any, bundle: dict[str, float]) -> str:
    """What the cluster has of each resource in ``bundle``: in all, free now, and per live node."""
    total, free = ray.cluster_resources(), ray.available_resources()
    nodes = [f"{n['NodeManagerAddress']} ({n['NodeID'][:8]}): "
             + ", ".join(f"{k}={n['Resources'].get(k, 0):g}" for k in bundle)
             for n in ray.nodes() if n.get("Alive")]
    return (f"the cluster has {', '.join(f'{k}={total.get(k, 0):g} (free {free.get(k, 0):g})' for k in bundle)}; "
            f"live nodes: {'; '.join(nodes) or 'none'}")


def describe_nodes(ray: Any, node_ids: list[str]) -> str:
    """``<address> (<id>)`` of each node, in order (the engines' placement, printed at start)."""
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return ", ".join(f"{address.get(node, '?')} ({node[:8]})" for node in node_ids)


def dead_node(ray: Any, node_id: str) -> str | None:
    """``"<address> (<id>)"`` when Ray knows node ``node_id`` as dead, else None."""
    for node in ray.nodes():
        if node["NodeID"] == node_id and not node.get("Alive"):
            return f"{node['NodeManagerAddress']} ({node_id[:8]})"
    return None
