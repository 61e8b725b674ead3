"""Applying a job's parallelisms to its model: the one place that lists them, in the order they apply.

    parallel = parallelize_model(model, mesh, cfg, spec.parallel_plan)

A new parallelism is a module in this package whose class implements `Parallelism` and has an
`apply(model, mesh, cfg, plan)` that returns None when the job does not use it; add it to `PARALLELISMS`.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from graph_trainer.distributed.expert_balance import ExpertBalance
from graph_trainer.distributed.expert_parallel import ExpertParallel
from graph_trainer.distributed.fsdp import FSDP
from graph_trainer.distributed.mesh import Mesh
from graph_trainer.distributed.parallelism import Apply, ParallelModel, parallelize
from graph_trainer.distributed.replicate import Replicate
from graph_trainer.distributed.tp import TensorParallel

# Expert parallelism comes first: it splits the routed experts itself, and FSDP leaves what it holds alone.
# Replication changes no parameter; its gradient hook (the average over the replicas) must run before TP's, which
# sums the norms' gradients over tp and keeps them for the clip norm: kept before the average, they would differ
# between the replicas, and so would the clip factor (dp_replicate x tp). Tensor parallelism splits parameters
# itself; fully sharded data parallelism then shards what the others leave (FSDP shards the TP blocks, as FSDP2 on
# top of TP does; its reduce-scatters run in the backward, before any gradient hook). The norm hooks chain in this
# order too: TP's counts its replicated gradients once on this rank's FSDP shards, before FSDP sums over dp_shard.
# The MoE balancing counts are summed over whichever data-parallel dimension is used.
PARALLELISMS: tuple[Apply, ...] = (
    ExpertParallel.apply,
    Replicate.apply,
    TensorParallel.apply,
    FSDP.apply,
    ExpertBalance.apply,
)


def parallelize_model(model: nn.Module, mesh: Mesh, cfg: Any, plan: Any) -> ParallelModel:
    """`model` with every parallelism the job uses applied in place (none for one process)."""
    return parallelize(model, mesh, cfg, plan, PARALLELISMS)


__all__ = ["PARALLELISMS", "parallelize_model"]
