"""A Harbor environment backed by a Miles sandbox: Harbor's own trials, agents and verifier, without Docker.

Harbor loads it by import path, in a trial or job config::

    environment:
      import_path: miles_harbor.harbor_environment:MilesSandboxEnvironment
      kwargs: {miles_python: /path/to/miles/.venv/bin/python, sandbox: {cpu_s: 60}}

``start`` opens a Miles local sandbox (bubblewrap) in a host process on ``miles_python`` (a Python with
Miles installed; Harbor's own needs none of it), with the task's folders, ``/logs``, ``/tests`` and
``/solution`` as its writable mounts, and does what the task's Dockerfile does (the subset of
:mod:`miles_harbor.dockerfile`). Harbor then runs its agent (e.g. ``oracle``) and its verifier through
``exec``, ``upload_*`` and ``download_*`` and reads the reward itself.

What differs from Docker: no network whatever the task's ``network_mode``; every command runs as one
user (``user`` is not honoured); ``/tmp`` is private to each command; only the mounts are writable.
"""

from __future__ import annotations

import asyncio
import io
import os
import shlex
import sys
import tarfile
import uuid
from pathlib import Path
from typing import Any

from pydantic import Field

from harbor.environments.base import BaseEnvironment, ExecResult, transfer_tar_filter
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.environments.options import EnvironmentOptions
from harbor.models.trial.paths import EnvironmentPaths
from miles_harbor.dockerfile import Build, DockerfileError, Tree, parse_dockerfile, tree_of
from miles_harbor.provision import provision, script, tail, write_tree
from miles_harbor.sandbox_client import SandboxClient

__all__ = ["MilesSandboxEnvironment", "MilesSandboxOptions"]


class MilesSandboxOptions(EnvironmentOptions):
    """The environment's kwargs (``--ek key=value`` or ``environment.kwargs``)."""

    miles_python: str | None = Field(
        default=None, description="A Python with Miles installed (default: $MILES_PYTHON, else Harbor's own).")
    sandbox: dict[str, Any] = Field(
        default_factory=dict, description="Options of Miles' local sandbox: cpu_s, memory_mb, file_mb, disk_mb, "
                                          "max_procs, output_bytes, workspace_root.")
    extra_mounts: list[str] = Field(
        default_factory=list, description="More writable folders for agents that install themselves elsewhere.")
    exec_timeout_sec: float = Field(
        default=3600.0, gt=0, description="The limit of a command Harbor runs without one of its own.")
    start_timeout_sec: float = Field(default=120.0, gt=0, description="How long the sandbox host may take to start.")


class MilesSandboxEnvironment(BaseEnvironment):
    options_model = MilesSandboxOptions
    options: MilesSandboxOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # validates the definition: parses the Dockerfile
        self._client: SandboxClient | None = None

    @staticmethod
    def type() -> str:
        return "miles-sandbox"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        dockerfile = self.environment_dir / "Dockerfile"
        if not dockerfile.is_file():
            raise FileNotFoundError(f"{dockerfile} not found: the Miles sandbox builds a task from its Dockerfile")
        try:
            self._build: Build = parse_dockerfile(dockerfile)
        except DockerfileError as exc:
            raise ValueError(f"{self.environment_name}: environment/{exc}") from None
        if self.task_env_config.workdir:
            self._build.workdir = self.task_env_config.workdir.rstrip("/")

    async def start(self, force_build: bool) -> None:
        paths = EnvironmentPaths()
        mounts = self._build.mounts(str(paths.logs_dir), str(paths.tests_dir), str(paths.solution_dir),
                                    *self.options.extra_mounts)
        options = {"isolation": "bwrap", **self.options.sandbox, "mounts": mounts, "cwd": self._build.workdir}
        python = self.options.miles_python or os.environ.get("MILES_PYTHON") or sys.executable
        self._client = await SandboxClient.start(python, options, timeout_s=self.options.start_timeout_sec)
        await provision(self._client, self._build, timeout_s=self.task_env_config.build_timeout_sec,
                        env=self._persistent_env)
        await write_tree(self._client, Tree(dirs=[str(paths.agent_dir), str(paths.verifier_dir),
                                                  str(paths.artifacts_dir)]))

    async def stop(self, delete: bool) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        timeout = timeout_sec or self.options.exec_timeout_sec
        result = await self._sandbox.run(
            script(command, dockerfile_env=self._build.env, env=self._merge_env(env), cwd=cwd), timeout_s=timeout)
        if result.timed_out:
            raise RuntimeError(f"Command timed out after {timeout} seconds")
        return ExecResult(stdout=result.stdout, stderr=result.stderr, return_code=result.exit_code)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        tree = Tree()
        tree.add_file(Path(source_path), target_path)
        await write_tree(self._sandbox, tree)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await write_tree(self._sandbox, tree_of(Path(source_dir), target_dir.rstrip("/") or "/"))

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._sandbox.read_file(source_path)
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        Path(target_path).write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """The folder's contents, packed by tar in the sandbox's workspace and unpacked here."""
        archive = f".miles-transfer-{uuid.uuid4().hex}.tar"
        packed = await self._sandbox.run(f'tar -C {shlex.quote(source_dir)} -cf "$HOME/{archive}" .', timeout_s=600)
        try:
            if packed.exit_code != 0:
                raise RuntimeError(f"could not pack {source_dir} in the sandbox: {tail(packed)}")
            data = await self._sandbox.read_file(archive)
        finally:
            await self._sandbox.run(f'rm -f "$HOME/{archive}"', timeout_s=60)
        Path(target_dir).mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            await asyncio.to_thread(tar.extractall, target_dir, filter=transfer_tar_filter)

    @property
    def _sandbox(self) -> SandboxClient:
        if self._client is None:
            raise RuntimeError("the Miles sandbox environment is not started (or stopped already)")
        return self._client
