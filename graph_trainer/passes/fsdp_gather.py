"""FSDP gather policy: per unit, the backward either re-gathers its parameters or keeps the forward's gather.

Reads the collective tag (`node_meta.gathered_unit`: written by the parallelism
that gathers parameters, `graph_trainer.distributed.fsdp`, on the nodes of each
unit's all-gather and of the cuts that turn it back into parameters) and the
tracer's `phase`. Reads `parallelism.fsdp_reshard_after_forward`. Writes torch's
`node.meta["recompute"]` on those forward nodes, once:
- re-gather (FSDP's reshard-after-forward): `MUST_RECOMPUTE`, together with
  every view of a gathered parameter (`t`, `view`, ...) so that no forward
  view keeps the gathered storage alive; `remat` then copies the all-gather
  (and its wait and cuts) just before the first backward use;
- keep: `MUST_SAVE`, so the backward reads the forward's full parameters.
The gather nodes carry no layer id, so activation checkpointing never tags
them, and `remat` acts on tags without re-deciding them: the collective counts
of the final graph follow this pass (tests/distributed/test_fsdp.py counts them).

Policies (`parallelism.fsdp_reshard_after_forward`, torchtitan's names):
`default` re-gathers the layers and keeps the root unit (embeddings, final
norm, output projection: the backward needs them first, right away; under
pipeline parallelism its parts, one unit per module, likewise),
`always` re-gathers every unit, `never` keeps every unit.

The graph's ops are unchanged, so the pass preserves numerics bitwise; the
re-gathered values are the same bytes gathered again.
"""

from __future__ import annotations

import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from graph_trainer.tracer import node_meta
from graph_trainer.tracer.graph_utils import is_view

POLICIES = ("default", "always", "never")


def regathers(policy: str, in_layer: bool) -> bool:
    """Whether `policy` makes the backward gather a unit again: one of the layers (`in_layer`), or the root (or a
    part of it: a unit outside the layers)."""
    return policy == "always" or (policy == "default" and in_layer)


def gather_decisions(gm: torch.fx.GraphModule, policy: str) -> dict[torch.fx.Node, bool]:
    """Each FSDP gather node of the forward (and each view of a re-gathered one) -> whether `policy` re-gathers it
    in the backward (True) or keeps the forward's (False): what `tag_fsdp_gathers` writes, and what the budget
    policy's model reads so that its peak is the final graph's."""
    if policy not in POLICIES:
        raise ValueError(f"unknown FSDP gather policy {policy!r}; expected one of {POLICIES}")
    decided: dict[torch.fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if not node_meta.is_forward(node):
            continue
        if node_meta.gathered_unit(node) is not None:
            decided[node] = regathers(policy, node_meta.collective(node)["layer"] is not None)
        elif is_view(node) and any(decided.get(a) for a in node.all_input_nodes):
            decided[node] = True
    return decided


def tag_fsdp_gathers(gm: torch.fx.GraphModule, policy: str) -> torch.fx.GraphModule:
    """Tag each FSDP unit's forward gather nodes save or recompute per `policy` (see the module docstring)."""
    for node, again in gather_decisions(gm, policy).items():
        if node_meta.gathered_unit(node) is not None:
            node.meta[node_meta.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE if again else CheckpointPolicy.MUST_SAVE
            node.meta[node_meta.AC_GRAPH_ID] = 0
        else:  # a view of a re-gathered parameter: recomputed with it, whatever the memory policy said
            node.meta[node_meta.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta.setdefault(node_meta.AC_GRAPH_ID, 0)
    return gm


__all__ = ["POLICIES", "gather_decisions", "regathers", "tag_fsdp_gathers"]
