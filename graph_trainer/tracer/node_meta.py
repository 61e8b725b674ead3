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

CUSTOM = "custom"  # torch.fx.traceback.annotate() writes here
PHASE = "phase"
MODULE_FQN = "module_fqn"
LAYER_ID = "layer_id"
RANDOM = "random"  # True on ops that draw from an RNG: they must run exactly once
REMATERIALIZED = "rematerialized"  # True on the backward copy of a recomputed forward op (passes.remat)
FSDP_UNIT = (
    "fsdp_unit"  # name of the FSDP unit whose parameter all-gather made the node (graph_trainer.distributed.fsdp)
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


def fsdp_unit(node: torch.fx.Node) -> str | None:
    """The FSDP unit ('' for the root, else a layer FQN) whose parameter gather made the node, or None."""
    return node.meta.get(CUSTOM, {}).get(FSDP_UNIT)


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
