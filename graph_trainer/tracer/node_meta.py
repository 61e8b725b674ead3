"""The node-metadata contract between the tracer and the graph passes.

Every key that one stage writes and another reads is named here, once, and read
through these helpers. The tracer writes `node.meta["custom"]` (phase, module
FQN, layer id); the activation-checkpointing passes write torch's own
`node.meta["recompute"]` and `node.meta["ac_graph_id"]`, which
`torch._functorch`'s rematerialization reads. `written_input` reads what every
stage needs to know of an op's aliasing: which input an in-place op returns.
"""

from __future__ import annotations

from typing import Any

import torch.fx

from graph_trainer.loss import LOSS_CHUNK

CUSTOM = "custom"  # torch.fx.traceback.annotate() writes here
PHASE = "phase"
MODULE_FQN = "module_fqn"
LAYER_ID = "layer_id"
RANDOM = "random"  # True on ops that draw from an RNG: they must run exactly once
REMATERIALIZED = "rematerialized"  # True on the backward copy of a recomputed forward op (passes.remat)
# On the nodes FSDP's prefetch moved up (passes.fsdp_prefetch): the unit of the gather they now follow ("" the root
# unit), so that a plan reads them where they run, in that unit's block, not in their own (plan.step_plan).
PREFETCHED_AFTER = "prefetched_after"
# On every node a parallelism made for one of its collectives (the collective itself, its wait, the buffers
# it fills and the cuts of its result): {"kind": who made it, "role": what it is for, "unit": which group of
# parameters ("" the root unit; None if none), "layer": the transformer layer it serves (None: outside them)}.
# The node's phase is its PHASE, as for every node. Written by graph_trainer.distributed, read by the passes.
COLLECTIVE = "collective"
PARAM_GATHER = "param_gather"  # gathers a unit's parameters for the forward (FSDP); the backward may gather again
GRAD_REDUCE = "grad_reduce"  # reduces gradients over data-parallel ranks (a reduce-scatter or an all-reduce)
NORM_REDUCE = "norm_reduce"  # sums the squared gradient norm over the ranks that hold shards of the gradients
SEQ_GATHER = "seq_gather"  # all-gathers activations along the sequence before a tensor-parallel region (TP)
SEQ_SCATTER = "seq_scatter"  # reduce-scatters a row-parallel region's partial sums along the sequence (TP)
LOSS_REDUCE = "loss_reduce"  # all-reduces per-token statistics of a vocabulary-parallel loss (TP)
EXPERT_COUNT_REDUCE = (
    "expert_count_reduce"  # sums a mixture of experts' tokens-per-expert counts over the data-parallel ranks
)
DISPATCH = "dispatch"  # sends each token's rows to the ranks holding its experts (expert parallelism's all-to-all)
COMBINE = "combine"  # brings the experts' outputs back to the tokens' ranks (the reverse all-to-all)
ROLES = (
    PARAM_GATHER,
    GRAD_REDUCE,
    NORM_REDUCE,
    SEQ_GATHER,
    SEQ_SCATTER,
    LOSS_REDUCE,
    EXPERT_COUNT_REDUCE,
    DISPATCH,
    COMBINE,
)

FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"
PHASES = (FORWARD, BACKWARD, OPTIMIZER)

RECOMPUTE = "recompute"  # a torch.utils.checkpoint.CheckpointPolicy
AC_GRAPH_ID = "ac_graph_id"  # int region id; remat never moves ops across regions
SEQ_NR = "seq_nr"  # autograd sequence number; links a forward op to its backward ops


def custom(node: torch.fx.Node) -> dict[str, Any]:
    """The node's `meta["custom"]` dict (created empty if missing)."""
    return node.meta.setdefault(CUSTOM, {})


def phase(node: torch.fx.Node) -> str | None:
    """'forward', 'backward' or 'optimizer' for op nodes of a traced step; None for inputs/outputs."""
    return node.meta.get(CUSTOM, {}).get(PHASE)


def module_fqn(node: torch.fx.Node) -> str:
    """Fully qualified name of the innermost module that produced the node ('' for the root)."""
    return node.meta.get(CUSTOM, {}).get(MODULE_FQN, "")


def loss_chunk(node: torch.fx.Node) -> int | None:
    """Index of the chunk of a chunked loss the node computes (`graph_trainer.loss.LOSS_CHUNK`), or None."""
    return node.meta.get(CUSTOM, {}).get(LOSS_CHUNK)


def layer_id(node: torch.fx.Node) -> int | None:
    """Index of the transformer layer the node belongs to, or None outside the layers."""
    return node.meta.get(CUSTOM, {}).get(LAYER_ID)


def is_backward(node: torch.fx.Node) -> bool:
    return phase(node) == BACKWARD


def is_forward(node: torch.fx.Node) -> bool:
    return phase(node) == FORWARD


def is_rematerialized(node: torch.fx.Node) -> bool:
    """True for a forward op copied into the backward by rematerialization."""
    return bool(node.meta.get(CUSTOM, {}).get(REMATERIALIZED))


def collective_tag(kind: str, role: str, unit: str | None = None, layer: int | None = None) -> dict[str, Any]:
    """The `COLLECTIVE` annotation of a parallelism's collective (see the key's comment)."""
    if role not in ROLES:
        raise ValueError(f"unknown collective role {role!r}; expected one of {ROLES}")
    return {"kind": kind, "role": role, "unit": unit, "layer": layer}


def collective(node: torch.fx.Node) -> dict[str, Any] | None:
    """The node's `COLLECTIVE` annotation, or None for a node no parallelism made."""
    return node.meta.get(CUSTOM, {}).get(COLLECTIVE)


def collective_kind(node: torch.fx.Node) -> str | None:
    """The parallelism ('fsdp', 'dp_replicate', ...) whose collective made the node, or None."""
    tag = collective(node)
    return tag["kind"] if tag is not None else None


def gathered_unit(node: torch.fx.Node) -> str | None:
    """The unit ('' for the root, else e.g. a layer FQN) whose parameter gather made the node, or None."""
    tag = collective(node)
    return tag["unit"] if tag is not None and tag["role"] == PARAM_GATHER else None


def prefetched_after(node: torch.fx.Node) -> str | None:
    """The unit whose gather the node was moved up to follow by FSDP's prefetch (`PREFETCHED_AFTER`), or None."""
    return node.meta.get(CUSTOM, {}).get(PREFETCHED_AFTER)


def is_random(node: torch.fx.Node) -> bool:
    """True for ops that consume the RNG; recomputing one would change numerics."""
    return bool(node.meta.get(CUSTOM, {}).get(RANDOM))


def written_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The argument an op writes into and returns (`mul_`'s self, an `out=` tensor), or None."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.returns:
        return None
    alias = schema.returns[0].alias_info
    if alias is None or not alias.is_write:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set == alias.before_set:
            value = node.kwargs.get(arg.name) if arg.kwarg_only else (node.args[i] if i < len(node.args) else None)
            return value if isinstance(value, torch.fx.Node) else None
    return None
