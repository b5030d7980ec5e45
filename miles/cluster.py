"""Ray for Miles: a local instance started on demand (capped object store, temp folder under the
run directory), or an existing cluster joined with ``cluster.address``; shut down at exit."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

__all__ = ["RayCluster"]

_MAX_TEMP_DIR = 60  # Ray puts unix sockets under the temp dir; their paths must stay short


class RayCluster:
    def __init__(self, cfg: Any, run_dir: Path) -> None:
        import ray

        self.ray = ray
        self.address = cfg.address
        self.started_here = False
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": "WARNING", "log_to_driver": True}
        if self.address:
            ray.init(address=self.address, **kwargs)
        else:
            temp_dir = (run_dir / "ray").resolve()
            if len(str(temp_dir)) > _MAX_TEMP_DIR:
                temp_dir = Path("/tmp") / f"miles-ray-{hashlib.sha1(str(temp_dir).encode()).hexdigest()[:10]}"
            temp_dir.mkdir(parents=True, exist_ok=True)
            os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
            ray.init(num_cpus=cfg.num_cpus or os.cpu_count(), object_store_memory=cfg.object_store_mb * 2**20,
                     _temp_dir=str(temp_dir), **kwargs)
        self.started_here = True

    @property
    def multi_node(self) -> bool:
        return bool(self.address)

    def shutdown(self) -> None:
        if self.started_here and self.ray.is_initialized():
            self.ray.shutdown()
