"""The two checkpoint formats as a folder shows them, and the refusal of the one a job cannot resume.

- single file: `step-{step:08d}.pt`, written by one process or `dp_replicate` (`checkpoint.single_file`);
- sharded: `step-{step:08d}.dcp/`, written by every rank of a job that holds parameters in parts
  (`checkpoint.sharded`).

Both managers ask this module, so neither format's module imports the other's.
"""

from __future__ import annotations

import re
from pathlib import Path

from graph_trainer.errors import UserError

SINGLE_FILE = re.compile(r"^step-(\d{8,})\.pt$")  # group 1 is the step
SHARDED = re.compile(r"^step-(\d{8,})\.dcp$")


def holds_sharded(folder: Path) -> bool:
    """Whether `folder` holds a sharded checkpoint (a `step-*.dcp` folder)."""
    return folder.is_dir() and any(SHARDED.match(p.name) for p in folder.iterdir())


def refuse_other_format(folder: Path, *, sharded: bool) -> None:
    """UserError when `folder` holds checkpoints only in the format this job does not write: a single-file one
    (`step-*.pt`) needs a job of whole state (one process or `dp_replicate`). A sharded one (`step-*.dcp`) any job
    resumes (a job of whole state writes sharded ones into such a folder: `checkpointer.build_checkpointer`), so a
    job of whole state is never refused here."""
    if not folder.is_dir():
        return
    names = sorted(p.name for p in folder.iterdir())
    if sharded and any(SINGLE_FILE.match(n) for n in names):
        raise UserError(
            f"{folder} holds single-file checkpoints (step-*.pt, from one process or "
            "parallelism.dp_replicate), which a parallelism.dp_shard job cannot resume; resume it "
            "without --parallelism.dp_shard, or start a new job.dump_folder"
        )


__all__ = ["SHARDED", "SINGLE_FILE", "holds_sharded", "refuse_other_format"]
