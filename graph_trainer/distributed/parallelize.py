"""Applying a job's parallelisms to its model: the one place that lists them, in the order they apply.

    parallel = parallelize_model(model, mesh, cfg, spec.parallel_plan)

A new parallelism is a module in this package whose class implements `Parallelism`: its `apply(model, mesh, cfg,
plan)` returns None when the job does not use it, and its `mesh_dim` names the mesh dimension its collectives run
over (the cost model's rings come from it: `collective_rings`); add the class to `PARALLELISMS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn as nn

from graph_trainer.distributed.expert_balance import ExpertBalance
from graph_trainer.distributed.expert_parallel import ExpertParallel
from graph_trainer.distributed.fsdp import FSDP
from graph_trainer.distributed.mesh import Mesh
from graph_trainer.distributed.parallelism import Parallelism, ParallelModel, parallelize
from graph_trainer.distributed.pipeline import PipelineParallel
from graph_trainer.distributed.replicate import Replicate
from graph_trainer.distributed.tp import TensorParallel

# Replication changes no parameter; its gradient hook (the average over the replicas) must run before TP's, which
# sums the norms' gradients over tp and keeps them for the clip norm: kept before the average, they would differ
# between the replicas, and so would the clip factor (dp_replicate x tp). Pipeline parallelism removes other stages'
# parameters from a rank's model: after replication, whose averaging hook is built for the whole model (it leaves a
# parameter this rank does not hold alone), before the others, which then apply to the rank's model and to the
# whole traced copy pp makes alike. Expert parallelism splits the routed experts itself, and FSDP leaves what it
# holds alone. Tensor parallelism splits parameters itself; fully sharded data parallelism then shards what the
# others leave (FSDP shards the TP blocks, as FSDP2 on top of TP does; its reduce-scatters run in the backward,
# before any gradient hook). The norm hooks chain in this order too: TP's counts its replicated gradients once on
# this rank's FSDP shards, before FSDP sums over dp_shard. The MoE balancing counts are summed over whichever
# data-parallel dimension is used.
PARALLELISMS: tuple[type[Parallelism], ...] = (
    Replicate,
    PipelineParallel,
    ExpertParallel,
    TensorParallel,
    FSDP,
    ExpertBalance,
)


def parallelize_model(model: nn.Module, mesh: Mesh, cfg: Any, plan: Any) -> ParallelModel:
    """`model` with every parallelism the job uses applied in place (none for one process)."""
    return parallelize(model, mesh, cfg, plan, PARALLELISMS)


def refusal(block: nn.Module, plan: Any, degrees: Mapping[str, int], seq_len: int) -> str | None:
    """The first registered parallelism's reason not to split the model at `degrees` (`Parallelism.allows`; `block`
    is the model with one block, on meta), None when every one allows them: what the search skips a layout for, in
    the words the trainer refuses it with."""
    return next((why for p in PARALLELISMS if (why := p.allows(block, plan, degrees, seq_len)) is not None), None)


def config_refusal(cfg: Any, n_layers: int) -> str | None:
    """The first reason of a parallelism the job `cfg` uses (its degree above 1) not to run with the job's other
    options (`Parallelism.refuses`), None when none refuses: the search skips a candidate for it."""
    used = [p for p in PARALLELISMS if p.mesh_dim and getattr(cfg.parallelism, p.mesh_dim, 1) > 1]
    return next((why for p in used if (why := p.refuses(cfg, n_layers)) is not None), None)


def collective_rings(degrees: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """Each parallelism's collective kind -> (size, stride) of its rings in a layout of `degrees`, from the mesh
    dimension it declares, or its own `ring` (the cost model prices each collective on its ring)."""
    return {p.kind: p.ring(degrees) for p in PARALLELISMS if p.kind}


__all__ = ["PARALLELISMS", "collective_rings", "config_refusal", "parallelize_model", "refusal"]
