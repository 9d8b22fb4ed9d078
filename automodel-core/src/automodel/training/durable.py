"""File operations a checkpoint relies on: durable writes, fsync, an atomic swap of two directories, the run lock.

A checkpoint is named by ``LATEST`` only after every file and directory in it reached the disk (``fsync_tree``);
re-saving a step swaps the new copy and the old one in a single rename (``exchange``, Linux ``renameat2`` with
``RENAME_EXCHANGE``), so the name always holds a complete checkpoint. The lock (``RunLock``) is an ``flock`` the
kernel releases when its holder dies, so a crashed run never blocks the next one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import socket
import sys
from pathlib import Path

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def write_durable(path: Path, data: str | bytes) -> None:
    """Write ``path`` in full and fsync it (the caller renames or names it only afterwards)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` at once: written aside, fsynced, renamed, the directory fsynced."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_file(path.parent)


def fsync_file(path: Path | str) -> None:
    """fsync a file or directory (its data, or its entries, reach the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (files already synced cost little)."""
    for directory, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(os.path.join(directory, name))
        fsync_file(directory)


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return libc if hasattr(libc, "renameat2") else None


def exchange(a: Path, b: Path) -> bool:
    """Swap the directory entries ``a`` and ``b`` in one step; False where the system or file system cannot."""
    libc = _libc()
    if libc is None:
        return False
    result = libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL / ENOSYS / EOPNOTSUPP: this file system cannot exchange
        return False
    raise OSError(errno, os.strerror(errno), str(a))


class RunLock:
    """An exclusive ``flock`` on ``<directory>/.lock`` that records the holder's pid and host.

    The file is never deleted (deleting a lock file lets two runs lock two different files); a holder that dies
    releases the lock with its file descriptor."""

    NAME = ".lock"

    def __init__(self, directory: Path):
        self.path = Path(directory) / self.NAME
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; None on success, else who holds it (``pid N on host H``)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "an unknown process"
            os.close(fd)
            return holder
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()
