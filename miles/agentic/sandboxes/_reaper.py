"""The reaper of one subprocess-mode sandbox run: it starts the command and, when the command ends, when
Miles ends the run or when Miles dies, kills every process the command started, wherever it went.

Run by :mod:`miles.agentic.sandboxes.local` as ``python -I -S _reaper.py PARENT_PID UID GID LIMITS COMMAND...``
(UID and GID -1: keep ours; LIMITS: ``resource:soft:hard`` triples joined by commas), with the run's
lifeline pipe as stdin and the run's output pipes as stdout and stderr. It imports nothing of Miles.

Why a process of its own: without a pid namespace (what bubblewrap gives the other mode) nothing marks a
run's processes for good. A process group or session is left with ``setsid`` or ``set -m``, an
environment variable with ``env -i``, a parent link by dying (the orphan goes to init). What a process
cannot leave is its ancestry when its nearest ancestor is a *child subreaper*
(``PR_SET_CHILD_SUBREAPER``, set by Miles before this program starts; it survives exec): every orphan of
the run becomes a child of this process. So, to end a run, this process kills its children, waits for
one to die (its children are then ours), and repeats until it has none: then the run has no process
left. Miles runs this as itself, and the command as nobody when Miles is root, so the command can
neither kill nor stop its reaper.

It exits with the command's exit code (128 + N for a signal N); 137 when the run was ended before the
command exited.
"""

import _signal as signal  # the C module: ``signal`` would import enum and functools, a third of our start-up
import os
import resource
import select
import sys

ENDED_CODE = 128 + signal.SIGKILL  # the run was ended (timeout, close, Miles died) before the command exited
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)  # SIGTERM: Miles' death signal for us


def main(argv: list[str]) -> int:
    parent, uid, gid, limits, command = int(argv[0]), int(argv[1]), int(argv[2]), _limits(argv[3]), argv[4:]
    wake = _wake_on_signals()
    if os.getppid() != parent or _readable(0, timeout=0):  # Miles died before we could watch its lifeline
        return ENDED_CODE
    pid = os.fork()
    if pid == 0:
        _become_the_command(command, uid, gid, limits, wake)
    code = _watch(pid, wake)
    _kill_descendants()
    return code


def _limits(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item]  # type: ignore[misc]


def _wake_on_signals() -> tuple[int, int]:
    """A pipe that each stop signal and SIGCHLD writes a byte to (the select loop wakes on it)."""
    wake = os.pipe()
    os.set_blocking(wake[1], False)
    signal.set_wakeup_fd(wake[1])
    for sig in (*STOP_SIGNALS, signal.SIGCHLD):
        signal.signal(sig, lambda *_: None)
    return wake


def _readable(fd: int, timeout: float | None) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def _become_the_command(command: list[str], uid: int, gid: int, limits: list[tuple[int, int, int]],
                        wake: tuple[int, int]) -> None:
    """In the forked child: a session of its own, empty stdin, default signals, nobody, rlimits; exec."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (*STOP_SIGNALS, signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores the last two
            signal.signal(sig, signal.SIG_DFL)
        os.close(wake[0])
        os.close(wake[1])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if uid >= 0:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        for limit, soft, hard in limits:
            resource.setrlimit(limit, (soft, hard))
        os.execv(command[0], command)
    except BaseException as exc:  # noqa: BLE001 - report and leave, never return into the reaper's code
        os.write(2, f"sandbox: cannot start {command[0]}: {exc}\n".encode())
    os._exit(127)


def _watch(pid: int, wake: tuple[int, int]) -> int:
    """Wait until the command exits (its exit code), or the lifeline closes or a stop signal comes (ENDED_CODE).
    Orphans that end meanwhile are reaped."""
    while True:
        ready = select.select([0, wake[0]], [], [])[0]
        if 0 in ready and not os.read(0, 1):
            return ENDED_CODE  # the lifeline closed: Miles ended the run, or died
        if wake[0] in ready:
            signals = os.read(wake[0], 64)
            while True:
                try:
                    child, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    child = 0
                if child == 0:
                    break
                if child == pid:
                    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
            if any(sig in signals for sig in STOP_SIGNALS):
                return ENDED_CODE


def _kill_descendants() -> None:
    """SIGKILL our children until there are none. A killed child's own children become ours (we are a
    subreaper) before we can reap it, so "no children" means no descendants."""
    me = os.getpid()
    while True:
        for child in _children(me):
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)  # we are the only one reaping: a listed pid cannot be reused meanwhile
        except ChildProcessError:
            return


def _children(pid: int) -> list[int]:
    """Our children, zombies included (from /proc: the kernel's list where it keeps one, else a scan)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            return [int(child) for child in file.read().split()]
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN
        pass
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    if int(file.read().rsplit(")", 1)[1].split()[1]) == pid:
                        children.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass  # it ended meanwhile
    return children


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
