"""The step's communication read off its final graph: bytes per rank by parallelism and collective.

An analysis, not a pass: it reads the collective tag (`node_meta.collective`: kind, role, layer) and each
collective's fake value, and changes nothing. Counted once per collective node of the final graph, so what
`remat` copied into the backward (an FSDP re-gather, a tensor-parallel re-gather under activation
checkpointing) counts as the traffic it is.

The bytes of a collective are its whole tensor: the gathered result of an all-gather, the input of a
reduce-scatter, the tensor of an all-reduce. A ring moves (n-1)/n of that per rank for an all-gather or a
reduce-scatter, and 2(n-1)/n for an all-reduce.
"""

from __future__ import annotations

import collections

import torch.fx

from graph_trainer.tracer import node_meta
from graph_trainer.tracer.graph_utils import is_collective, traffic_kind


def _payload(node: torch.fx.Node) -> int:
    """The whole tensor's bytes (see the module docstring)."""
    kind = traffic_kind(node)
    t = node.args[0].meta["val"] if kind == "reduce_scatter" else node.meta["val"]
    return t.numel() * t.element_size()


def communication_bytes(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Bytes per step per rank, by '<parallelism> <collective>' (e.g. 'tp all_gather', 'fsdp reduce_scatter',
    'fsdp all_reduce'), sorted by name. An untagged collective counts under 'untagged'."""
    totals: dict[str, int] = collections.Counter()
    for node in gm.graph.nodes:
        if is_collective(node):
            tag = node_meta.collective(node)
            totals[f"{tag['kind'] if tag else 'untagged'} {traffic_kind(node)}"] += _payload(node)
    return dict(sorted(totals.items()))


def communication_by_layer(gm: torch.fx.GraphModule) -> dict[tuple[int | None, str, str, str], tuple[int, int]]:
    """(layer, parallelism, collective, role) -> (how many, bytes): one step's collectives per layer."""
    out: dict[tuple, list[int]] = {}
    for node in gm.graph.nodes:
        tag = node_meta.collective(node) if is_collective(node) else None
        if tag is not None:
            entry = out.setdefault((tag["layer"], tag["kind"], traffic_kind(node), tag["role"]), [0, 0])
            entry[0] += 1
            entry[1] += _payload(node)
    return {k: (n, b) for k, (n, b) in out.items()}


__all__ = ["communication_bytes", "communication_by_layer"]
