"""Replicated data parallelism (`parallelism.dp_replicate`): a full copy of the model on every rank.

After the backward each gradient is averaged over the replicas, so all ranks take the same optimizer step and
stay identical. The averaging uses traceable functional collectives
(`torch.distributed._functional_collectives`): inside the traced step they become
`_c10d_functional.all_reduce` + `wait_tensor` nodes of the one step graph, tagged as this parallelism's
gradient reductions; eagerly they run the same ops, so eager and traced steps agree bitwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback

from graph_trainer.distributed.mesh import Mesh
from graph_trainer.distributed.parallelism import Parallelism, mean_count_over
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import GradReduce

KIND = "dp_replicate"


@dataclasses.dataclass(frozen=True)
class GradAverager:
    """`GradReduce` hook: each gradient all-reduced (sum) over `group`, then divided by the world size.

    One all-reduce per gradient (no bucketing). Sum-then-divide rather than the
    "avg" reduce op so that every backend (gloo, nccl) runs the same arithmetic.
    """

    group: dist.ProcessGroup
    world_size: int

    def __call__(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch.distributed._functional_collectives as funcol  # absent from builds without distributed

        # Under make_fx the functional all_reduce is traced with its wait_tensor; eagerly
        # the division waits on the AsyncCollectiveTensor it returns.
        with fx_traceback.annotate({node_meta.COLLECTIVE: node_meta.collective_tag(KIND, node_meta.GRAD_REDUCE)}):
            return [funcol.all_reduce(g, "sum", self.group) / self.world_size for g in grads]


class Replicate(Parallelism):
    """Full copies on the `dp_replicate` ranks; gradients averaged over them after the backward (with gradient
    accumulation, once per step, on the accumulated gradients: they are whole on every rank anyway)."""

    kind = KIND
    label = "replicated"
    mesh_dim = "dp_replicate"

    def __init__(self, group: dist.ProcessGroup, world_size: int):
        self.averager = GradAverager(group, world_size)

    @classmethod
    def apply(cls, model: torch.nn.Module, mesh: Mesh, cfg: Any, plan: Any) -> Replicate | None:
        """Replication over the mesh's `dp_replicate` dimension; None when its degree is 1."""
        if mesh.size(KIND) == 1:
            return None
        return cls(mesh.group(KIND), mesh.size(KIND))

    def grad_reduce(self) -> GradReduce:
        return self.averager

    def count_reduce(self):
        return mean_count_over(self.averager.group, self.averager.world_size)


__all__ = ["GradAverager", "Replicate"]
