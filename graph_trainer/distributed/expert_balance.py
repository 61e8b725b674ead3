"""The load-balancing counts of a mixture of experts, summed over the data-parallel ranks.

DeepSeek-V3's balancing bias moves each step from the tokens-per-expert counts (models/deepseek_v3: a
router's `tokens_per_expert` buffer and its `count_reduce` hook). Ranks that read different data count
different tokens: without a sum over them each rank's bias would drift on its own tokens and the replicas
of the (unsharded) bias would silently disagree. This parallelism sets every router's `count_reduce` to a
traceable all-reduce over the data-parallel ranks, so the bias update reads the global counts and stays
equal on every rank (and so do the logged counts, `tokens_per_expert`). It runs once per step with the bias
update, after the gradients (every micro-batch's, with accumulation: the counts are summed over micro-batches
first), as `_c10d_functional.all_reduce` + `wait_tensor` nodes of the graph holding the update, tagged
`expert_count_reduce`; eagerly it runs the same ops, so the eager and traced steps agree bitwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from graph_trainer.distributed.mesh import DATA_PARALLEL, Mesh, ring
from graph_trainer.distributed.parallelism import Parallelism
from graph_trainer.tracer import node_meta

KIND = "expert_balance"


@dataclasses.dataclass(frozen=True)
class CountSum:
    """A router's `count_reduce`: its counts summed over the ranks of each group in `group_names` in turn (one
    traceable all-reduce each). Over two data-parallel dimensions (HSDP: dp_shard, then dp_replicate) the sums
    over the shards' sums are the sums over every data rank; the counts are whole numbers, so exactly."""

    group_names: tuple[str, ...]

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        c10d = torch.ops._c10d_functional
        with fx_traceback.annotate(
            {node_meta.COLLECTIVE: node_meta.collective_tag(KIND, node_meta.EXPERT_COUNT_REDUCE)}
        ):
            for name in self.group_names:
                counts = c10d.wait_tensor(c10d.all_reduce(counts, "sum", name))
            return counts


class ExpertBalance(Parallelism):
    """Sets the routers' `count_reduce` (see the module docstring); nothing else to do."""

    kind = KIND
    label = "MoE balancing counts"

    @classmethod
    def ring(cls, degrees: Mapping[str, int]) -> tuple[int, int]:
        """The counts' all-reduce is priced on the innermost data-parallel ring (the shards'): the cost model's
        ring for a kind with no mesh dimension of its own. Under HSDP a second, smaller one over the replicas
        follows (`CountSum`); a few hundred bytes a layer, it is left out."""
        return ring(DATA_PARALLEL[-1], degrees)

    @classmethod
    def apply(cls, model: nn.Module, mesh: Mesh, cfg: Any, plan: Any) -> ExpertBalance | None:
        """None unless the model has routers and several ranks read different data: then the counts are summed
        over every data-parallel dimension the job uses (innermost first)."""
        routers = [m for m in model.modules() if hasattr(m, "count_reduce")]
        if not routers or mesh.data_size == 1:
            return None
        used = [d for d in reversed(DATA_PARALLEL) if mesh.size(d) > 1]
        reduce = CountSum(tuple(mesh.group(d).group_name for d in used))
        for router in routers:
            router.count_reduce = reduce
        return cls()
