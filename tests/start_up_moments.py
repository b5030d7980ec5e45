"""Kill a rollout at every moment of a sandbox run's start-up (for tests/test_sandbox.py).

A "moment" is a fork or an exec of any process of the run, the rollout's own fork included: the points
where the set of processes, and so what must end them, changes. A tracer follows the rollout and every
process it starts (ptrace, fork and exec events only), holds the process that reached the chosen moment,
SIGKILLs the rollout there and exits, which lets every traced process go on from where it stood. Moments
are named by the process's place in the tree and its event count (``rollout.0.1/2``: the rollout's first
child's second child, at its third event), so that every trial finds its moment again, whatever order
concurrent processes reach theirs in.

Run as ``python start_up_moments.py ISOLATION WORKSPACE_ROOT``; prints one JSON object: ``moments`` (what a
first, discovery trial saw up to the command's own ``sleep``, where it killed the rollout) and ``trials``
(one per moment: the moment, whether it was reached, the trial's ``sleep`` command line to look for), or
``error`` when this machine does not let us trace.
"""

import asyncio
import ctypes
import json
import os
import signal
import sys

from miles.agentic.sandboxes.local import LocalSandbox

PTRACE_CONT, PTRACE_GETEVENTMSG, PTRACE_SEIZE = 7, 0x4201, 0x4206
TRACE_FORKS_AND_EXECS = 0x2 | 0x4 | 0x10  # PTRACE_O_TRACEFORK, PTRACE_O_TRACEVFORK, PTRACE_O_TRACEEXEC
EVENTS = {1: "fork", 2: "vfork", 4: "exec"}  # the PTRACE_EVENT_* that are moments
EXEC, EVENT_STOP = 4, 128
WALL = 0x40000000  # __WALL: wait for every tracee, whoever's child it is
_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def _ptrace(request: int, pid: int, data: int = 0) -> None:
    if _libc.ptrace(request, pid, None, ctypes.c_void_p(data)) == -1:
        errno = ctypes.get_errno()
        raise OSError(errno, f"ptrace({request:#x}, {pid}): {os.strerror(errno)}")


def _new_child(pid: int) -> int:
    """The pid a tracee at a fork event just made."""
    message = ctypes.c_ulong()
    if _libc.ptrace(PTRACE_GETEVENTMSG, pid, None, ctypes.byref(message)) == -1:
        raise OSError(ctypes.get_errno(), "PTRACE_GETEVENTMSG")
    return message.value


def _program(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return os.path.basename(file.read().split(b"\0")[0].decode())
    except OSError:
        return "?"


def trace(rollout: int, kill_at: str | None) -> list[str]:
    """Follow the (seized) rollout's processes until moment ``kill_at`` (None: the exec of ``sleep``, the
    run's command), held there; SIGKILL the rollout. The moments seen, the last one the kill's."""
    names, counts, children, unnamed = {rollout: "rollout"}, {}, {}, set()
    moments: list[str] = []
    while True:
        pid, status = os.waitpid(-1, WALL)
        if not os.WIFSTOPPED(status):
            if pid == rollout:
                moments.append("the rollout ended by itself")
                return moments
            continue
        event = status >> 16
        if event in EVENTS:
            name = names[pid]
            index = counts[name] = counts.get(name, -1) + 1
            moments.append(f"{name}/{index} {EVENTS[event]} {_program(pid)}")
            if event != EXEC:
                child = _new_child(pid)
                names[child] = f"{name}.{children.setdefault(name, 0)}"
                children[name] += 1
                if child in unnamed:  # its first stop came before this event: let it go now
                    unnamed.discard(child)
                    _ptrace(PTRACE_CONT, child)
            if f"{name}/{index}" == kill_at or (kill_at is None and event == EXEC and _program(pid) == "sleep"):
                os.kill(rollout, signal.SIGKILL)
                return moments
            _ptrace(PTRACE_CONT, pid)
        elif event == EVENT_STOP:  # a new process's first stop (or a group stop)
            if pid in names:
                _ptrace(PTRACE_CONT, pid)
            else:
                unnamed.add(pid)  # held until its parent's fork event names it
        else:
            _ptrace(PTRACE_CONT, pid, os.WSTOPSIG(status))  # a signal on its way: deliver it


def trial(isolation: str, workspace_root: str, sleep: str, kill_at: str | None) -> list[str]:
    """One rollout running ``sleep`` in a sandbox, killed at ``kill_at``; the moments its tracer saw."""
    report_out, report_in = os.pipe()
    tracer = os.fork()
    if tracer == 0:
        os.close(report_out)
        go_out, go_in = os.pipe()
        rollout = os.fork()
        if rollout == 0:
            os.close(go_in)
            os.close(report_in)
            os.read(go_out, 1)
            sandbox = LocalSandbox(isolation=isolation, workspace_root=workspace_root)
            asyncio.run(sandbox.run(sleep + "; true", timeout_s=600))  # sleep is a grandchild: sh forks it
            os._exit(0)
        try:
            _ptrace(PTRACE_SEIZE, rollout, TRACE_FORKS_AND_EXECS)
            os.write(go_in, b"g")
            report: object = trace(rollout, kill_at)
        except OSError as exc:
            os.kill(rollout, signal.SIGKILL)
            report = {"error": str(exc)}
        os.write(report_in, json.dumps(report).encode())
        os._exit(0)  # detaches every traced process: they go on from where they stood
    os.close(report_in)
    with os.fdopen(report_out) as file:
        report = json.loads(file.read())
    os.waitpid(tracer, 0)
    if isinstance(report, dict):
        raise OSError(report["error"])
    return report


def main(isolation: str, workspace_root: str) -> dict:
    LocalSandbox(isolation=isolation)  # probes bwrap once, before the forks
    count = iter(range(10**4))

    def unique_sleep() -> str:  # a command line no other process has (this pid is ours while we run)
        return f"sleep 1000.{os.getpid():07d}{next(count):04d}"

    try:
        moments = trial(isolation, workspace_root, first := unique_sleep(), None)
    except OSError as exc:
        return {"error": f"cannot trace here: {exc}"}
    trials = [{"moment": moment, "sleep": first, "reached": True} for moment in moments[-1:]]
    for moment in moments[:-1]:
        name, sleep = moment.split()[0], unique_sleep()
        seen = trial(isolation, workspace_root, sleep, name)
        trials.append({"moment": moment, "sleep": sleep, "reached": seen[-1].split()[0] == name})
    return {"moments": moments, "trials": trials}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3])))
