"""The training plane in a process of its own, beside the rollout plane, without Ray.

Why: under a streaming schedule (``run.schedule`` one_step_off or async) generation and training are meant to
overlap. In one process they share the interpreter lock: the rollout loop's thread (its event loop, the
in-process engine, rewards) and the trainer take turns, and neither gets a core. Here the backend trains in a
child process (forked by ``multiprocessing``'s fork server, which imported torch and the builtin backend once; a
pipe carries each call and its answer, pickled): the driver keeps the rollout plane, with its engine, and waits
on the pipe without holding the lock while the child trains. ``backend.separate_process`` chooses
(:func:`separate_trainer`).

The child dies with the driver (the fork server ends with the driver, the child with the server: a parent-death
signal) and ignores Ctrl-C: the driver hears it, stops the run and shuts the child down. A child that dies is not
restarted (its optimizer state is gone): the call that was running raises a :class:`miles.errors.RunError` naming
it, and the last checkpoint is untouched.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import signal
import threading
import traceback
from dataclasses import replace
from typing import Any

from miles.errors import RunError
from miles.train.backend import BackendProxy

__all__ = ["ProcessBackend", "TrainerProcess", "separate_trainer"]

_PR_SET_PDEATHSIG = 1
_BACKEND = "__backend__"  # the first message: the backend the child trains
# What the fork server imports once, for every trainer it forks: what a trainer imports to set the builtin backend up
_PRELOAD = ("torch", "miles.train.process_backend", "miles.train.torch_backend", "miles.train.losses",
            "miles.builtin.losses", "miles.models.hf", "miles.models.vision", "miles.precision")


def separate_trainer(config: Any, registry: Any) -> bool:
    """Whether the configured backend trains in a child process (``backend.separate_process``).

    ``auto``: under a streaming schedule whose engine generates in this process (``rollout.engine.num_engines: 0``),
    on two cores or more; ``true``: always; never under ``cluster.local_mode`` (every plane in this process) nor
    for a backend that trains in Ray workers of its own."""
    from miles.config.schema import split_node
    from miles.cluster import cores
    from miles.hookspecs import uses_ray

    node, extra = split_node(config.backend, "backend")
    setting = extra["separate_process"]
    if config.cluster.local_mode or setting is False or uses_ray(registry.get("backend", node["name"]).obj):
        return False
    if setting is True:
        return True
    engines = split_node(config.rollout.engine, "rollout.engine")[1]["num_engines"]
    return config.run.schedule != "sync" and engines == 0 and cores() >= 2


def _tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


class _Pickler(pickle.Pickler):
    """Pickles a tensor as its raw bytes, dtype and shape: several times faster than torch's own reduction
    (a ``torch.save`` per storage), and without the shared-memory files ``torch.multiprocessing`` would make."""

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if type(obj) is torch.Tensor or isinstance(obj, torch.Tensor) and not obj.requires_grad:
            t = obj.detach().cpu().contiguous()
            return _tensor, (t.view(-1).view(torch.uint8).numpy().tobytes(), str(t.dtype).removeprefix("torch."),
                             tuple(t.shape))
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _context() -> Any:
    """Where trainer processes come from: multiprocessing's fork server, which imports torch and the builtin backend
    once (on its first use in this process) and forks each trainer from that; a spawned trainer imported them again,
    seconds each time. The server lives as long as this process, and ends when it does."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))
    return context


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _serve(conn: Any, threads: int, driver: int, environ: dict[str, str]) -> None:
    """The child: imports what training needs while it waits for its backend (the first message), then runs each
    call it receives on it and sends back its result or its exception. It has the driver's environment as it is now
    (the fork server's is the one of its start)."""
    import ctypes

    import torch

    server = os.getppid()  # the fork server, which ends once every holder of its "alive" pipe's write end closed it
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    from multiprocessing import forkserver

    # our copy of that write end (so that this process could use the server too) would keep the server, and so
    # this process, alive after the driver's death: closed, the driver's death ends the server, then this process
    alive, forkserver._forkserver._forkserver_alive_fd = forkserver._forkserver._forkserver_alive_fd, None
    if alive is not None:
        os.close(alive)
    if os.getppid() != server or not _alive(driver):  # the server or the driver died before prctl
        os._exit(1)
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    torch.set_num_threads(threads)
    import miles.train.torch_backend  # noqa: F401 - the builtin backend, imported before it is needed
    backend = None
    while True:
        try:
            method, args, kwargs = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            if method == _BACKEND:
                backend = args[0]
                reply: tuple = ("ok", None)
            else:
                reply = ("ok", getattr(backend, method)(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            reply = ("error", exc, traceback.format_exc())
        try:
            data = _dumps(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. an exception that cannot be pickled
            data = pickle.dumps(("error", RuntimeError(f"{method}: {reply[1]!r} ({exc})"), ""), protocol=5)
        try:
            conn.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError):  # the driver stopped waiting (Ctrl-C): nobody to answer
            return
        if method == "shutdown":
            return


class TrainerProcess:
    """A child process started ahead of its backend (forked by ``multiprocessing``'s fork server, which imports torch
    and the builtin backend once: :func:`_context`): a run starts it before its SFT phase, and a thread of its own
    starts it (the fork server's first start takes seconds), so that its start-up overlaps that phase. ``stop`` ends
    one that was never used."""

    def __init__(self, threads: int) -> None:
        context = _context()
        self.conn, child = context.Pipe()
        self.proc = context.Process(target=_serve, args=(child, threads, os.getpid(), dict(os.environ)),
                                    name="miles-trainer", daemon=True)
        self.taken = False
        self._error: BaseException | None = None
        self._starting = threading.Thread(target=self._start, args=(child,), name="miles-trainer-start", daemon=True)
        self._starting.start()

    def _start(self, child: Any) -> None:
        try:
            self.proc.start()
        except BaseException as exc:  # noqa: BLE001 - raised where the process is wanted (started)
            self._error = exc
        finally:
            child.close()

    def started(self) -> Any:
        """The process, once it started (RunError when it could not)."""
        self._starting.join()
        if self._error is not None:
            raise RunError(f"the training process did not start: {self._error}") from self._error
        return self.proc

    def stop(self) -> None:
        self._starting.join()
        if not self.taken and self._error is None and self.proc.is_alive():
            self.conn.close()  # the child reads EOF and returns
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


class ProcessBackend(BackendProxy):
    """The driver's view of a backend training in a child process (the :class:`miles.train.TrainBackend`
    contract). Calls are answered in order, one at a time."""

    def __init__(self, backend: Any, *, threads: int, process: TrainerProcess | None = None) -> None:
        """``backend`` trains in ``process`` (one started earlier with :class:`TrainerProcess`), else in a process
        started now. It is sent with the first call."""
        if process is None or process.taken or not process.started().is_alive():
            process = TrainerProcess(threads)
        process.taken = True
        self._conn, self._proc = process.conn, process.started()
        self._backend: Any = backend  # sent with the first call, whose answer comes after the child took it
        self._closed = self._interrupted = False

    exports_copies = True  # export_weights answers with tensors of its own: a push may keep them as they are

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RunError(f"the training process was shut down; cannot run {method}")
        try:
            backend, self._backend = self._backend, None
            if backend is not None:
                self._conn.send_bytes(_dumps((_BACKEND, (backend,), {})))
            self._conn.send_bytes(_dumps((method, args, kwargs)))
            if backend is not None and (reply := pickle.loads(self._conn.recv_bytes()))[0] != "ok":
                self._interrupted = True  # the call's own answer is still to come: nothing more is read
                method = "unpickling the backend"
            else:
                reply = pickle.loads(self._conn.recv_bytes())
        except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
            self._proc.join(5)
            raise RunError(f"the training process died during {method} (exit code {self._proc.exitcode}); "
                           f"the last checkpoint is untouched") from exc
        except BaseException:  # e.g. Ctrl-C while the child works: its answer would reach the next call
            self._interrupted = True
            raise
        if reply[0] == "ok":
            return reply[1]
        exc, where = reply[1], reply[2]
        if where:  # shown with the exception's traceback; not printed for one the run reports in a line of its own
            exc.add_note(f"the training process failed in {method}:\n{where.rstrip()}")
        raise exc

    def _batch(self, batch: Any) -> Any:
        """The batch without its samples (the rollout's records, for the driver's use): only tensors cross."""
        return replace(batch, samples=[])

    def shutdown(self) -> None:
        """Shut the backend down and end its process (once; later calls do nothing)."""
        if self._closed:
            return
        try:
            if self._proc.is_alive() and not self._interrupted:
                self._call("shutdown")
        except RunError:
            pass  # already gone
        finally:
            self._closed = True
            self._conn.close()
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
