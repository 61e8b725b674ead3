"""Rematerialization: act on the save/recompute tags, once, on the whole-step graph.

Reads `node.meta["recompute"]` (a `CheckpointPolicy`, written by the activation
checkpointing passes) and the tracer's `phase` tag, which marks the one
contiguous backward region. Every forward op tagged recompute that the
backward needs is copied just before its first backward use, together with
the recompute-tagged ops it depends on (in forward order); untagged and
saved ops are read from the forward. Originals nothing uses any more are then
removed (dead-code elimination keeps in-place and random ops). This is the
algorithm of torch's `remat_using_tags_for_fwd_loss_bwd_graph`, written on a
bare `fx.Graph` so the memory-budget search can probe many choices without
regenerating Python code each time.

The copies carry `custom["rematerialized"] = True` and no recompute tag, and no
original is used by the backward any more, so running remat again changes
nothing: the decisions are final. The copies get fresh fake values (their own
storages) so the memory estimate sees them as new tensors. Recomputed ops are
deterministic (random and in-place ops are never tagged recompute), so the
pass preserves numerics bitwise. The step keeps its flat calling convention
and outputs.
"""

from __future__ import annotations

import copy
import types

import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from graph_trainer.passes.graph_utils import graph_module, refresh_duplicated_values
from graph_trainer.passes.memory_estimate import estimate_peak_memory
from graph_trainer.tracer import node_meta

_RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _must_recompute(node: torch.fx.Node) -> bool:
    return node.meta.get(node_meta.RECOMPUTE) in _RECOMPUTE and node_meta.is_forward(node)


def remat_graph(graph: torch.fx.Graph) -> torch.fx.Graph | None:
    """A new graph with recomputed ops duplicated into the backward, or None when nothing needs it.

    Raises:
        ValueError: the backward region is not one contiguous run of nodes.
    """
    nodes = list(graph.nodes)
    bwd = [i for i, n in enumerate(nodes) if node_meta.is_backward(n)]
    if not bwd or not any(_must_recompute(a) for i in bwd for a in nodes[i].all_input_nodes):
        return None
    start, end = bwd[0], bwd[-1] + 1
    if len(bwd) != end - start:
        raise ValueError("remat needs one contiguous backward region (custom['phase'] == 'backward')")
    order = {n: i for i, n in enumerate(nodes)}
    new = torch.fx.Graph()
    new._codegen = copy.copy(graph._codegen)  # keep the traced calling convention
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    recomputed: dict[torch.fx.Node, torch.fx.Node] = {}

    def from_forward(x: torch.fx.Node) -> torch.fx.Node:
        return env[x]

    def in_backward(x: torch.fx.Node) -> torch.fx.Node:
        return recomputed.get(x) or env[x]

    for n in nodes[:start]:
        env[n] = new.node_copy(n, from_forward)
    for n in nodes[start:end]:
        deps: set[torch.fx.Node] = set()
        stack = list(n.all_input_nodes)
        while stack:
            d = stack.pop()
            if d in deps or d in recomputed or not _must_recompute(d):
                continue
            deps.add(d)
            stack.extend(d.all_input_nodes)
        for d in sorted(deps, key=order.__getitem__):
            dup = new.node_copy(d, in_backward)
            dup.name = f"{d.name}_recomputed"
            dup.meta.pop(node_meta.RECOMPUTE, None)
            custom = dict(dup.meta.get(node_meta.CUSTOM, {}))  # shared with the original: copy before writing
            custom[node_meta.REMATERIALIZED] = True
            dup.meta[node_meta.CUSTOM] = custom
            recomputed[d] = dup
        env[n] = new.node_copy(n, in_backward)
    for n in nodes[end:]:
        env[n] = new.node_copy(n, from_forward)
    new.eliminate_dead_code()
    refresh_duplicated_values(new)
    return new


def rematerialize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Duplicate recomputed forward ops into the backward; a new GraphModule (or `gm` if nothing is tagged)."""
    new = remat_graph(gm.graph)
    if new is None:
        return gm
    return graph_module(gm, new)


def peak_after_remat(gm: torch.fx.GraphModule, input_categories: list[str] | None = None) -> int:
    """Estimated peak of `gm` once its current tags are rematerialized; `gm` itself is not changed.

    How the tagging passes compare candidate decisions before committing to one.
    """
    graph = remat_graph(gm.graph)
    # The estimate reads only `.graph`; skipping GraphModule saves a Python codegen per probe.
    target = gm if graph is None else types.SimpleNamespace(graph=graph)
    return estimate_peak_memory(target, input_categories=input_categories).peak_bytes
