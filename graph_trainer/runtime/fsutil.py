"""Crash-safe file writes shared by the metrics and checkpoint components.

A reader (a resumed run, a dashboard, a test harness) must only ever see either
the previous complete file or the new complete file, never a torn one: write to
a temporary file in the same folder (so the rename stays on one filesystem),
fsync it, `os.replace` it over the target (atomic on POSIX), then fsync the
folder so the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

# Temp files start with a dot and end with this suffix, so globs such as
# `step-*.pt` never match a half-written file.
TEMP_SUFFIX = ".tmp"


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entry table to disk (makes a rename inside it durable)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds (Windows) have no equivalent
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def remove_path(path: Path) -> None:
    """Delete a file, or a folder with everything below it (a sharded checkpoint is a folder); absent is fine."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask() sets it, racing other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class WriteError(OSError):
    """Writing `path` failed: `cause` is the OSError the system gave (ENOSPC for a full disk, EDQUOT, EIO).

    Raised by this module's writes and by `writing()`, so that a caller can tell a failed write (the run
    stops and says where and why) from any other OSError (a missing input is the user's mistake).
    """

    def __init__(self, path: Path, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause), str(path))
        self.path = Path(path)
        self.cause = cause


def os_error_behind(error: BaseException) -> OSError | None:
    """The OSError that `error` is, or that caused it: torch.save reports a failed `write` of its file as a
    RuntimeError ("unexpected pos ...") raised while handling the OSError."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Within the block, an OSError (or an error an OSError caused) becomes a `WriteError` naming `path`."""
    try:
        yield
    except WriteError:
        raise
    except Exception as e:
        cause = os_error_behind(e)
        if cause is None:
            raise
        raise WriteError(path, cause) from e


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` atomically: `write(f)` fills a temp file that replaces `path` only once complete.

    If `write` raises (or the process dies), `path` keeps its previous content and
    the temp file is removed (or, after a hard kill, left as `.{name}.*.tmp`). A failure of
    the file system (a full disk) is raised as `WriteError`.
    """
    path = Path(path)
    with writing(path):
        _atomic_write(path, write)


def _atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        # mkstemp creates 0600; give the file the mode open() would (0666 less the umask).
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a UTF-8 text file atomically (see `atomic_write`)."""
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data))
