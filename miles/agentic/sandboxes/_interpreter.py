"""The persistent interpreter of a local sandbox: a zygote process in the sandbox that forks one *session* per
trajectory, a Python process that runs one call at a time, Python code in globals it keeps between calls, or a
shell command, and then ends every process the call started.

Run by :mod:`miles.agentic.sandboxes.interpreter` as ``python3 -I -c SOURCE CHANNEL ISOLATION CPU_S WORKSPACE``
inside the sandbox (bwrap, or the subprocess-mode reaper), with the sandbox's limits. It imports nothing of Miles.

The protocol: every message is a 4-byte big-endian length and a JSON object. On CHANNEL (a connected Unix socket)
the zygote says ``{"ready": pid}`` first, then answers the host:

- ``{"session": 1}``, with one file descriptor (``SCM_RIGHTS``), the session's own socket: fork a session on it;
  the reply is ``{"session": pid}``. A session is a copy of the zygote, so it starts as every session does
  (globals, modules, ``sys.path``, environment, cwd, signal dispositions, rlimits) whatever the one before did.
- ``{"end": "kill"}`` or ``{"end": "wipe"}``: kill every process of the sandbox but the zygote (the session
  included); with ``wipe`` also put every writable place back as it was when the zygote started (see
  :func:`restore`), remove the SysV IPC objects, and give the zygote back what code could change of it from outside
  (:func:`put_back_process`). The reply: ``{"status": ..., "left": [...], "problems":
  [...]}``, the session's end (``{"exit": n}``, ``{"signal": n}``, or None when it still ran), the pids still
  there after the kill, and what could not be put back; the host reuses the sandbox only when both are empty.

On a session's socket a request ``{"python": code}`` or ``{"shell": command}``, with the host's token for the
call (``"call"``), comes with two file descriptors: the write ends of the call's stdout and stderr pipes, which
become the session's fds 1 and 2 for the call. The reply is ``{"exit_code": n, "call": token}``, sent once every
process the call started is gone and the session holds the pipes no more, so the host reads them to their end.
Between calls fds 1 and 2 are /dev/null. The socket is the session's fd CHANNEL as the call's code runs: a message
the host did not expect (code that wrote to it) or a socket that closed while the session ran (code that closed
it) ends the session, and the host says so.

What the call started is ended with it. bwrap mode: the session SIGKILLs every process of the sandbox's pid
namespace but the namespace's init, the zygote and itself. Subprocess mode: the session is a child subreaper, so
every orphan a call leaves comes to it, and it kills its children until none is left. The zygote is not
dumpable: no process of the sandbox can trace it or write its memory; code that kills or stops it ends the
sandbox's reuse (its next reset is not answered, and the host discards the sandbox).
"""

# ruff: noqa: F821 - the reset's functions come from _interpreter_reset.py, ahead of this file in the one script

import ctypes
import json
import linecache
import os
import resource
import signal
import socket
import sys
import time
import traceback

HEADER = 4
SHELL_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT)  # what Python changed and a command expects default
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
PF_EXITING = 0x4  # a task's flag (/proc/PID/stat) from the moment it starts to exit

def main(argv):
    """The zygote: fork sessions, end them and everything they started, and put the sandbox back."""
    channel = socket.socket(fileno=int(argv[0]))
    channel.set_inheritable(False)
    bwrap, cpu_s, workspace = argv[1] == "bwrap", int(argv[2]), argv[3]
    libc = ctypes.CDLL(None, use_errno=True)
    if not bwrap:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    libc.prctl(PR_SET_DUMPABLE, 0)
    start = (os.getcwd(), dict(os.environ))  # where and with what a shell command starts, whatever code changed
    places = writable_places(workspace) if bwrap else []
    initial = {place: snapshot(place) for place in places}
    inherited = process_state(libc)
    null = os.open(os.devnull, os.O_RDWR)
    send(channel, {"ready": os.getpid()})
    _quiet(null)
    session = None
    while True:
        request, fds = receive(channel)
        if request is None:
            return 0
        if "session" in request and len(fds) == 1:
            session = fork_session(channel, fds[0], (bwrap, cpu_s, start, null, libc))
            send(channel, {"session": session})
            continue
        for fd in fds:
            os.close(fd)
        status, left = end_all(bwrap, session)
        session, problems = None, []
        if request.get("end") == "wipe":
            problems = [problem for place in places for problem in restore(place, initial[place])]
            problems += remove_ipc(libc) + remove_message_queues() + clear_keyrings(libc)
            problems += put_back_process(inherited, libc)
        send(channel, {"status": status, "left": left, "problems": problems})


def fork_session(channel, fd, setup):
    """Fork a session that serves the socket ``fd`` (then at CHANNEL's number); its pid."""
    pid = os.fork()
    if pid != 0:
        os.close(fd)
        return pid
    code = 1
    try:
        zygote = os.getppid()
        os.dup2(fd, channel.fileno())  # the session's socket takes the zygote's channel's place
        os.close(fd)
        session = socket.socket(fileno=channel.fileno())
        session.set_inheritable(False)
        bwrap, cpu_s, start, null, libc = setup
        libc.prctl(PR_SET_DUMPABLE, 1)  # its own /proc files are its own again
        if not bwrap:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
        code = serve(session, bwrap, cpu_s, start, null, keep=(1, zygote, os.getpid()))
    finally:
        os._exit(code)


def serve(channel, bwrap, cpu_s, start, null, keep):
    """A session: run the calls that come on ``channel`` until the host closes it. The reply names the call (the
    host's ``call`` token). After a call whose code closed the socket or put something else at its fd, the session
    waits for the zygote's kill: the host sees a session that still ran when its socket closed, which only such code
    makes, and says so."""
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    ours = _identity_of(channel.fileno())
    calls = 0
    while True:
        request, fds = receive(channel)
        if request is None:
            return 0
        calls += 1
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        try:
            _limit_cpu(cpu_s)
            if "python" in request:
                code = run_python(request["python"], namespace, f"<call {calls}>")
            else:
                code = run_shell(request["shell"], start, cpu_s)
        finally:
            _flush()
            end_processes(bwrap, keep)
            _quiet(null)
        while _identity_of(channel.fileno()) != ours:
            signal.pause()
        send(channel, {"exit_code": code, "call": request.get("call")})


def _identity_of(fd):
    """What the open file at ``fd`` is (device and inode), None when ``fd`` is closed."""
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def run_python(source, namespace, name):
    """``exec`` the source in the kept globals; a traceback (without this frame) and 1 when it raises."""
    lines = source.splitlines(keepends=True)
    linecache.cache[name] = (len(source), None, lines, name)  # tracebacks show the call's lines
    try:
        exec(compile(source, name, "exec"), namespace)
        return 0
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - the call's error, reported as Python would
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        return 1


def _exit_code(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def run_shell(command, start, cpu_s):
    """``/bin/sh -c command`` in a session of its own, where the sandbox starts, with its first environment."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            for sig in SHELL_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.chdir(start[0])
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
            os.execve("/bin/sh", ["/bin/sh", "-c", command], start[1])
        except BaseException as exc:  # noqa: BLE001 - report and leave, never return into the loop
            os.write(2, f"sandbox: cannot start /bin/sh: {exc}\n".encode())
        os._exit(127)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def end_processes(bwrap, keep):
    """SIGKILL every process the call started (bwrap mode: every process of the sandbox but ``keep``), and reap
    those that are our children."""
    for _ in range(1000):
        targets = _others(keep) if bwrap else _children()
        for pid in targets:
            _kill(pid)
        dying = _reap()
        if not dying and not (_others(keep) if bwrap else _children()):
            return
        time.sleep(0.001)


def end_all(bwrap, session):
    """The zygote's kill: every process of the sandbox but the zygote (and the pid namespace's init). The
    session's end (None when it still ran: it was killed here) and the pids still there after it all."""
    status = None
    if session is not None and _exiting(session):  # it ended by itself (the host saw its socket close)
        try:
            _, code = os.waitpid(session, 0)
            status = {"signal": os.WTERMSIG(code)} if os.WIFSIGNALED(code) else {"exit": os.WEXITSTATUS(code)}
        except ChildProcessError:
            pass
    keep = (1, os.getpid())
    end_processes(bwrap, keep)
    return status, _others(keep) if bwrap else _children()


def _exiting(pid):
    """Whether the process is ending or gone (PF_EXITING, set before it closes its files, or no longer there)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return bool(int(file.read().rsplit(")", 1)[1].split()[6]) & PF_EXITING)
    except (OSError, IndexError, ValueError):
        return True


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap():
    """Wait for our children that are gone; how many still run (0 or 1: we do not wait for the rest)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid == 0:
            return 1


def _others(keep):
    """The processes of the pid namespace (bwrap mode) but ``keep``."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and int(entry) not in keep]


def _children():
    """Our children, from every thread's list (a thread that forked, or where an orphan was re-parented)."""
    children = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as file:
                children += [int(pid) for pid in file.read().split()]
        except OSError:
            pass
    return children


def _limit_cpu(cpu_s):
    """This call may use ``cpu_s`` seconds of CPU more than the process has used (SIGXCPU ends it)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = int(usage.ru_utime + usage.ru_stime) + 1 + cpu_s
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _flush():
    for stream in {sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__}:
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream the code replaced or closed
            pass


def _quiet(null):
    os.dup2(null, 1)
    os.dup2(null, 2)


def send(channel, message):
    body = json.dumps(message).encode()
    channel.sendall(len(body).to_bytes(HEADER, "big") + body)


def receive(channel):
    """The next request and the fds that came with it; (None, []) when the host closed the channel."""
    data, fds, _, _ = socket.recv_fds(channel, HEADER, 2)
    if not data:
        return None, []
    while len(data) < HEADER:
        more = channel.recv(HEADER - len(data))
        if not more:
            return None, []
        data += more
    size, body = int.from_bytes(data, "big"), bytearray()
    while len(body) < size:
        more = channel.recv(min(size - len(body), 1 << 20))
        if not more:
            return None, []
        body += more
    return json.loads(body), fds


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
