"""A local sandbox's files: writing and reading them in its workspace without following a symlink a command left,
removing a workspace a command made hard to remove, and what the disk quota counts (:mod:`.local` uses them)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import PurePosixPath

__all__ = ["BLOCK", "charge", "charge_of", "check_file_path", "disk_use", "make_folder", "measure_and_remove",
           "read_file", "remove_tree", "size_text", "write_below", "write_file"]

BLOCK = 4096  # what the disk quota counts a file, folder or link in: its size rounded up to whole blocks


def make_folder(path: str, owner: tuple[int, int] | None) -> None:
    os.mkdir(path, 0o755)
    if owner:
        os.chown(path, *owner)


# -- the disk quota ---------------------------------------------------------------------------------------


def disk_use(path: str) -> int:
    """Bytes the tree below ``path`` takes as the quota counts them (:func:`charge`), hard links once,
    never following a symlink. Runs while commands change the tree: what vanishes meanwhile is skipped."""
    seen: set[tuple[int, int]] = set()
    total, folders = 0, [path]
    while folders:
        folder = folders.pop()
        try:
            entries = list(os.scandir(folder))
        except PermissionError:  # a command (as our own user) took the permission away: it is our folder
            try:
                os.chmod(folder, 0o700)
                entries = list(os.scandir(folder))
            except OSError:
                continue
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode):
                folders.append(entry.path)
            elif info.st_nlink > 1:
                if (info.st_dev, info.st_ino) in seen:
                    continue
                seen.add((info.st_dev, info.st_ino))
            total += charge(info.st_size, info.st_blocks * 512)
    return total


def measure_and_remove(root: str, folder: str) -> tuple[int, int]:
    """The disk use of ``root`` with its folder ``folder`` (a run's), then without it, once it is removed."""
    used, share = disk_use(root), BLOCK + disk_use(folder)
    remove_tree(folder)
    return used, max(0, used - share)


def charge(size: int, allocated: int = 0) -> int:
    """What the quota counts for one file, folder or link: its size rounded up to whole blocks, at least
    one block, or what the disk allocated when that is more."""
    return max(BLOCK, -(-size // BLOCK) * BLOCK, allocated)


def charge_of(workspace: str, path: str) -> int:
    """What the regular file at ``path`` in the workspace counts now (0: none, or a symlink on the way)."""
    current = workspace
    for part in PurePosixPath(path).parts:
        current = os.path.join(current, part)
        try:
            info = os.lstat(current)
        except OSError:
            return 0
        if stat.S_ISLNK(info.st_mode):
            return 0
    return charge(info.st_size, info.st_blocks * 512) if stat.S_ISREG(info.st_mode) else 0


def size_text(n: int) -> str:
    """``n`` bytes for a message, rounded up (``10.1 MiB``: a sandbox just past 10 MiB is not "10.0 MiB")."""
    return f"{-(-n * 10 // (1 << 20)) / 10:.1f} MiB"


# -- the workspace's files --------------------------------------------------------------------------------


def check_file_path(path: str) -> tuple[str, ...]:
    """The parts of a path of ``files``: relative to the workspace, not empty, no ``..``."""
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or ".." in parts:
        raise ValueError(f"files: expected a path relative to the workspace, got {path!r}")
    return parts


def write_file(workspace: str, path: str, data: bytes, owner: tuple[int, int] | None) -> None:
    """Write ``data`` at ``path`` inside ``workspace``, never following a symlink (a command may have
    left one to point outside) and writing regular files only."""
    parts = check_file_path(path)
    try:
        write_below(workspace, parts, data, owner)
    except OSError as exc:  # e.g. ELOOP: a symlink on the way
        raise ValueError(f"files: cannot write {path!r} in the workspace: {exc}") from exc


def read_file(workspace: str, path: str) -> bytes:
    """The regular file at ``path`` inside ``workspace``, never following a symlink."""
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or ".." in parts:
        raise ValueError(f"read_file: expected a path relative to the workspace, got {path!r}")
    dir_fd = os.open(workspace, os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        with open(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"read_file: {path!r} is not a regular file")
            return file.read()
    finally:
        os.close(dir_fd)


def write_below(workspace: str, parts: tuple[str, ...], data: bytes | None, owner: tuple[int, int] | None) -> None:
    """Write ``data`` at ``parts`` below ``workspace``, making folders on the way (``data`` None: make
    ``parts`` as a folder)."""
    if data is None:
        parts = (*parts, "")
    dir_fd = os.open(workspace, os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts[:-1]:
            try:
                os.mkdir(part, 0o755, dir_fd=dir_fd)
                if owner:
                    os.chown(part, *owner, dir_fd=dir_fd, follow_symlinks=False)
            except FileExistsError:
                pass
            next_fd = os.open(part, os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
        if data is None:
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(parts[-1], flags, 0o644, dir_fd=dir_fd)
        with open(fd, "wb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError("it exists and is not a regular file")
            if owner:
                os.fchown(fd, *owner)
            file.write(data)
    finally:
        os.close(dir_fd)


def remove_tree(path: str) -> None:
    """Remove a workspace, also when a command left directories without write permission."""
    try:
        shutil.rmtree(path)
    except OSError:
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                if not os.path.islink(os.path.join(root, name)):
                    os.chmod(os.path.join(root, name), 0o700)
        shutil.rmtree(path, ignore_errors=True)
