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
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from graph_trainer.distributed.mesh import DATA_PARALLEL, Mesh
from graph_trainer.distributed.parallelism import Parallelism
from graph_trainer.errors import UserError
from graph_trainer.tracer import node_meta

KIND = "expert_balance"


@dataclasses.dataclass(frozen=True)
class CountSum:
    """A router's `count_reduce`: its counts summed over the ranks of `group_name` (a traceable all-reduce)."""

    group_name: str

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        c10d = torch.ops._c10d_functional
        with fx_traceback.annotate(
            {node_meta.COLLECTIVE: node_meta.collective_tag(KIND, node_meta.EXPERT_COUNT_REDUCE)}
        ):
            return c10d.wait_tensor(c10d.all_reduce(counts, "sum", self.group_name))


class ExpertBalance(Parallelism):
    """Sets the routers' `count_reduce` (see the module docstring); nothing else to do."""

    kind = KIND
    label = "MoE balancing counts"

    @classmethod
    def apply(cls, model: nn.Module, mesh: Mesh, cfg: Any, plan: Any) -> ExpertBalance | None:
        """None unless the model has routers and several ranks read different data.

        Raises:
            UserError: the ranks read different data over two dimensions (HSDP), whose counts it does not sum yet:
                each rank's bias would drift on its own tokens, silently.
        """
        routers = [m for m in model.modules() if hasattr(m, "count_reduce")]
        if not routers or mesh.data_size == 1:
            return None
        used = [d for d in DATA_PARALLEL if mesh.size(d) > 1]
        if len(used) != 1:
            raise UserError(
                f"model {model.__class__.__name__} balances its experts from per-rank token counts, which are not yet "
                f"summed over the {mesh.data_size} data-parallel ranks of this layout ({' x '.join(used)}); "
                "train it with parallelism.dp_shard or parallelism.dp_replicate alone, or on one process"
            )
        reduce = CountSum(mesh.group(used[0]).group_name)
        for router in routers:
            router.count_reduce = reduce
        return cls()
