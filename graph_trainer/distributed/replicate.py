"""Replicated data parallelism (`parallelism.dp_replicate`): a full copy of the model on every rank.

After the backward each gradient is averaged over the replicas, so all ranks take the same optimizer step and
stay identical. The averaging uses traceable functional collectives
(`torch.distributed._functional_collectives`): inside the traced step they become
`_c10d_functional.all_reduce` + `wait_tensor` nodes of the one step graph, tagged as this parallelism's
gradient reductions and as ops of their parameter's module and block (so the blocks of a deep model stay
identical and its plan depth-free); eagerly they run the same ops, so eager and traced steps agree bitwise.

With `parallelism.dp_shard` too (HSDP: replicas of a sharded model), the gradients it receives are the FSDP
shards, already averaged over dp_shard by the backward's reduce-scatters: it averages those shards over the
replicas, each element once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback

from graph_trainer.distributed.mesh import Mesh
from graph_trainer.distributed.parallelism import (
    MicroSteps,
    Owner,
    Parallelism,
    gradient_owners,
    mean_count_over,
    owned_by,
)
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import GradReduce

KIND = "dp_replicate"


@dataclasses.dataclass(frozen=True)
class GradAverager:
    """`GradReduce` hook: each gradient all-reduced (sum) over `group`, then divided by the world size.

    One all-reduce per gradient (no bucketing); a None gradient (a parameter this rank's pipeline stage does not
    hold) stays None. Sum-then-divide rather than the
    "avg" reduce op so that every backend (gloo, nccl) runs the same arithmetic.
    `owners[i]` is gradient i's parameter's module and block, which its reduction is tagged with.
    """

    group: dist.ProcessGroup
    world_size: int
    owners: tuple[Owner, ...]

    def __call__(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch.distributed._functional_collectives as funcol  # absent from builds without distributed

        # Under make_fx the functional all_reduce is traced with its wait_tensor; eagerly
        # the division waits on the AsyncCollectiveTensor it returns.
        averaged = []
        for g, owner in zip(grads, self.owners, strict=True):
            if g is None:  # a parameter another pipeline stage holds: its peers over the replicas hold it too
                averaged.append(None)
                continue
            tag = node_meta.collective_tag(KIND, node_meta.GRAD_REDUCE, layer=owner[1])
            with fx_traceback.annotate({node_meta.COLLECTIVE: tag, **owned_by(owner)}):
                averaged.append(funcol.all_reduce(g, "sum", self.group) / self.world_size)
        return averaged


class Replicate(Parallelism):
    """Full copies on the `dp_replicate` ranks; gradients averaged over them after the backward (with gradient
    accumulation, once per step, on the accumulated gradients: they are whole on every rank anyway)."""

    kind = KIND
    label = "replicated"
    mesh_dim = "dp_replicate"
    screened_as = "left_out"

    def __init__(self, group: dist.ProcessGroup, world_size: int, owners: list[Owner]):
        self.averager = GradAverager(group, world_size, tuple(owners))

    @classmethod
    def apply(cls, model: torch.nn.Module, mesh: Mesh, cfg: Any, plan: Any) -> Replicate | None:
        """Replication over the mesh's `dp_replicate` dimension; None when its degree is 1."""
        if mesh.size(KIND) == 1:
            return None
        return cls(mesh.group(KIND), mesh.size(KIND), gradient_owners(model, plan.layers))

    @classmethod
    def reference_comm(cls, degrees: Mapping[str, int], gradient_bytes: int) -> dict[str, int]:
        """The gradients' all-reduce over the replicas, once a step."""
        return {f"{KIND} all_reduce": gradient_bytes} if degrees.get(KIND, 1) > 1 else {}

    @classmethod
    def across_micro_steps(
        cls, degrees: Mapping[str, int], options: Mapping[str, Any], parameter_bytes: int
    ) -> MicroSteps:
        """The replicas average the accumulated gradients once a step."""
        return MicroSteps(once_per_step=(f"{KIND} all_reduce",)) if degrees.get(KIND, 1) > 1 else MicroSteps()

    def grad_reduce(self) -> GradReduce:
        return self.averager

    def count_reduce(self):
        return mean_count_over(self.averager.group, self.averager.world_size)


__all__ = ["GradAverager", "Replicate"]
