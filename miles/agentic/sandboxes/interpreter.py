"""A local sandbox's persistent interpreter, from Miles' side: one long-lived process in the sandbox (the script
:mod:`._interpreter`, under bwrap or the subprocess-mode reaper, with the sandbox's limits), a zygote that forks a
*session* per trajectory, which runs one call at a time, Python code in globals kept between calls, or a shell
command. See :mod:`._interpreter` for the protocol.

Nothing here is bound to an event loop: the process is started with :class:`subprocess.Popen` and each call reads
its sockets and pipes on the loop it runs on, so a sandbox opened in one rollout step (Miles runs each on a loop of
its own in the sync schedule) works in the next, as a pool needs. A call that times out, or whose session dies
(killed, ``os._exit``, out of CPU time), ends the session and every process of the sandbox; the next call gets a
new session from the zygote. When the zygote does not answer, the whole process is stopped and the sandbox starts
a new one (:mod:`.local`). :meth:`Interpreter.reset` is what lets a pool hand the sandbox to another trajectory.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import os
import secrets
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from miles.agentic.types import CUT_MARKER

__all__ = ["CHANNEL_FD", "Capped", "Interpreter", "Outcome", "ProtocolError", "RESTART_MARKER",
           "ResetError", "WATCH_LIFELINE", "WarmCall", "server_source"]

DRAIN_GRACE_S = 2.0  # how long a call waits for its output pipes to close once it ended
START_TIMEOUT_S = 60.0  # how long an interpreter may take to say it is ready
ANSWER_TIMEOUT_S = 10.0  # how long the zygote may take to fork a session, or to end one and put the sandbox back
HEADER = 4
MAX_MESSAGE_BYTES = 1 << 20  # far more than any message of the protocol: a longer one is garbage, not waited for
CHANNEL_FD = 4  # the interpreter's channel in every process of the sandbox
# processes.WATCH_LIFELINE, where the lifeline's watcher lets go of the channel (else the interpreter's death
# would not close it)
WATCH_LIFELINE = f'exec 3<&0 </dev/null; (exec {CHANNEL_FD}>&-; read x <&3; kill -9 0) >/dev/null 2>&1 & exec "$@" 3<&-'
# Ends the stderr of a call after which the interpreter was replaced; {reason}: why it ended.
RESTART_MARKER = "\n[sandbox: the interpreter was restarted: {reason}; variables were lost]"


@functools.cache
def server_source() -> str:
    """The in-sandbox script, passed with ``-c`` (Miles' files may not be visible inside the sandbox): the reset's
    functions, then the interpreter that calls them."""
    here = os.path.dirname(os.path.abspath(__file__))
    parts = []
    for name in ("_interpreter_reset.py", "_interpreter.py"):
        with open(os.path.join(here, name)) as file:
            parts.append(file.read())
    return "\n".join(parts)


@dataclass
class Outcome:
    """What a call gave: the exit code (None when it timed out or the interpreter died), its output, and why
    the interpreter ended during the call (None when it lives on)."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    ended: str | None


class ResetError(RuntimeError):
    """A sandbox could not be put back as it started, or that could not be verified: it must not be reused."""


class ProtocolError(RuntimeError):
    """A message on an interpreter's channel that the protocol never sends: the code a call ran wrote to the channel
    (it is fd CHANNEL_FD in the session that runs it), so nothing more read from it can be trusted."""


class Interpreter:
    """One persistent interpreter process. ``argv`` starts it, with the channel as fd CHANNEL_FD; ``options`` are
    :func:`subprocess.Popen`'s (stdin becomes the lifeline: closing our end of it tells the lifeline watcher (bwrap)
    or the reaper (subprocess mode) to kill everything of the interpreter). ``bwrap``: stop it by killing its
    process group at once too; the subprocess-mode reaper is only told, through the lifeline."""

    def __init__(self, argv: list[str], options: dict, *, bwrap: bool, log_path: str) -> None:
        self._argv, self._options, self._bwrap, self._log_path = argv, options, bwrap, log_path
        self._proc: subprocess.Popen | None = None
        self._channel: socket.socket | None = None  # the zygote's
        self._session: socket.socket | None = None  # the current session's
        self._lifeline = -1
        self.pid: int | None = None  # the zygote's pid as the sandbox sees it
        self.session_pid: int | None = None  # the current session's, None between sessions

    @property
    def alive(self) -> bool:
        return self._channel is not None

    async def start(self) -> None:
        """Start the process, wait until it says it is ready and open a session (RuntimeError with its output
        when it fails)."""
        ours, theirs = socket.socketpair()
        channel_fd = fcntl.fcntl(theirs.fileno(), fcntl.F_DUPFD_CLOEXEC, CHANNEL_FD + 1)
        theirs.close()
        lifeline_in, self._lifeline = os.pipe()
        options = dict(self._options, preexec_fn=functools.partial(_in_child, channel_fd, self._options["preexec_fn"]))
        try:
            with open(self._log_path, "ab") as log:
                self._proc = subprocess.Popen(self._argv, **options, stdin=lifeline_in, stdout=log, stderr=log,
                                              pass_fds=(channel_fd, CHANNEL_FD))  # kept: dup2 makes it
        except BaseException:
            ours.close()
            self._close_lifeline()
            raise
        finally:
            os.close(channel_fd)
            os.close(lifeline_in)
        ours.setblocking(False)
        self._channel = ours
        try:
            ready = await asyncio.wait_for(_receive(ours), START_TIMEOUT_S)
            if ready is None or "ready" not in ready:
                raise RuntimeError(f"the sandbox's interpreter did not start: {self._log_tail() or 'no output'}")
            self.pid = ready["ready"]
            await self._open_session()
        except BaseException:
            await self.stop()
            raise

    async def call(self, request: dict, timeout_s: float, cap: int) -> Outcome:
        """Run one request (``{"python": code}`` or ``{"shell": command}``) in the session (a new one when there is
        none); after a timeout or the session's death ``ended`` says why, and the session and everything it
        started are gone; when the call is cancelled, or the zygote does not answer, the process is stopped."""
        assert self._channel is not None, "start the interpreter first"
        if self._session is None:
            await self._open_session()
        loop, session = asyncio.get_running_loop(), self._session
        assert session is not None
        out, err = Capped(cap), Capped(cap)
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        readers = [asyncio.ensure_future(_read_all(loop, fd, into)) for fd, into in ((out_r, out), (err_r, err))]
        timed_out, ended, reply, exit_code, settled = False, None, None, None, False
        token = secrets.token_hex(8)  # the reply names it: one that does not, or comes twice, was not the session's
        try:
            body = json.dumps({**request, "call": token}).encode()
            try:
                socket.send_fds(session, [len(body).to_bytes(HEADER, "big")], [out_w, err_w])
            finally:
                os.close(out_w)
                os.close(err_w)
            await loop.sock_sendall(session, body)
            try:
                reply = _checked_reply(await asyncio.wait_for(_receive(session), timeout_s), token)
            except asyncio.TimeoutError:
                timed_out, ended = True, f"the call timed out after {timeout_s:g} s"
            except ProtocolError as exc:  # the session's stream is the code's now: end the session, never read on
                ended = f"the code it ran wrote to the interpreter's channel (fd {CHANNEL_FD}): {exc}"
            if reply is None:
                why, exit_code = await self._end_session()
                exit_code = None if ended else exit_code
                ended = ended or why
            settled = True
        except ConnectionError:  # it died between two calls
            ended, exit_code = await self._end_session()
            settled = True
        finally:
            if not settled:  # cancelled, or the channel broke: nothing of the sandbox is known
                await self.stop()
            done, pending = await asyncio.wait(readers, timeout=DRAIN_GRACE_S)
            for reader in pending:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        if reply is not None:
            exit_code = reply["exit_code"]
        elif timed_out:
            exit_code = None
        return Outcome(exit_code, out.text(), err.text(), timed_out, ended)

    async def reset(self) -> None:
        """End the session and every process of the sandbox, put its files back as they were when the interpreter
        started, and open a new session: what lets the sandbox serve another trajectory. ResetError when any of it
        failed or could not be verified (no process left but the zygote and the namespace's init; the files as at
        the start; a new session); the sandbox must then not be reused."""
        if self._channel is None or not self._bwrap:
            raise ResetError("its interpreter is not running" if self._channel is None else
                             "subprocess isolation: /tmp and the processes are this machine's, not the sandbox's")
        before = self.session_pid
        self._close_session()
        answer = await self._ask({"end": "wipe"})
        if answer is None:
            raise ResetError("the interpreter did not answer the reset")
        if answer["left"]:
            raise ResetError(f"processes of the sandbox outlived the reset: {answer['left']}")
        if answer["problems"]:
            raise ResetError("; ".join(answer["problems"]))
        try:
            await self._open_session()
        except RuntimeError as exc:
            raise ResetError(str(exc)) from exc
        if self.session_pid in (before, self.pid):
            raise ResetError(f"the new session's pid {self.session_pid} is not new")

    async def stop(self) -> None:
        """Kill the interpreter and everything of it, and wait until its process is gone (idempotent)."""
        self._close_session()
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        self.kill()
        proc = self._proc
        if proc is not None:
            deadline = time.monotonic() + 2 * DRAIN_GRACE_S
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.005)

    def kill(self) -> None:
        """Close the lifeline; in bwrap mode also SIGKILL the process group (bwrap and the namespace's init, whose
        death ends every process in it). The subprocess-mode reaper is never SIGKILLed: it kills what it holds."""
        self._close_lifeline()
        if self._bwrap and self._proc is not None and self._proc.returncode is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    async def _open_session(self) -> None:
        """Ask the zygote for a session on a socket of ours (RuntimeError when it does not give one)."""
        ours, theirs = socket.socketpair()
        try:
            answer = await self._ask({"session": 1}, fds=[theirs.fileno()])
        finally:
            theirs.close()
        if answer is None or "session" not in answer:
            ours.close()
            await self.stop()
            raise RuntimeError(f"the sandbox's interpreter gave no session: {self._log_tail() or 'no output'}")
        ours.setblocking(False)
        self._session, self.session_pid = ours, answer["session"]

    async def _end_session(self) -> tuple[str, int | None]:
        """After a call that timed out or whose session closed its socket: have the zygote end the session and
        everything of the sandbox. Why the session ended and its exit code (as a shell gives it); when the zygote
        does not answer, the process is stopped and its own end says why."""
        self._close_session()
        answer = await self._ask({"end": "kill"})
        if answer is None:
            await self.stop()
            return await self._death(), self._proc_code()
        status = answer["status"]
        if status is None:  # it still ran when its socket closed, which only the code it ran does (_interpreter.serve)
            return f"the code it ran closed or replaced the interpreter's channel (fd {CHANNEL_FD})", None
        if "exit" in status:
            return f"it exited with code {status['exit']}", status["exit"]
        return _signal_reason(status["signal"]), 128 + status["signal"]

    async def _ask(self, request: dict, fds: list[int] = ()) -> dict | None:
        """The zygote's answer to ``request``, None when it did not come within ANSWER_TIMEOUT_S (or the channel
        broke): the channel then holds who knows what, so the caller stops the process."""
        channel = self._channel
        if channel is None:
            return None
        body = json.dumps(request).encode()
        try:
            socket.send_fds(channel, [len(body).to_bytes(HEADER, "big")], list(fds))
            await asyncio.get_running_loop().sock_sendall(channel, body)
            return await asyncio.wait_for(_receive(channel), ANSWER_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, ProtocolError):
            return None

    def _close_session(self) -> None:
        session, self._session, self.session_pid = self._session, None, None
        if session is not None:
            session.close()

    async def _death(self) -> str:
        """Why the interpreter's process ended (the zygote died: the sandbox ended with it)."""
        proc, deadline = self._proc, time.monotonic() + DRAIN_GRACE_S
        while proc is not None and proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        code = None if proc is None else proc.returncode
        if code is None:
            return "it closed its channel"
        signum = -code if code < 0 else code - 128 if code > 128 else None
        return f"it exited with code {code}" if signum is None else _signal_reason(signum)

    def _proc_code(self) -> int | None:
        """The process's exit code as a shell gives it (128 + N for signal N), None while it runs."""
        code = None if self._proc is None else self._proc.returncode
        return 128 - code if code is not None and code < 0 else code

    def _close_lifeline(self) -> None:
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1

    def _log_tail(self) -> str:
        try:
            with open(self._log_path, "rb") as file:
                return file.read()[-2000:].decode(errors="replace").strip()
        except OSError:
            return ""


def _signal_reason(signum: int) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    why = " (it used up its CPU time, cpu_s)" if signum == signal.SIGXCPU else ""
    return f"it was killed by {name}{why}"


async def _receive(channel: socket.socket) -> dict | None:
    """The next message on ``channel``, or None when it closed; ProtocolError for what the protocol never sends
    (an absurd length, a body that is not a JSON object)."""
    header = await _read_exactly(channel, HEADER)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"a message of {size} bytes announced ({header!r}), more than the "
                            f"{MAX_MESSAGE_BYTES} any message has")
    body = await _read_exactly(channel, size)
    if body is None:
        return None
    try:
        message = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        raise ProtocolError(f"a message that is not JSON ({body[:60]!r})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a message that is not a JSON object ({body[:60]!r})")
    return message


def _checked_reply(reply: dict | None, token: str) -> dict | None:
    """A session's reply to the call ``token`` (None: its socket closed), ProtocolError when it is not one: the
    code wrote its own, or the session's real reply to an earlier call came late."""
    if reply is None:
        return None
    if reply.get("call") != token or isinstance(reply.get("exit_code"), bool) \
            or not isinstance(reply.get("exit_code"), int):
        shown = json.dumps(reply)
        raise ProtocolError(f"a reply that is not the session's to this call ({shown[:60]})")
    return reply


async def _read_exactly(channel: socket.socket, size: int) -> bytes | None:
    loop, data = asyncio.get_running_loop(), bytearray()
    while len(data) < size:
        try:
            more = await loop.sock_recv(channel, size - len(data))
        except (ConnectionError, OSError):
            return None
        if not more:
            return None
        data += more
    return bytes(data)


class WarmCall:
    """One call of a sandbox's interpreter, as its disk watch sees a run: stopping it kills the interpreter."""

    tmp = None

    def __init__(self, interpreter: Interpreter, *, baseline: int) -> None:
        self.interpreter, self.baseline = interpreter, baseline
        self.over_quota: int | None = None
        self.stopped = False
        self.done = asyncio.Event()

    def stop(self) -> None:
        self.stopped = True
        self.interpreter.kill()


def _in_child(channel_fd: int, setup: Any) -> None:
    """Between fork and exec: the channel to its fixed number, then the sandbox's own set-up."""
    os.dup2(channel_fd, CHANNEL_FD)
    os.close(channel_fd)
    setup()


async def _read_all(loop: asyncio.AbstractEventLoop, fd: int, into: Capped) -> None:
    """Read the pipe ``fd`` to its end into ``into``, then close it."""
    os.set_blocking(fd, False)
    finished = loop.create_future()

    def readable() -> None:
        try:
            while data := os.read(fd, 1 << 16):
                into.add(data)
        except BlockingIOError:
            return
        except OSError:
            pass
        if not finished.done():
            finished.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await finished
    finally:
        loop.remove_reader(fd)
        os.close(fd)


class Capped:
    """The first ``cap`` bytes of a stream and a count of the rest."""

    def __init__(self, cap: int) -> None:
        self.cap, self.kept, self.cut = cap, bytearray(), 0

    def add(self, data: bytes) -> None:
        room = max(0, self.cap - len(self.kept))
        self.kept += data[:room]
        self.cut += max(0, len(data) - room)

    def text(self) -> str:
        text = self.kept.decode(errors="replace")
        return text + CUT_MARKER.format(self.cut) if self.cut else text
