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

The pass rewrites its graph in place (`rematerialize`); the probes get a new graph and leave theirs
unchanged (`remat_graph`, `peak_after_remat`): the same nodes, names and values either way.

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
from torch.fx.graph import _Namespace
from torch.fx.node import map_arg
from torch.utils.checkpoint import CheckpointPolicy

from graph_trainer.tracer import node_meta
from graph_trainer.tracer.graph_utils import eliminate_dead_code, refresh_duplicated_values
from graph_trainer.tracer.memory_estimate import estimate_peak_memory

_RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _must_recompute(node: torch.fx.Node) -> bool:
    return node.meta.get(node_meta.RECOMPUTE) in _RECOMPUTE and node_meta.is_forward(node)


def _backward_region(graph: torch.fx.Graph) -> tuple[list[torch.fx.Node], int, int] | None:
    """(the graph's nodes, first backward index, one past the last), or None when no backward op reads a
    forward op tagged recompute (nothing to do).

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
    return nodes, start, end


def _new_deps(
    node: torch.fx.Node, recomputed: dict[torch.fx.Node, torch.fx.Node], order: dict[torch.fx.Node, int]
) -> list[torch.fx.Node]:
    """The recompute-tagged forward ops `node` needs, directly or through each other, that have no copy yet, in
    forward order (the order their copies are made in)."""
    deps: set[torch.fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        d = stack.pop()
        if d in deps or d in recomputed or not _must_recompute(d):
            continue
        deps.add(d)
        stack.extend(d.all_input_nodes)
    return sorted(deps, key=order.__getitem__)


def _mark_copy(dup: torch.fx.Node, original: torch.fx.Node) -> None:
    """`dup`, a copy of `original` made for the backward: named after it, untagged, marked rematerialized."""
    dup.name = f"{original.name}_recomputed"
    dup.meta.pop(node_meta.RECOMPUTE, None)
    custom = dict(dup.meta.get(node_meta.CUSTOM, {}))  # shared with the original: copy before writing
    custom[node_meta.REMATERIALIZED] = True
    dup.meta[node_meta.CUSTOM] = custom


def remat_graph(graph: torch.fx.Graph) -> torch.fx.Graph | None:
    """A new graph with recomputed ops duplicated into the backward, or None when nothing needs it; `graph`
    itself is unchanged (the tagging passes probe their choices with it).

    Raises:
        ValueError: the backward region is not one contiguous run of nodes.
    """
    region = _backward_region(graph)
    if region is None:
        return None
    nodes, start, end = region
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
        for d in _new_deps(n, recomputed, order):
            dup = new.node_copy(d, in_backward)
            _mark_copy(dup, d)
            recomputed[d] = dup
        env[n] = new.node_copy(n, in_backward)
    for n in nodes[end:]:
        env[n] = new.node_copy(n, from_forward)
    eliminate_dead_code(new)  # the originals nothing uses once their copies serve the backward
    refresh_duplicated_values(new)
    return new


def rematerialize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Duplicate recomputed forward ops into the backward, in place: `gm` itself, rewritten (or unchanged if
    nothing is tagged), as the other passes of the pipeline rewrite theirs.

    The result is the graph `remat_graph` makes, node for node and name for name (golden dry runs print node
    names): the copies are inserted where it puts them, and every node is given the name its copy gets there, from
    a namespace filled in the same order (a copy of `x` first takes a free name of `x`'s base before it is renamed
    `x_recomputed`, and later nodes of that base step around it); the graph keeps that namespace, as the copy
    would. What is saved is the copy of every node: on the planner's short graphs, half of what remat costs.
    """
    graph = gm.graph
    region = _backward_region(graph)
    if region is None:
        return gm
    nodes, start, end = region
    order = {n: i for i, n in enumerate(nodes)}
    names = _Namespace()  # the names the nodes of `remat_graph`'s copy get, created in the same order
    final: dict[torch.fx.Node, str] = {}

    def name(n: torch.fx.Node, candidate: str) -> str:
        created = names.create_name(candidate, None)
        names.associate_name_with_obj(created, n)
        return created

    recomputed: dict[torch.fx.Node, torch.fx.Node] = {}

    def in_backward(x: torch.fx.Node) -> torch.fx.Node:
        return recomputed.get(x, x)

    for n in nodes[:start]:
        final[n] = name(n, n.name)
    for n in nodes[start:end]:
        for d in _new_deps(n, recomputed, order):
            with graph.inserting_before(n):
                dup = graph.node_copy(d, in_backward)
            name(dup, d.name)  # taken in the namespace, though the copy is then renamed (`_mark_copy`)
            _mark_copy(dup, d)
            recomputed[d] = dup
        if any(a in recomputed for a in n.all_input_nodes):
            n.args, n.kwargs = map_arg(n.args, in_backward), map_arg(n.kwargs, in_backward)
        final[n] = name(n, n.name)
    for n in nodes[end:]:
        final[n] = name(n, n.name)
    for n, new_name in final.items():
        if n.name != new_name:
            n.name = new_name
    graph._graph_namespace = names
    eliminate_dead_code(graph)
    refresh_duplicated_values(graph)
    gm.recompile()
    return gm


def peak_after_remat(gm: torch.fx.GraphModule, input_categories: list[str] | None = None) -> int:
    """Estimated peak of `gm` once its current tags are rematerialized; `gm` itself is not changed.

    How the tagging passes compare candidate decisions before committing to one.
    """
    graph = remat_graph(gm.graph)
    # The estimate reads only `.graph`; skipping GraphModule saves a Python codegen per probe.
    target = gm if graph is None else types.SimpleNamespace(graph=graph)
    return estimate_peak_memory(target, input_categories=input_categories).peak_bytes
