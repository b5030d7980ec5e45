"""Reuse of pooled warm sandboxes: a trajectory plants one kind of leak (files in the workspace, /tmp and /dev/shm,
extended attributes, times, processes, interpreter state, environment, rlimits, signal dispositions, IPC, the
zygote's own state; test_sandbox_leftovers plants random mixes of what stays in the file system), the pool resets
the sandbox and lends the same one to the next trajectory, which finds none of it; a reset that fails or cannot be
verified discards the sandbox; 32 trajectories over a pool of 4 never share one; the pool's counts reach a step's
metrics."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest

from miles.agentic.metrics import agentic_metrics
from miles.agentic.sandboxes import interpreter as interpreters
from miles.agentic.sandboxes import local as sandboxes
from miles.agentic.sandboxes.interpreter import ResetError
from miles.agentic.sandboxes.local import LocalSandbox
from miles.agentic.sandboxes.pool import SandboxPool
from miles.testing import SandboxConformance

pytestmark = pytest.mark.skipif(sandboxes.bwrap_problem() is not None,
                                reason=f"bwrap does not work here: {sandboxes.bwrap_problem()}")

PREAMBLE = "import os, resource, signal, subprocess, sys\n"
WALK = "sorted((d, sorted(ds), sorted(fs)) for d, ds, fs in os.walk({!r}))"  # a tree, whatever order it lists in
PLACES = (".", "/tmp", "/dev/shm")  # the folders a trajectory writes in
OTHERS = "sorted(p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid())"
# kind -> (a probe printed before the leak and in the next trajectory, code that plants the leak); {sleep}: a
# command whose processes the host finds by name
# add_key(2) and request_key(2) on this machine (x86_64, aarch64)
ADD_KEY, REQUEST_KEY = {"x86_64": (248, 249), "aarch64": (217, 218)}[os.uname().machine]
IOPRIO_GET, IOPRIO_SET = {"x86_64": (252, 251), "aarch64": (31, 30)}[os.uname().machine]  # ioprio_get(2), _set(2)
ZYGOTE = "os.getppid()"  # a session's parent: the zygote, whose state the next sessions inherit
LEAKS = {
    "a file in the workspace": (WALK.format('.'), "open('leak.txt', 'w').write('x')\nos.makedirs('d/e')\n"
                                "os.symlink('/etc', 'link')\nos.chmod('d', 0)\nos.chmod('.', 0o700)"),
    "a file in /tmp": (WALK.format('/tmp'), "open('/tmp/leak', 'w').write('x')\nos.mkdir('/tmp/dir')\n"
                       "open('/tmp/dir/f', 'w').write('x')\nos.chmod('/tmp', 0o700)"),
    "a file in /dev/shm": (WALK.format('/dev'), "open('/dev/shm/leak', 'w').write('x')\nos.makedirs('/dev/shm/d/e')\n"
                           "os.chmod('/dev/shm', 0o700)"),
    "an extended attribute": (f"[os.listxattr(p) for p in {PLACES}]",
                              f"for p in {PLACES}:\n    os.setxattr(p, 'user.leak', b'x')"),
    "a changed time": (f"[os.stat(p).st_mtime_ns for p in {PLACES + ('/dev/mqueue', '/dev/pts')}]",
                       f"for p in {PLACES + ('/dev/mqueue', '/dev/pts')}:\n    os.utime(p, ns=(1, 1))"),
    "a background process": (OTHERS, "subprocess.Popen({sleep!r})"),
    "a setsid'd process": (OTHERS, "subprocess.Popen({sleep!r}, start_new_session=True)"),
    "a process the call's own end missed": (OTHERS, "import __main__\n__main__.end_processes = lambda *a: None\n"
                                            "subprocess.Popen({sleep!r}, start_new_session=True)"),
    "a global": ("'leak' in globals()", "leak = 1"),
    "an imported module": ("sorted(sys.modules)", "import colorsys\nopen('leakmod.py', 'w').write('A = 1')\n"
                           "sys.path.insert(0, os.getcwd())\nimport leakmod"),
    "sys.path": ("sys.path", "sys.path.append('/nowhere')"),
    "os.environ": ("sorted(os.environ.items())", "os.environ['LEAK'] = '1'\nos.environ.pop('HOME')"),
    "the working directory": ("os.getcwd()", "os.chdir('/tmp')"),
    "a lowered rlimit": ("[resource.getrlimit(r) for r in (resource.RLIMIT_NOFILE, resource.RLIMIT_CORE, "
                         "resource.RLIMIT_STACK)]",
                         "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
                         "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\nresource.setrlimit(resource.RLIMIT_STACK, "
                         "(1 << 20, 1 << 20))"),
    "a signal disposition": ("[signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, "
                             "signal.SIGPIPE)]",
                             "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):\n"
                             "    signal.signal(s, signal.SIG_IGN)\nsignal.signal(signal.SIGUSR1, lambda *a: None)"),
    "the umask": ("[(lambda old: os.umask(old) and old)(os.umask(0o77))]", "os.umask(0)"),
    # set on the zygote from outside it, as its user may: put back
    "the zygote's CPU affinity, I/O priority and a soft rlimit": (
        f"[sorted(os.sched_getaffinity({ZYGOTE})), resource.prlimit({ZYGOTE}, resource.RLIMIT_NOFILE), "
        f"__import__('ctypes').CDLL(None).syscall({IOPRIO_GET}, 1, {ZYGOTE})]",
        f"import ctypes\nos.sched_setaffinity({ZYGOTE}, [min(os.sched_getaffinity(0))])\n"
        f"resource.prlimit({ZYGOTE}, resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        f"assert ctypes.CDLL(None).syscall({IOPRIO_SET}, 1, {ZYGOTE}, 3 << 13) == 0"),  # the idle I/O class
    "a SysV shared memory segment": ("open('/proc/sysvipc/shm').read().count('\\n')",
                                     "import ctypes\nassert ctypes.CDLL(None).shmget(0x1234, 4096, 0o1600) >= 0"),
    # POSIX message queues and keyring keys live in the sandbox's IPC and user namespaces, in no file tree
    "a POSIX message queue": ("__import__('ctypes').CDLL(None).mq_open(b'/leak', os.O_RDONLY) >= 0",
                              "import ctypes\nassert ctypes.CDLL(None).mq_open(b'/leak', os.O_CREAT | os.O_RDWR, "
                              "0o600, None) >= 0"),
    "a key in the user keyring": (f"__import__('ctypes').CDLL(None).syscall({REQUEST_KEY}, b'user', b'leak', None, 0) "
                                  f"> 0", "import ctypes\nassert ctypes.CDLL(None).syscall("
                                  f"{ADD_KEY}, b'user', b'leak', b'secret', 6, -4) > 0"),
}


@pytest.fixture
def workspace_root():
    """A directory for workspaces that uid nobody can reach (pytest's tmp_path is private to root)."""
    with tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o711)
        yield root


def run_pool(body, size: int, **config):
    """``await body(pool)`` on a filled pool of warm bwrap sandboxes, closed afterwards."""
    async def main():
        pool = SandboxPool(lambda: LocalSandbox(isolation="bwrap", warm=True, **config), size)
        await pool.fill()
        try:
            return await body(pool)
        finally:
            await pool.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize("kind", list(LEAKS))
def test_nothing_a_trajectory_leaves_reaches_the_next_on_the_same_sandbox(kind: str, workspace_root: str) -> None:
    sleep = SandboxConformance.unique_sleep()
    probe, plant = LEAKS[kind]
    code = PREAMBLE + f"print({probe})"

    async def body(pool):
        first = pool()
        sandbox, session = first.lent, first._interpreter.session_pid
        before = await first.run_python(code, timeout_s=30)
        planted = await first.run_python(PREAMBLE + plant.format(sleep=sleep.split()) + "\n" + f"print({probe})",
                                         timeout_s=30)
        await first.close()  # the trajectory ends: the sandbox is reset
        left = SandboxConformance.pids_of(sleep)
        second = pool()
        assert second.lent is sandbox and second._interpreter.session_pid != session  # the same one, reused
        after = await second.run_python(code, timeout_s=30)
        shell = await second.run("ls -A; ls -A /tmp /dev/shm", timeout_s=30)
        await second.close()
        return before, planted, left, after, shell, dict(pool.counts)

    before, planted, left, after, shell, counts = run_pool(body, 1, workspace_root=workspace_root)
    assert before.exit_code == 0 and planted.exit_code == 0, (before, planted)
    assert planted.stdout != before.stdout, "the leak was not planted"
    assert after.stdout == before.stdout, (kind, after)
    assert left == [], "a process of the trajectory outlived the reset"
    assert counts == {"reused": 1, "discarded": 0, "started": 1, "empty": 0}


# how -> code that spoils the sandbox for reuse, and what the reset says
SPOILERS = {
    "a call timed out": ("while True: pass", "a call hit a limit: the call timed out"),
    "the zygote was killed": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nsignal.pause()",
                              "its interpreter was replaced"),
    "the zygote was stopped": ("import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)",
                               "the interpreter did not answer the reset"),
    # what the kernel lets no one undo without privileges
    "the zygote's nice value was raised": ("import os\nos.setpriority(os.PRIO_PROCESS, os.getppid(), 19)",
                                           "the interpreter's nice value was changed"),
    "the zygote's hard rlimit was lowered": ("import os, resource\n"
                                             "resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (64, 64))",
                                             r"the interpreter's RLIMIT_NOFILE was changed \(\(\d+, \d+\) at the "
                                             r"start, \(64, 64\) now\)"),
    "a mount's folder was made anew": ("import os, shutil\nw = os.environ['HOME']\nos.rmdir(os.path.join(w, 'app'))\n"
                                       "os.mkdir(os.path.join(w, 'app'))", "not as at the start"),
}


@pytest.mark.parametrize("how", list(SPOILERS))
def test_a_sandbox_whose_reset_fails_or_cannot_be_verified_is_discarded(how: str, workspace_root: str,
                                                                       monkeypatch) -> None:
    code, why = SPOILERS[how]
    monkeypatch.setattr(interpreters, "ANSWER_TIMEOUT_S", 1.0)  # a stopped zygote never answers: not a race

    async def body(pool):
        first = pool()
        sandbox = first.lent
        await first.run_python(code, timeout_s=1 if how == "a call timed out" else 30)
        with pytest.raises(ResetError, match=why):
            await sandbox.reset()  # what the pool does when the trajectory closes it
        await first.close()  # discarded: the pool starts another in its place
        await pool.fill()
        second = pool()
        other = second.lent
        fresh = await second.run_python("print(1)", timeout_s=30)
        await second.close()
        return sandbox, other, fresh, dict(pool.counts)

    config = {"mounts": ["/app"]} if "mount" in how else {}
    sandbox, other, fresh, counts = run_pool(body, 1, workspace_root=workspace_root, **config)
    assert other is not sandbox and sandbox._closed and fresh.stdout == "1\n"
    assert counts == {"reused": 0, "discarded": 1, "started": 2, "empty": 0}


def test_32_trajectories_over_a_pool_of_4_reuse_it_and_never_share_a_sandbox(workspace_root: str) -> None:
    held: set[int] = set()
    shared: list[int] = []
    processes: set = set()  # each sandbox's bwrap

    async def trajectory(pool, i, gate):
        async with gate:  # 4 at once, as rollouts run under a concurrency limit
            sandbox = pool()
            mine = id(sandbox.lent)
            processes.add(sandbox.lent._interpreter._proc)
            if mine in held:
                shared.append(i)
            held.add(mine)
            seen = await sandbox.run_python(f"import os\nprint('mine' in globals(), os.listdir('.'))\nmine = {i}",
                                            timeout_s=60, files={"who.txt": str(i).encode()})
            await asyncio.sleep(0)  # the others run meanwhile
            mine_after = await sandbox.run_python("print(mine, open('who.txt').read())", timeout_s=60)
            held.discard(mine)
            await sandbox.close()
            return mine, seen.stdout, mine_after.stdout

    async def body(pool):
        gate = asyncio.Semaphore(4)
        results = await asyncio.gather(*(trajectory(pool, i, gate) for i in range(32)))
        return results, dict(pool.counts), pool.metrics()

    results, counts, metrics = run_pool(body, 4, workspace_root=workspace_root)
    assert shared == []
    assert [(seen, after) for _, seen, after in results] == [("False ['who.txt']\n", f"{i} {i}\n") for i in range(32)]
    assert len({mine for mine, _, _ in results}) == 4  # four sandboxes served all 32
    assert counts == {"reused": 28, "discarded": 0, "started": 4, "empty": 0}
    assert metrics["sandbox/pool_reused"] == 28.0 and metrics["sandbox/pool_discarded"] == 0.0
    assert 0 < metrics["sandbox/reset_s_p50"] <= metrics["sandbox/reset_s_p99"]
    assert len(processes) == 4 and all(proc.poll() is not None for proc in processes)  # closed with the pool
    assert os.listdir(workspace_root) == []


def test_the_pool_counts_reach_the_step_metrics_once(workspace_root: str) -> None:
    async def body(pool):
        for _ in range(3):
            sandbox = pool()
            await sandbox.run_python("x = 1", timeout_s=30)
            await sandbox.close()
        return agentic_metrics([], pool), agentic_metrics([], pool)

    first, second = run_pool(body, 1, workspace_root=workspace_root)
    assert (first["sandbox/pool_reused"], first["sandbox/pool_started"], first["sandbox/pool_empty"]) == (2, 1, 0)
    assert first["sandbox/reset_s_p50"] > 0
    assert second["sandbox/pool_reused"] == 0 and "sandbox/reset_s_p50" not in second  # counted once


def test_subprocess_sandboxes_are_never_reused(workspace_root: str) -> None:
    """Subprocess isolation has no namespace of its own to put back (/tmp and the processes are this machine's): a
    pool lends such sandboxes once, closes them with their trajectory and starts others."""
    async def main():
        pool = SandboxPool(lambda: LocalSandbox(isolation="subprocess", warm=True, workspace_root=workspace_root), 1)
        await pool.fill()
        try:
            first = pool()
            await first.run_python("x = 1", timeout_s=30)
            await first.close()
            await pool.fill()
            second = pool()
            await second.close()
            with pytest.raises(ResetError, match="it is closed"):
                await first.reset()
            return first, second, dict(pool.counts)
        finally:
            await pool.aclose()

    first, second, counts = asyncio.run(main())
    assert not first.reusable and second is not first
    assert counts == {"reused": 0, "discarded": 0, "started": 2, "empty": 0}
