"""What a trajectory leaves in a warm bwrap sandbox beyond its files (extended attributes, POSIX ACLs, timestamps,
modes, /dev/shm, message queues, the pty device) never reaches the next trajectory on the same sandbox: a seeded
random mix of it, planted by the interpreter or by a command it starts, is put back by the reset, or the reset says
it cannot be and the pool discards the sandbox. And every place a command can write counts against ``disk_mb``:
/dev/shm as the workspace does; /dev and, with mounts, the root are read-only."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shlex
import tempfile
import threading

import pytest

from miles.agentic.sandboxes import local as sandboxes
from miles.agentic.sandboxes.interpreter import ResetError
from miles.agentic.sandboxes.local import LocalSandbox
from test_sandbox_reuse import run_pool as run_warm_pool


def _user_xattrs_work_in(folder: str) -> bool:
    with tempfile.TemporaryDirectory(dir=folder) as probe:
        try:
            os.setxattr(probe, "user.probe", b"1")
        except OSError:
            return False
        return True


pytestmark = [pytest.mark.skipif(sandboxes.bwrap_problem() is not None,
                                 reason=f"bwrap does not work here: {sandboxes.bwrap_problem()}"),
              pytest.mark.skipif(not _user_xattrs_work_in(tempfile.gettempdir()),
                                 reason="this machine's temp folder has no user extended attributes")]

PLANTED_ATIME_NS = 4_000_000_000 * 10**9  # an access time no sandbox has by itself (2096)

# A listing of everything a trajectory could look at, printed as JSON: every entry below the workspace, /tmp, /dev
# (with /dev/shm, /dev/mqueue, /dev/pts), /app and the root itself: kind, mode, owner, extended attributes (ACLs
# are system.posix_acl_*), size and modification time (not of the device nodes this machine lends, whose times its
# own processes change), whether the access time is the one planted, and a file's contents or a link's target.
LIST = f"""
import hashlib, json, os, stat

def row(path):
    info = os.lstat(path)
    kind = ("dir" if stat.S_ISDIR(info.st_mode) else "link" if stat.S_ISLNK(info.st_mode) else
            "file" if stat.S_ISREG(info.st_mode) else "char" if stat.S_ISCHR(info.st_mode) else "other")
    try:
        names = sorted(os.listxattr(path, follow_symlinks=False))
    except OSError:
        names = []
    xattrs = [(name, os.getxattr(path, name, follow_symlinks=False).hex()) for name in names]
    entry = [path, kind, oct(stat.S_IMODE(info.st_mode)), info.st_uid, info.st_gid, xattrs,
             info.st_atime_ns == {PLANTED_ATIME_NS}]
    if kind != "char" or path.startswith("/dev/pts/"):
        entry += [info.st_size, info.st_mtime_ns]
    if kind == "file":
        with open(path, "rb") as file:
            entry.append(hashlib.sha256(file.read()).hexdigest())
    if kind == "link":
        entry.append(os.readlink(path))
    return entry

rows = [row("/"), sorted(os.listdir("/"))]
for top in sorted({{os.environ["HOME"], "/tmp", "/dev", "/app"}}):
    for folder, folders, files in os.walk(top):
        rows += [row(folder)] + [row(os.path.join(folder, name)) for name in sorted(files)]
        links = [os.path.join(folder, name) for name in sorted(folders)]
        rows += [row(link) for link in links if os.path.islink(link)]
print(json.dumps(rows))
"""

# At the top of every call that plants: where_permitted tolerates what this sandbox refuses (EROFS: a read-only
# place; ENOTSUP: a file system without extended attributes), so that a piece is left wherever it is permitted;
# acl() is a POSIX ACL as the kernel takes it (system.posix_acl_*), with an entry for the sandbox's user.
HELPERS = """
import ctypes, errno, os, struct
HOME = os.environ["HOME"]

def where_permitted(do, *args, **kwargs):
    try:
        do(*args, **kwargs)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.ENOTSUP, errno.EPERM, errno.EACCES, errno.ENOENT):
            raise

def acl(perms):
    entries = [(1, 7, -1), (2, perms, os.getuid()), (4, perms, -1), (0x10, perms, -1), (0x20, perms, -1)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHi", *entry) for entry in entries)
"""


def pieces(rng: random.Random) -> list[tuple[float, str]]:
    """A random mix of state to leave, at least one piece of it where the sandbox permits it, each as (when it must
    be planted: files first, then attributes, times, and modes last; Python code)."""
    folders = ["HOME", "'/tmp'", "'/dev/shm'", "'/app'", "os.path.dirname(HOME)"]  # the parent: a folder of /tmp
    specials = ["'/dev/mqueue'", "'/dev/pts'", "'/dev/pts/ptmx'"]  # no xattrs there: only times and modes
    read_only = ["'/dev'", "'/'", "'/dev/stdout'"]  # nothing changes there (Miles' bwrap makes them read-only)
    menu = []  # (when, code, whether the sandbox permits it)
    for place in folders + read_only:
        for name, value in ((f"user.left{rng.randrange(10)}", repr(rng.randbytes(6))),
                            ("system.posix_acl_access", f"acl({rng.randrange(8)})"),
                            ("system.posix_acl_default", f"acl({rng.randrange(8)})")):
            menu.append((1, f"where_permitted(os.setxattr, {place}, {name!r}, {value}, follow_symlinks=False)",
                         place not in read_only))
    for place in folders + specials + read_only:
        menu.append((2, f"where_permitted(os.utime, {place}, ns=({PLANTED_ATIME_NS}, {rng.randrange(10**18)}), "
                        f"follow_symlinks=False)", place not in read_only))
    for place in folders[:4] + read_only[:2]:
        name = f"left{rng.randrange(100)}"
        menu.append((0, f"where_permitted(lambda: (os.makedirs(os.path.join({place}, '{name}', 'sub')), "
                        f"open(os.path.join({place}, '{name}', 'sub', 'f'), 'wb').write({rng.randbytes(8)!r}), "
                        f"os.setxattr(os.path.join({place}, '{name}'), 'user.left', b'1'), "
                        f"os.symlink('/etc', os.path.join({place}, '{name}.link')), "
                        f"os.mkfifo(os.path.join({place}, '{name}.fifo'))))", place not in read_only))
    menu.append((0, "assert ctypes.CDLL(None).mq_open(b'/left', os.O_CREAT | os.O_RDWR, 0o600, None) >= 0", True))
    seen = [piece for piece in menu if piece[2]]
    # modes last, each place before the folder that holds it (a folder made unreachable keeps what is in it)
    modes = [(3, f"where_permitted(os.chmod, '/dev/pts/ptmx', {rng.choice([0o600, 0o000, 0o644]):#o})", True)]
    for depth, place in enumerate(["HOME", "os.path.dirname(HOME)", "'/tmp'", "'/app'", "'/dev/shm'", *specials[:2],
                                   *read_only[:2]]):
        mode = rng.choice([0o700, 0o777, 0o1777, 0o500, 0o000, 0o2711])
        modes.append((3 + (depth + 1) / 100, f"where_permitted(os.chmod, {place}, {mode:#o})", True))
    chosen = rng.sample(menu + modes, rng.randrange(1, 8))
    if not any(piece in seen for piece in chosen):  # a mode may be the one it was: something the listing shows
        chosen.append(rng.choice(seen))
    return sorted((when, code) for when, code, _ in chosen)


# Leaves what a reset cannot put back: a folder that existed at the start made anew (a bind mount holds the old
# one), or a folder of this machine's disk that held many files (its size stays what it grew to); the second
# prints whether its folder grew (not on a file system whose folders shrink).
CANNOT = {
    "a mount's folder made anew": "os.rmdir(os.path.join(HOME, 'app'))\nos.mkdir(os.path.join(HOME, 'app'))",
    "a folder that held many files": ("before = os.stat({place}).st_size\n"
                                      "names = [os.path.join({place}, 'many' * 30 + str(i)) for i in range(400)]\n"
                                      "for name in names: open(name, 'w').close()\n"
                                      "for name in names: os.unlink(name)\n"
                                      "print('GREW' if os.stat({place}).st_size != before else 'same')"),
}


def run_pool(body):
    """``await body(pool)`` on a pool of one warm bwrap sandbox with ``/app`` mounted, its workspaces in a fresh
    directory."""
    with tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o711)
        return run_warm_pool(body, 1, mounts=["/app"], workspace_root=root)


async def listing(sandbox) -> list:
    result = await sandbox.run_python(LIST, timeout_s=60)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("seed", range(4))
def test_a_reused_sandbox_looks_as_it_did_fresh_whatever_a_trajectory_left(seed: int) -> None:
    """Six trajectories in turn on a pool of one: each finds its sandbox as that sandbox was when it was new, then
    leaves a random mix of state, in one to three calls, each the interpreter's or a command's. A mix that can be
    put back is, and the same sandbox serves the next; one that cannot makes the reset fail and the pool discard it
    (the next trajectory gets a new one)."""
    rng = random.Random(f"leftovers {seed}")

    async def body(pool):
        fresh: dict[LocalSandbox, list] = {}
        reused, discarded = 0, False
        for trajectory in range(6):
            lease = pool()
            sandbox, seen = lease.lent, await listing(lease)
            if sandbox in fresh:
                assert seen == fresh[sandbox], f"trajectory {trajectory} (seed {seed}) found what the last one left"
                reused += 1
            else:
                assert trajectory == 0 or discarded, "the pool replaced a sandbox it could have reused"
                fresh[sandbox] = seen
            chosen = pieces(rng)
            cannot = rng.random() < 0.3 and rng.choice(list(CANNOT))
            if cannot:
                place = rng.choice(["HOME", "'/tmp'", "'/dev/shm'"])
                chosen.insert(0, (0, CANNOT[cannot].format(place=place)))
            outputs = []
            for part in _calls(rng, chosen):
                code = HELPERS + "\n".join(part)
                result = await (lease.run_python(code, timeout_s=60) if rng.random() < 0.5 else
                                lease.run(f"python3 -c {shlex.quote(code)}", timeout_s=60))
                assert result.exit_code == 0, (part, result.stderr)
                outputs.append(result.stdout)
            left = await listing(lease)
            assert left != seen, f"nothing was left: {chosen}"
            unrestorable = cannot == "a mount's folder made anew" or any("GREW" in out for out in outputs)
            before = dict(pool.counts)
            await lease.close()  # the trajectory ends: the pool resets the sandbox, or discards it
            discarded = pool.counts["discarded"] - before["discarded"] == 1
            assert discarded == unrestorable, (cannot, outputs, chosen)
            assert sandbox._closed == unrestorable
            await pool.fill()
        return reused, dict(pool.counts)

    reused, counts = run_pool(body)
    assert counts["reused"] == reused


def _calls(rng: random.Random, chosen: list[tuple[float, str]]) -> list[list[str]]:
    """The pieces in order, cut into one to three calls; the modes all in the last (a later command would start in a
    workspace that one of them may have made unreachable)."""
    codes, modes = [code for when, code in chosen if when < 3], [code for when, code in chosen if when >= 3]
    cuts = sorted(rng.sample(range(1, len(codes)), min(max(len(codes) - 1, 0), rng.randrange(3))))
    calls = [codes[start:end] for start, end in zip([0, *cuts], [*cuts, len(codes)])]
    return calls[:-1] + [calls[-1] + modes]


def test_the_reset_says_what_it_could_not_put_back() -> None:
    """A folder of this machine's disk grows with the files it holds and does not shrink when they go: the reset
    finds it not as at the start and refuses the sandbox."""
    async def body(pool):
        lease = pool()
        sandbox = lease.lent
        grew = await lease.run_python(HELPERS + CANNOT["a folder that held many files"].format(place="HOME"),
                                      timeout_s=60)
        if grew.stdout != "GREW\n":
            pytest.skip("folders shrink on this machine's file system")
        with pytest.raises(ResetError, match=r"not as at the start: .*/work\b"):
            await sandbox.reset()
        await lease.close()
        return dict(pool.counts)

    assert run_pool(body)["discarded"] == 1


# -- disk_mb counts every place a command can write -----------------------------------------------------------

QUOTA_EXCEEDED = r"\n\[sandbox: disk quota exceeded: the sandbox held \d+\.\d MiB, more than disk_mb=10; " \
                 r"the command was stopped. Remove files to go on\]"
WRITE_30_MB = 'for i in $(seq 30); do head -c 1048576 /dev/zero > "{folder}/f$i" || exit 3; done; echo wrote'


@pytest.mark.parametrize("warm", [False, True], ids=["a command", "a warm call"])
@pytest.mark.parametrize("folder", ["/dev/shm", "/tmp", "$HOME", "/app"])
def test_writes_in_every_place_count_against_disk_mb(folder: str, warm: bool) -> None:
    """30 MiB written with disk_mb=10, in /dev/shm as in the workspace: the command fails with the quota's line,
    stopped while it writes or found over the quota when it ends (/dev/shm was bwrap's tmpfs: it took whatever was
    written, in memory, and no quota counted it)."""
    async def main():
        with tempfile.TemporaryDirectory() as root:
            os.chmod(root, 0o711)
            sandbox = LocalSandbox(isolation="bwrap", warm=warm, disk_mb=10, mounts=["/app"], workspace_root=root)
            try:
                if warm:
                    await sandbox.start()
                over = await sandbox.run(WRITE_30_MB.format(folder=folder), timeout_s=120)
                clean = await sandbox.run(f'rm -f "{folder}"/f*; echo small > "{folder}/small"; cat "{folder}/small"',
                                          timeout_s=30)
                return over, clean
            finally:
                await sandbox.close()

    over, clean = asyncio.run(main())
    assert over.exit_code == sandboxes.QUOTA_EXIT_CODE, (folder, over)
    assert re.search(QUOTA_EXCEEDED, over.stderr), over.stderr
    assert (clean.stdout, clean.exit_code) == ("small\n", 0), clean


@pytest.mark.parametrize("warm", [False, True], ids=["a command", "a warm call"])
def test_dev_and_the_root_are_read_only(warm: bool) -> None:
    """/dev and bwrap's root with mounts are memory no quota counts: nothing may be written there (the devices, a pty,
    /dev/shm and /dev/mqueue work)."""
    async def main():
        with tempfile.TemporaryDirectory() as root:
            os.chmod(root, 0o711)
            sandbox = LocalSandbox(isolation="bwrap", warm=warm, mounts=["/app"], workspace_root=root)
            try:
                if warm:
                    await sandbox.start()
                return await sandbox.run(
                    "for p in /dev/left /left; do echo x > $p 2>/dev/null && echo wrote $p; done; "
                    "mkdir /dev/left 2>/dev/null && echo made it; "
                    "touch -d 2001-01-01 /dev 2>/dev/null && echo touched; "
                    "echo x > /dev/null && head -c 3 /dev/zero | wc -c && echo x > /dev/shm/x && cat /dev/shm/x && "
                    "python3 -c 'import ctypes, os, pty; pty.openpty(); "
                    "print(ctypes.CDLL(None).mq_open(b\"/q\", os.O_CREAT | os.O_RDWR, 0o600, None) >= 0)'",
                    timeout_s=60)
            finally:
                await sandbox.close()

    result = asyncio.run(main())
    assert (result.stdout, result.exit_code) == ("3\nx\nTrue\n", 0), result


def test_a_measurement_of_an_earlier_call_never_stops_the_next(monkeypatch) -> None:
    """The disk watch measures while a warm call runs; a measurement that started during one call and ends during the
    next (a file being written can hold more blocks than once written) judges the calls it saw, not the next one:
    the next call's interpreter is never killed for it. The measurement is held on a gate, not timed."""
    monkeypatch.setattr(sandboxes, "DISK_CHECK_S", 3600.0)  # only the measurement the test makes runs mid-call
    real_disk_use = sandboxes.storage.disk_use
    armed, measuring, release = [False], threading.Event(), threading.Event()

    def disk_use(root: str) -> int:
        if not armed[0]:
            return real_disk_use(root)
        armed[0] = False
        measuring.set()
        release.wait(60)
        return 50 << 20  # more than disk_mb, and more than any baseline

    monkeypatch.setattr(sandboxes.storage, "disk_use", disk_use)

    async def registered(sandbox: LocalSandbox, count: int) -> None:
        while len(sandbox._runs) < count:
            await asyncio.sleep(0.01)

    async def main():
        with tempfile.TemporaryDirectory() as root:
            os.chmod(root, 0o711)
            sandbox = LocalSandbox(isolation="bwrap", warm=True, disk_mb=10, workspace_root=root)
            try:
                await sandbox.start()
                work = os.path.join(sandbox._root, "work")
                first = asyncio.ensure_future(sandbox.run("while [ ! -e go ]; do sleep 0.01; done; echo one",
                                                          timeout_s=60))
                await registered(sandbox, 1)
                armed[0] = True
                stale = asyncio.ensure_future(sandbox._check_disk())
                await asyncio.to_thread(measuring.wait, 60)
                open(os.path.join(work, "go"), "w").close()
                one = await first
                second = asyncio.ensure_future(sandbox.run("while [ ! -e go2 ]; do sleep 0.01; done; echo two",
                                                           timeout_s=60))
                await registered(sandbox, 1)
                release.set()
                await stale
                open(os.path.join(work, "go2"), "w").close()
                return one, await second
            finally:
                release.set()
                await sandbox.close()

    one, two = asyncio.run(main())
    assert (one.stdout, one.exit_code) == ("one\n", 0), one
    assert (two.stdout, two.stderr, two.exit_code) == ("two\n", "", 0), two
