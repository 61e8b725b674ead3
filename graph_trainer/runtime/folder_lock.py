"""One run per folder: a run holds an exclusive lock on its dump folder for as long as it lives.

The lock is `flock(2)` on the folder itself, not on a lock file: nothing is added to the folder,
so a refused run, or a resume that finds nothing to do, changes no byte in it. The kernel drops
the lock when the process ends however it ends (`kill -9` included), so a crashed run never
blocks its rerun. A refused run names the holder's pid, read from `/proc/locks` (Linux) by the
folder's device and inode.

The lock belongs to the process: a second `lock_folder` of a folder this process already holds
succeeds (a script that trains twice into one folder, one run after the other, is one user).
A file system that cannot lock (some network mounts) is reported once and the run goes on
unguarded rather than refusing to start.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

# A child of the `graph_trainer` logger, named without importing it (runtime is below observability).
logger = logging.getLogger(__name__)

UNKNOWN_PID = 0  # no process has pid 0: the holder exists, /proc/locks does not name it
_PROC_LOCKS = Path("/proc/locks")
_held: dict[tuple[int, int], int] = {}  # (device, inode) of a locked folder -> the open descriptor holding it


def _key(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def lock_folder(folder: Path) -> int | None:
    """Lock `folder` (an existing directory) for this process.

    Returns None when this process holds the lock (now, or already), else the pid of the process
    that holds it (`UNKNOWN_PID` when `/proc/locks` does not say).
    """
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)  # not inherited by exec'd children (O_CLOEXEC)
    key = _key(os.fstat(fd))
    if key in _held:
        os.close(fd)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return holder_pid(key)
        logger.warning(f"cannot lock {folder} ({e.strerror}): nothing stops a second run from writing into it")
        return None
    _held[key] = fd
    return None


def release_folder(folder: Path) -> None:
    """Drop this process's lock on `folder`, if it holds one (the process's end drops it too)."""
    try:
        key = _key(os.stat(folder))
    except OSError:
        return
    fd = _held.pop(key, None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor of the open file releases the flock


def holder_pid(key: tuple[int, int]) -> int:
    """The pid holding an flock on the file of (device, inode) `key`, from /proc/locks, or `UNKNOWN_PID`."""
    dev, ino = key
    try:
        lines = _PROC_LOCKS.read_text().splitlines()
    except OSError:
        return UNKNOWN_PID
    # "1: FLOCK  ADVISORY  WRITE 4242 00:2d:131 0 EOF": pid, then major:minor (hex):inode; "->" marks a waiter.
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK":
            continue
        major, minor, inode = fields[5].split(":")
        if int(inode) == ino and (int(major, 16), int(minor, 16)) == (os.major(dev), os.minor(dev)):
            return int(fields[4])
    return UNKNOWN_PID


def in_use_message(folder: Path, pid: int) -> str:
    """The one line that refuses a run because another holds `folder`."""
    who = f"pid {pid}" if pid != UNKNOWN_PID else "pid unknown: /proc/locks does not name it"
    return (
        f"job.dump_folder '{folder}' is in use by another run ({who}); wait for it to end or stop it, "
        "or choose another --job.dump_folder"
    )


__all__ = ["UNKNOWN_PID", "holder_pid", "in_use_message", "lock_folder", "release_folder"]
