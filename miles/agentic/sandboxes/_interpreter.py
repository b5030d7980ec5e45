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
  :func:`restore`) and remove the SysV IPC objects. The reply: ``{"status": ..., "left": [...], "problems":
  [...]}``, the session's end (``{"exit": n}``, ``{"signal": n}``, or None when it still ran), the pids still
  there after the kill, and what could not be put back; the host reuses the sandbox only when both are empty.

On a session's socket a request ``{"python": code}`` or ``{"shell": command}`` comes with two file descriptors:
the write ends of the call's stdout and stderr pipes, which become the session's fds 1 and 2 for the call. The
reply is ``{"exit_code": n}``, sent once every process the call started is gone and the session holds the pipes
no more, so the host reads them to their end. Between calls fds 1 and 2 are /dev/null.

What the call started is ended with it. bwrap mode: the session SIGKILLs every process of the sandbox's pid
namespace but the namespace's init, the zygote and itself. Subprocess mode: the session is a child subreaper, so
every orphan a call leaves comes to it, and it kills its children until none is left. The zygote is not
dumpable: no process of the sandbox can trace it or write its memory; code that kills or stops it ends the
sandbox's reuse (its next reset is not answered, and the host discards the sandbox).
"""

import ctypes
import json
import linecache
import os
import resource
import signal
import socket
import stat
import sys
import time
import traceback

HEADER = 4
SHELL_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT)  # what Python changed and a command expects default
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
PF_EXITING = 0x4  # a task's flag (/proc/PID/stat) from the moment it starts to exit
SYSV_IPC = (("shm", 0), ("msg", 1), ("sem", 2))  # /proc/sysvipc/NAME, and which *ctl removes it
IPC_RMID = 0
MQUEUE = "/dev/mqueue"  # the sandbox's POSIX message queues (bwrap mounts its IPC namespace's there)
# keyctl(2): its syscall number per machine, two operations, and the keyrings code in the sandbox can add keys to
# (they belong to the sandbox's user namespace, which the zygote keeps alive between trajectories)
KEYCTL_SYSCALL = {"x86_64": 250, "aarch64": 219}
KEYCTL_CLEAR, KEYCTL_READ = 7, 11
KEYRINGS = {-3: "session", -4: "user", -5: "user-session"}


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
    """A session: run the calls that come on ``channel`` until the host closes it."""
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
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
        send(channel, {"exit_code": code})


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


# -- putting the sandbox's files back (bwrap mode) ----------------------------------------------------------

def writable_places(workspace):
    """What a sandbox's code can write and what outlives its processes: the workspace (its mounts are folders of
    it), ``/tmp``, bwrap's ``/dev`` (a tmpfs, ``/dev/shm`` in it) and, with mounts, the root (a tmpfs too)."""
    places = []
    for place in (workspace, "/tmp", "/dev", "/"):
        if place not in places and os.access(place, os.W_OK):
            places.append(place)
    return places


def snapshot(place):
    """What ``place`` holds, without going into another mount: {relative path: (kind, mode, identity)}."""
    mounts = _mount_points()
    tree, folders = {"": _entry(place)}, [""]
    while folders:
        rel = folders.pop()
        for name in sorted(os.listdir(os.path.join(place, rel))):
            sub = os.path.join(rel, name)
            tree[sub] = _entry(os.path.join(place, sub), os.path.join(place, sub) in mounts)
            if tree[sub][0] == "dir" and os.path.join(place, sub) not in mounts:
                folders.append(sub)
    return tree


def restore(place, initial):
    """Put ``place`` back as ``initial`` (its :func:`snapshot` at the start): remove what was not there or is not
    the same (a file with other contents, a folder made anew), make the links that went, give the modes back.
    What could not be put back, in words (a folder removed or made anew cannot: a bind mount holds the old one)."""
    try:
        mounts = _mount_points()
        folders = [""]
        while folders:
            rel = folders.pop()
            folder = os.path.join(place, rel)
            if folder not in mounts or not rel:
                os.chmod(folder, 0o700)  # ours (the code ran as us): its mode comes back below
            for name in os.listdir(folder):
                sub, path = os.path.join(rel, name), os.path.join(folder, name)
                if path in mounts:
                    continue
                if _same(_entry(path), initial.get(sub)):
                    if initial[sub][0] == "dir":
                        folders.append(sub)
                else:
                    _remove(path)
        for rel in sorted(initial, key=lambda rel: -rel.count("/") - bool(rel)):  # the deepest first
            kind, mode, identity = initial[rel]
            path = os.path.join(place, rel)
            if kind == "link" and not os.path.lexists(path):
                os.symlink(identity, path)
            elif kind != "link" and kind != "mount" and os.path.lexists(path):
                os.chmod(path, mode)
        now = snapshot(place)
    except (OSError, RecursionError) as exc:
        return [f"{place}: {exc}"]
    changed = sorted(rel for rel in initial.keys() | now.keys() if initial.get(rel) != now.get(rel))
    return [f"{place}: not as at the start: {', '.join(os.path.join(place, rel) for rel in changed[:5])}"] if changed \
        else []


def _entry(path, mount=False):
    """A path's kind, mode and identity: a link's target, a folder's inode, a file's inode, size and mtime.
    A mount point other than the place itself is kept as it is: its kind alone."""
    info = os.lstat(path)
    if mount:
        return ("mount", 0, None)
    if stat.S_ISLNK(info.st_mode):
        return ("link", 0, os.readlink(path))
    if stat.S_ISDIR(info.st_mode):
        return ("dir", stat.S_IMODE(info.st_mode), (info.st_dev, info.st_ino))
    return ("file", stat.S_IMODE(info.st_mode), (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))


def _same(entry, initial):
    return initial is not None and entry[0] == initial[0] and entry[2] == initial[2]


def _remove(path):
    """Remove a file, link or folder tree, taking back the permissions code took away (ours: it ran as us)."""
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        os.unlink(path)
        return
    os.chmod(path, 0o700)
    for name in os.listdir(path):
        _remove(os.path.join(path, name))
    os.rmdir(path)


def _mount_points():
    """The mount points this process sees (/proc/self/mountinfo also lists the mounts hidden under others, such as
    those of the /dev that bwrap's /dev covers): from the root mount down, each at the top of its stack."""
    with open("/proc/self/mountinfo", "rb") as file:
        rows = [(int(fields[0]), int(fields[1]), _unescape(fields[4])) for fields in map(bytes.split, file)]
    ids, children = {row[0] for row in rows}, {}
    for row in rows:
        children.setdefault(row[1], []).append(row)

    def top(mount):  # a mount over the same point hides this one
        while over := [row for row in children.get(mount[0], ()) if row[2] == mount[2]]:
            mount = over[-1]
        return mount

    points, todo = set(), [top(row) for row in rows if row[1] not in ids]
    while todo:
        mount = todo.pop()
        points.add(mount[2])
        todo += [top(row) for row in children.get(mount[0], ()) if row[2] != mount[2]]
    return points


def _unescape(field):
    """A mountinfo path: its octal escapes (``\\040`` for a space) undone."""
    parts = field.split(b"\\")
    return os.fsdecode(parts[0] + b"".join(bytes([int(part[:3], 8)]) + part[3:] for part in parts[1:]))


def remove_ipc(libc):
    """Remove the SysV IPC objects (shared memory, message queues, semaphores) code made in the sandbox's IPC
    namespace; what is left, in words."""
    problems = []
    for name, which in SYSV_IPC:
        for ident in _ipc_ids(name):
            if which == 2:
                libc.semctl(ident, 0, IPC_RMID)
            else:
                (libc.shmctl, libc.msgctl)[which](ident, IPC_RMID, None)
        if _ipc_ids(name):
            problems.append(f"SysV IPC {name} objects left: {_ipc_ids(name)}")
    return problems


def remove_message_queues():
    """Remove the POSIX message queues code made (``mq_open``: files of the mqueue mount); what is left, in words."""
    if not os.path.isdir(MQUEUE):  # subprocess mode: never reused
        return []
    for name in os.listdir(MQUEUE):
        try:
            os.unlink(os.path.join(MQUEUE, name))
        except OSError:
            pass
    left = os.listdir(MQUEUE)
    return [f"POSIX message queues left: {sorted(left)}"] if left else []


def clear_keyrings(libc):
    """Clear the keyrings code can add keys to (``add_key``); what is left, in words. A keyring that cannot be read
    holds nothing this code could reach (its keyctl fails too)."""
    number = KEYCTL_SYSCALL.get(os.uname().machine)
    if number is None:
        return [f"the keyrings cannot be checked on {os.uname().machine}"]
    problems = []
    for ring, name in KEYRINGS.items():
        libc.syscall(ctypes.c_long(number), ctypes.c_long(KEYCTL_CLEAR), ctypes.c_long(ring))
        size = libc.syscall(ctypes.c_long(number), ctypes.c_long(KEYCTL_READ), ctypes.c_long(ring), None,
                            ctypes.c_long(0))
        if size > 0:  # 4 bytes per key id
            problems.append(f"{size // 4} key(s) left in the {name} keyring")
    return problems


def _ipc_ids(name):
    try:
        with open(f"/proc/sysvipc/{name}") as file:
            return [int(line.split()[1]) for line in file.readlines()[1:] if line.strip()]
    except OSError:
        return []


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
