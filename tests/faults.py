"""A full disk, simulated: the trainer's command line with writes that fail as they do when the disk is full.

    GT_ENOSPC='summary\\.json' python -m tests.faults --job.dump_folder run ...   (the trainer's options)

Every write to a file whose path matches the regular expression `GT_ENOSPC` raises
`OSError(ENOSPC)`, as `write(2)` does on a full disk, after the first `GT_ENOSPC_SKIP` such
files (default 0) were written normally; with `GT_ENOSPC_RANK` set, only in that rank (torchrun's
RANK). The files are the real trainer's: `open`, `io.open` (pathlib, DCP, TensorBoard) and
`os.fdopen` (the atomic writes) hand back a file whose `write` fails; reading is untouched.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import re
import sys
from typing import Any


class _FullDisk:
    """A file opened for writing on a disk with no space left: `write` fails, everything else is the file's."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def writelines(self, lines: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def _install(pattern: re.Pattern[str], skip: int) -> None:
    matched = [0]

    def full(path: Any, mode: str) -> bool:
        if not any(c in mode for c in "wax+") or isinstance(path, int):
            return False
        if not pattern.search(os.fsdecode(os.fspath(path))):
            return False
        matched[0] += 1
        return matched[0] > skip

    def wrap(opener):
        def open_(file, mode="r", *args, **kwargs):
            f = opener(file, mode, *args, **kwargs)
            return _FullDisk(f) if full(file, mode) else f

        return open_

    def fdopen(fd, mode="r", *args, **kwargs):
        f = real_fdopen(fd, mode, *args, **kwargs)
        return _FullDisk(f) if full(os.readlink(f"/proc/self/fd/{fd}"), mode) else f

    real_fdopen = os.fdopen
    builtins.open = io.open = wrap(io.open)
    os.fdopen = fdopen


def main() -> int:
    rank = os.environ.get("GT_ENOSPC_RANK")
    if os.environ.get("GT_ENOSPC") and (rank is None or rank == os.environ.get("RANK", "0")):
        _install(re.compile(os.environ["GT_ENOSPC"]), int(os.environ.get("GT_ENOSPC_SKIP", "0")))
    from graph_trainer import __main__ as cli
    from graph_trainer.runtime.interrupts import unwind_on_sigterm

    unwind_on_sigterm()
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
