"""The persistent interpreter's reset (:mod:`._interpreter`'s ``wipe``): every writable place of the sandbox put
back as it was when the zygote started, the IPC objects and keys code can leave removed, and the zygote's own
state that code can change from outside given back. Sent into the sandbox ahead of :mod:`._interpreter`, as one
script (:func:`miles.agentic.sandboxes.interpreter.server_source`); it imports nothing of Miles."""

import ctypes
import errno
import os
import resource
import stat

SYSV_IPC = (("shm", 0), ("msg", 1), ("sem", 2))  # /proc/sysvipc/NAME, and which *ctl removes it
IPC_RMID = 0
MQUEUE = "/dev/mqueue"  # the sandbox's POSIX message queues (bwrap mounts its IPC namespace's there)
# keyctl(2): its syscall number per machine, two operations, and the keyrings code in the sandbox can add keys to
# (they belong to the sandbox's user namespace, which the zygote keeps alive between trajectories)
KEYCTL_SYSCALL = {"x86_64": 250, "aarch64": 219}
KEYCTL_CLEAR, KEYCTL_READ = 7, 11
KEYRINGS = {-3: "session", -4: "user", -5: "user-session"}
# ioprio_get(2) and ioprio_set(2) per machine, and who: a process
IOPRIO_SYSCALLS = {"x86_64": (252, 251), "aarch64": (31, 30)}
IOPRIO_WHO_PROCESS = 1
# every rlimit by its name (one name per limit: RLIMIT_OFILE is RLIMIT_NOFILE)
RLIMITS = {getattr(resource, name): name for name in sorted(dir(resource), reverse=True) if name.startswith("RLIMIT_")}


# -- putting the sandbox's files back (bwrap mode) ----------------------------------------------------------

def writable_places(workspace):
    """What a sandbox's code can write and what outlives its processes: the workspace (its mounts are folders of
    it), ``/tmp``, ``/dev/shm``, ``/dev/mqueue`` (the POSIX message queues) and ``/dev/pts`` (the ptys, ``ptmx``),
    and ``/dev`` and the root where they are writable (bwrap's tmpfs; Miles makes them read-only). A place that
    holds another comes first: its modes, put back, let the one inside be reached."""
    places = []
    for place in (workspace, "/tmp", "/dev/shm", "/dev/mqueue", "/dev/pts", "/dev", "/"):
        if place not in places and os.access(place, os.W_OK):
            places.append(place)
    return sorted(places, key=lambda place: place.rstrip("/").count("/"))


def snapshot(place):
    """What ``place`` holds, without going into another mount: {relative path: :func:`_entry`}."""
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
    the same (a file with other contents or attributes, a folder made anew), make the links that went, and give
    the folders, links and devices that stayed their attributes back (see :func:`_put_back`). What could not be
    put back, in words: a folder removed or made anew (a bind mount holds the old one), one of this machine's disk
    that grew with the files it held (it does not shrink when they go), an attribute the kernel refused."""
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
                if _same(path, initial.get(sub)):
                    if initial[sub][0] == "dir":
                        folders.append(sub)
                else:
                    _remove(path)
        for rel in sorted(initial, key=lambda rel: -rel.count("/") - bool(rel)):  # the deepest first
            kind, identity, attributes, atime_ns = initial[rel]
            path = os.path.join(place, rel)
            if kind == "link" and not os.path.lexists(path):
                os.symlink(identity, path)
            if kind not in ("file", "mount") and os.path.lexists(path):
                _put_back(path, kind, attributes, atime_ns)
        now = snapshot(place)
    except (OSError, RecursionError) as exc:
        return [f"{place}: {exc}"]
    changed = sorted(rel for rel in initial.keys() | now.keys()
                     if _compared(initial.get(rel)) != _compared(now.get(rel)))
    return [f"{place}: not as at the start: {', '.join(os.path.join(place, rel) for rel in changed[:5])}"] if changed \
        else []


def _entry(path, mount=False):
    """A path's kind, identity (:func:`_identity`) and attributes: mode, owner, extended attributes (``user.*``, and
    the ACLs: ``system.posix_acl_*``), size (a folder's grows with what it holds) and modification time; then its
    access time, put back but not compared (reading a folder may set it). A mount point other than the place
    itself is kept as it is: its kind alone (its attributes are another place's, or code cannot change them)."""
    if mount:
        return ("mount", None, None, None)
    info = os.lstat(path)
    attributes = (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid, _xattrs(path), info.st_size,
                  info.st_mtime_ns)
    return (*_identity(path, info), attributes, info.st_atime_ns)


def _identity(path, info):
    """A path's kind and what makes it the same one: a link's target, a folder's or a device's inode, a file's
    inode, size and times (its change time too: any change of its contents or attributes sets it, and no code can
    set it back)."""
    if stat.S_ISLNK(info.st_mode):
        return "link", os.readlink(path)
    if stat.S_ISDIR(info.st_mode):
        return "dir", (info.st_dev, info.st_ino)
    if stat.S_ISREG(info.st_mode):
        return "file", (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    return "node", (info.st_dev, info.st_ino, info.st_rdev)


def _xattrs(path):
    """A path's extended attributes, sorted (name, value) pairs; none on a file system without them (mqueue,
    devpts)."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.EOPNOTSUPP:
            return ()
        raise
    return tuple(sorted((name, os.getxattr(path, name, follow_symlinks=False)) for name in names))


def _put_back(path, kind, attributes, atime_ns):
    """Give a folder, link or device that stayed its attributes back: the extended attributes first (an ACL's may
    change the mode), then the mode, then the times (setting the others does not change them)."""
    mode, _, _, xattrs, _, mtime_ns = attributes
    now, then = dict(_xattrs(path)), dict(xattrs)
    for name in now.keys() - then.keys():
        os.removexattr(path, name, follow_symlinks=False)
    for name, value in then.items():
        if now.get(name) != value:
            os.setxattr(path, name, value, follow_symlinks=False)
    if kind != "link":
        os.chmod(path, mode)
    os.utime(path, ns=(atime_ns, mtime_ns), follow_symlinks=False)


def _same(path, initial):
    """Whether ``path`` is what ``initial`` (its entry at the start) was: the same kind and identity."""
    return initial is not None and initial[0] != "mount" and _identity(path, os.lstat(path)) == initial[:2]


def _compared(entry):
    """What the check compares of an entry: all but the access time."""
    return None if entry is None else entry[:3]


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


def process_state(libc):
    """What a session inherits from the zygote that code in the sandbox can change from outside it (its user may set
    another process's priority, CPU affinity, scheduling policy, I/O priority and, with prlimit(2), rlimits)."""
    calls = IOPRIO_SYSCALLS.get(os.uname().machine)
    return {"nice value": os.getpriority(os.PRIO_PROCESS, 0), "CPU affinity": sorted(os.sched_getaffinity(0)),
            "scheduling policy": (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority),
            "I/O priority": calls and libc.syscall(ctypes.c_long(calls[0]), ctypes.c_long(IOPRIO_WHO_PROCESS),
                                                   ctypes.c_long(0)),
            **{name: resource.getrlimit(limit) for limit, name in RLIMITS.items()}}


def put_back_process(initial, libc):
    """Give the zygote back the state of :func:`process_state` where the kernel lets it (a lowered hard rlimit, a
    raised nice value or an idle scheduling policy cannot be undone without privileges); what differs, in words."""
    for limit, name in RLIMITS.items():
        _try(resource.setrlimit, limit, initial[name])
    _try(os.sched_setaffinity, 0, initial["CPU affinity"])
    _try(os.setpriority, os.PRIO_PROCESS, 0, initial["nice value"])
    _try(os.sched_setscheduler, 0, initial["scheduling policy"][0], os.sched_param(initial["scheduling policy"][1]))
    calls = IOPRIO_SYSCALLS.get(os.uname().machine)
    if calls and initial["I/O priority"] >= 0:
        libc.syscall(ctypes.c_long(calls[1]), ctypes.c_long(IOPRIO_WHO_PROCESS), ctypes.c_long(0),
                     ctypes.c_long(initial["I/O priority"]))
    now = process_state(libc)
    return [f"the interpreter's {key} was changed ({initial[key]} at the start, {now[key]} now)"
            for key in initial if now[key] != initial[key]]


def _try(change, *args):
    try:
        change(*args)
    except (OSError, ValueError):  # not permitted: the check after it says what differs
        pass


def _ipc_ids(name):
    try:
        with open(f"/proc/sysvipc/{name}") as file:
            return [int(line.split()[1]) for line in file.readlines()[1:] if line.strip()]
    except OSError:
        return []
