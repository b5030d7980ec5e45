"""The ``modal`` sandbox: one Modal sandbox per trajectory, through Modal's SDK.

:class:`miles.agentic.RemoteSandbox` does what all hosted sandboxes share (retries, time limits, the limit on
live sandboxes, tags, deleting on close, at the run's end and by ``miles sandbox gc modal``); this class says
how Modal does each step (:mod:`miles_modal.sdk`) and which of Modal's errors retrying cannot fix.
"""

from __future__ import annotations

import os
from typing import Any

from miles.agentic import PermanentError, RemoteSandbox
from miles_modal import sdk

__all__ = ["ModalSandbox"]

MAX_LIFETIME_S = 24 * 3600  # Modal's longest sandbox timeout


class ModalSandbox(RemoteSandbox):
    """Shell commands in a Modal sandbox. Registered as sandbox ``modal``.

    ``image``: a registry image to run (e.g. ``python:3.11-slim``; default: Modal's ``debian_slim`` with this
    machine's Python version); ``block_network``: no network inside the sandbox (the default, like the local
    sandbox); ``cpu`` (cores) and ``memory_mb``: the sandbox's request (default: Modal's). The common
    arguments of every hosted sandbox follow (see :class:`miles.agentic.RemoteSandbox`): ``lifetime_s`` is
    Modal's ``timeout``, after which Modal deletes the sandbox whatever happens here (at most 24 h).

    The sandboxes belong to the Modal app ``miles-sandboxes`` (made when missing, in the SDK's environment:
    ``MODAL_ENVIRONMENT`` or the profile's), where ``gc`` looks for them.

    Credentials are the SDK's: ``MODAL_TOKEN_ID`` and ``MODAL_TOKEN_SECRET``, or the profile in
    ``~/.modal.toml`` that ``modal token new`` writes; the server is ``MODAL_SERVER_URL`` (default
    ``https://api.modal.com``, failing over to ``https://api.modal2.com``).
    """

    provider = "modal"
    credentials = ()  # the SDK's own configuration is checked instead: env vars or ~/.modal.toml (check_args)
    default_workdir = "/workspace"
    service_url_env = "MODAL_SERVER_URL"

    def __init__(self, *, image: str | None = None, block_network: bool = True,
                 cpu: float | None = None, memory_mb: int | None = None,
                 run_id: str | None = None, workdir: str | None = None, create_retries: int = 3,
                 backoff_s: float = 1.0, create_timeout_s: float = 120.0, connect_timeout_s: float = 10.0,
                 max_concurrent: int = 16, lifetime_s: float = 3600.0, output_bytes: int = 65536,
                 mounts: list[str] | tuple[str, ...] = (), cwd: str | None = None) -> None:
        self.check_modal_args({"image": image, "block_network": block_network, "cpu": cpu,
                               "memory_mb": memory_mb, "lifetime_s": lifetime_s})
        super().__init__(run_id=run_id, workdir=workdir, create_retries=create_retries, backoff_s=backoff_s,
                         create_timeout_s=create_timeout_s, connect_timeout_s=connect_timeout_s,
                         max_concurrent=max_concurrent, lifetime_s=lifetime_s, output_bytes=output_bytes,
                         mounts=mounts, cwd=cwd)
        self.image, self.block_network = image, block_network
        self.cpu, self.memory_mb = cpu, memory_mb

    # -- configuration --------------------------------------------------------------------------------

    @classmethod
    def check_args(cls, args: dict[str, Any]) -> None:
        """Config validation: Modal credentials configured, arguments in range (ValueError names which)."""
        missing = sdk.missing_credentials()
        if missing:
            raise ValueError(f"the modal sandbox needs Modal credentials: {' and '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not set (set the environment variables, or "
                             f"run `modal token new`, which writes ~/.modal.toml)")
        super().check_args(args)
        cls.check_modal_args(args)

    @staticmethod
    def check_modal_args(args: dict[str, Any]) -> None:
        """The checks of the Modal-specific arguments (and Modal's limit on ``lifetime_s``)."""
        if args.get("image") is not None and not (isinstance(args["image"], str) and args["image"].strip()):
            raise ValueError(f"image: expected a registry image (e.g. 'python:3.11-slim') or null for Modal's "
                             f"debian_slim, got {args['image']!r}")
        if "block_network" in args and not isinstance(args["block_network"], bool):
            raise ValueError(f"block_network: expected true or false, got {args['block_network']!r}")
        cpu = args.get("cpu")
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or cpu <= 0):
            raise ValueError(f"cpu: expected a positive number of cores or null, got {cpu!r}")
        memory = args.get("memory_mb")
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory < 1):
            raise ValueError(f"memory_mb: expected a positive integer (MiB) or null, got {memory!r}")
        lifetime = args.get("lifetime_s")
        if isinstance(lifetime, (int, float)) and lifetime > MAX_LIFETIME_S:
            raise ValueError(f"lifetime_s: Modal keeps a sandbox at most {MAX_LIFETIME_S} s (24 h), got {lifetime!r}")

    @classmethod
    def describe(cls, **config: Any) -> str:
        network = "with network" if config.get("block_network") is False else "no network"
        return (f"modal sandboxes at {sdk.server_url()} (app {sdk.APP_NAME!r}, image "
                f"{config.get('image') or 'debian_slim'}, {network}), at most {config.get('max_concurrent', 16)} at "
                f"once, deleted at the end of each trajectory and of the run")

    @classmethod
    async def preflight(cls, **config: Any) -> None:
        """Reach Modal's server once within ``connect_timeout_s``; a timeout names the server."""
        try:
            await super().preflight(**config)
        except TimeoutError as exc:
            source = "MODAL_SERVER_URL" if os.environ.get("MODAL_SERVER_URL") else "the SDK's default server"
            raise TimeoutError(f"modal: {sdk.server_url()} ({source}) did not answer within "
                               f"{float(config.get('connect_timeout_s', 10.0)):g} s") from exc

    # -- provider hooks -------------------------------------------------------------------------------

    async def _create(self, labels: dict[str, str], lifetime_s: float) -> Any:
        try:
            return await sdk.create(image=self.image, tags=labels, lifetime_s=lifetime_s,
                                    block_network=self.block_network, cpu=self.cpu, memory_mb=self.memory_mb)
        except sdk.PERMANENT_ERRORS as exc:
            raise PermanentError(f"{type(exc).__name__}: {exc} ({sdk.server_url()})") from exc

    async def _exec(self, handle: Any, command: str, *, cwd: str,
                    timeout_s: float) -> tuple[str, str, int | None, bool]:
        return await sdk.exec_command(handle, command, cwd=cwd, timeout_s=timeout_s, output_bytes=self.output_bytes)

    async def _write(self, handle: Any, path: str, data: bytes) -> None:
        await sdk.write(handle, path, data)

    async def _read(self, handle: Any, path: str) -> bytes:
        return await sdk.read(handle, path)

    async def _delete(self, handle: Any) -> None:
        await sdk.terminate(handle)

    @classmethod
    async def _list(cls, labels: dict[str, str]) -> list[str]:
        return await sdk.list_ids(labels)

    @classmethod
    async def _delete_id(cls, sandbox_id: str) -> None:
        await sdk.terminate_id(sandbox_id)

    @classmethod
    async def _probe(cls) -> None:
        try:
            await sdk.probe()
        except Exception as exc:
            raise ConnectionError(f"modal: cannot use {sdk.server_url()}: {type(exc).__name__}: {exc}") from exc
