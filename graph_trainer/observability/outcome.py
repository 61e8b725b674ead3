"""The one line a run ends with, when it did not simply finish: diverged, interrupted, or stopped by a failed write.

Each line says what happened, what was kept, and the command that continues (or restarts) the run. The trainer
knows the facts (the step, the latest checkpoint); these functions only word them, so every ending reads alike.
"""

from __future__ import annotations

import errno
import signal
from pathlib import Path

from graph_trainer.runtime.fsutil import WriteError

# What a diverged run should change before it runs again.
DIVERGENCE_FIX = "a lower optimizer.lr, more lr_scheduler.warmup_steps or training.max_norm > 0"


def kept_line(latest: Path | None, latest_step: int | None) -> str:
    """What a stopped run leaves to continue from: its latest checkpoint, or nothing (start again)."""
    if latest is None:
        return "no checkpoint was saved: free space, then start again with --job.overwrite true"
    return (
        f"every earlier checkpoint is kept, the latest {latest} (step {latest_step}): "
        "free space, then continue with --checkpoint.resume"
    )


def write_failed_line(error: WriteError, step: int, kept: str) -> str:
    """A write failed (a full disk, a read-only folder): where, why, when the run stopped, and `kept`."""
    cause = error.strerror or str(error.cause)
    if error.errno in errno.errorcode:
        cause += f" [{errno.errorcode[error.errno]}]"
    where = f"in {error.path}" if error.path.is_dir() else f"{error.path.name} in {error.path.parent}"
    when = f"after step {step}" if step else "before its first step"
    return f"writing {where} failed: {cause}; the run stopped {when} and left no partial file; {kept}"


def diverged_line(reason: str, latest: Path | None, latest_step: int | None) -> str:
    """Training diverged at this step (nothing was saved for it): the reason and where to resume from."""
    if latest is None:
        return f"training diverged: {reason}; no checkpoint was saved; start again with {DIVERGENCE_FIX}"
    # Every checkpoint passed the same checks before it was written, so the latest is good.
    return (
        f"training diverged: {reason}; nothing was saved for it; the last good checkpoint is "
        f"{latest} (step {latest_step}): resume it with --checkpoint.resume and {DIVERGENCE_FIX}"
    )


def interrupted_line(signum: int, step: int, saved: Path | None, resuming: bool) -> str:
    """SIGINT/SIGTERM after `step`: the checkpoint just `saved` (None: checkpointing is off) and how to go on."""
    name = signal.Signals(signum).name
    if saved is None:
        return (
            f"interrupted by {name} after step {step}; checkpointing is off (checkpoint.enable = false), "
            "so this run cannot be continued: start it again with --job.overwrite true"
        )
    again = "the same command again" if resuming else "the same command with --checkpoint.resume"
    return f"interrupted by {name} after step {step}; saved {saved}; to continue, run {again}"


__all__ = ["DIVERGENCE_FIX", "diverged_line", "interrupted_line", "kept_line", "write_failed_line"]
