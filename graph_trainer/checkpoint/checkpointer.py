"""Which checkpoint format a job writes: decided by whether its parallelisms hold parameters in parts, or by the
folder it continues."""

from __future__ import annotations

from pathlib import Path

import torch

from graph_trainer.checkpoint.formats import holds_sharded
from graph_trainer.checkpoint.single_file import CheckpointManager
from graph_trainer.distributed.parallelism import ParallelModel


def build_checkpointer(
    folder: Path,
    parallel: ParallelModel,
    optimizer: torch.optim.Optimizer,
    *,
    enable: bool,
    interval: int,
    keep_latest_k: int,
) -> CheckpointManager:
    """Sharded state: a DCP folder every rank writes its parts to. Whole state: one file, written by rank 0 (the
    weights are the same on every rank). A job of whole state whose `folder` already holds sharded checkpoints (a
    pipeline's or FSDP's, resumed in one process) reads them with DCP and goes on writing them: DCP reshards the
    logical tensors to whole ones, and one folder keeps one format."""
    if parallel.shards_state or holds_sharded(folder):
        # Imported here: torch.distributed.checkpoint (and DTensor with it) is 1.2-1.8 s of import on a 2-core CPU,
        # which every launch of a job that keeps whole state (one process, or dp_replicate alone) would otherwise pay.
        from graph_trainer.checkpoint.sharded import ShardedCheckpointManager

        return ShardedCheckpointManager(
            folder,
            parallel=parallel,
            optimizer=optimizer,
            enable=enable,
            interval=interval,
            keep_latest_k=keep_latest_k,
        )
    return CheckpointManager(
        folder, enable=enable and parallel.mesh.rank == 0, interval=interval, keep_latest_k=keep_latest_k
    )


__all__ = ["build_checkpointer"]
