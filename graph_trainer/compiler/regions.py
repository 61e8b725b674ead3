"""Cutting the final step graph into regions run one after another, so identical layers share one compile.

A traced step of an N-layer model holds N copies of the same layer forward and
N of the same layer backward. Compiled as one graph, Inductor compiles each copy
again: compile time grows with depth (133 s cold at 32 layers on CPU). Cut into
regions, each layer's forward and each layer's backward is a graph of its own;
re-traced with `make_fx`, identical layers give identical code, and a region is
compiled once per distinct code and input layout (`graph_trainer.compiler.inductor`).

The cut keeps the graph's order: regions are contiguous runs of nodes, run in
that order, so the memory plan (what is saved, where it is recomputed, where a
value dies) is the pass pipeline's. What crosses a boundary is held by the
driver, `RegionalStep`, and dropped right before the region that reads it last
(the region gets it in a boxed list it may clear, so it frees the value at its
own last use, as the whole graph would). Input mutations (the optimizer's
in-place update, gradient clipping) stay in their region: each region writes its
new values into the tensors it was given, and an in-place result leaves its region
as the tensor it wrote into (made functional, it would leave as a copy).

The label of a node is its layer and its stage (forward; backward, which holds
the forward ops that remat recomputes there; optimizer: the tracer tags each
update op with its parameter's layer). See `region_labels` for the ops outside
the layers.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.fx

from graph_trainer.tracer import node_meta

RegionFn = Callable[[list[Any]], Sequence[Any]]


@dataclasses.dataclass
class Region:
    """One contiguous run of the step graph, as a graph of its own.

    `gm` takes the values in `inputs` (slots of the driver's value table) as its
    placeholders, in order, and returns those in `outputs`. `drops` are the input
    slots this region reads last: the driver lets go of them before the call.
    """

    label: str
    gm: torch.fx.GraphModule
    inputs: list[int]
    outputs: list[int]
    drops: list[int]


def _stage(node: torch.fx.Node) -> str | None:
    """forward / backward / optimizer; a recomputed forward op runs in, and belongs to, the backward."""
    phase = node_meta.phase(node)
    if phase == node_meta.FORWARD and node_meta.is_rematerialized(node):
        return node_meta.BACKWARD
    return phase


Label = tuple[str | None, int | None]  # (stage, layer); (None, None): outside the layers


def region_labels(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, Label]:
    """The region label of each op node: (stage, layer) inside a layer, (None, None) outside them.

    A run of ops outside the layers between two layer ops of the same stage
    (the residual-gradient sums between two layers' backward, a prefetched
    gather) joins the region before it. Runs at the ends of the step or where
    the stage changes (the embedding; the final norm, output projection and loss
    with the loss's backward; the embedding's backward) are regions of their own,
    so what Inductor can fuse there (the loss with its backward) stays together.
    A `getitem` always takes its tuple's label, so no tuple crosses a boundary.
    """
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    labels: dict[torch.fx.Node, Label] = {}
    outside: list[torch.fx.Node] = []  # the current run of ops outside the layers
    previous: Label | None = None  # label of the last layer op

    def close_run(following: Label | None) -> None:
        same_stage = previous is not None and following is not None and previous[0] == following[0]
        for n in outside:
            labels[n] = previous if same_stage else (None, None)
        outside.clear()

    for node in ops:
        if node.target is operator.getitem and node.args[0] in outside:
            outside.append(node)
            continue
        if node.target is operator.getitem and node.args[0] in labels:
            labels[node] = labels[node.args[0]]
            continue
        layer = node_meta.layer_id(node)
        if layer is None:
            outside.append(node)
            continue
        label = (_stage(node), layer)
        close_run(label)
        labels[node] = previous = label
    close_run(None)
    return labels


def _describe(label: Label) -> str:
    stage, layer = label
    return "outside the layers" if layer is None else f"layer {layer} {stage}"


@dataclasses.dataclass
class RegionPlan:
    """The step graph as regions plus the driver's value table layout.

    Slots 0..n_inputs-1 are the graph's placeholders, then one slot per
    `get_attr` constant (values in `constants`), then one per value that
    crosses a region boundary. `result` names, per graph output, a slot or a
    constant (a non-node output, e.g. None).
    """

    regions: list[Region]
    n_inputs: int
    constants: dict[int, Any]
    n_slots: int
    result: list[tuple[str, Any]]  # ("slot", index) or ("value", python value)


def split_into_regions(gm: torch.fx.GraphModule) -> RegionPlan:
    """Cut `gm` into contiguous regions of equal (stage, layer) label, in graph order.

    Preserves the graph's node order, every node's target, args and meta (nodes
    are copied with `Graph.node_copy`), and so its numerics: running the regions
    in order with `RegionalStep` computes what `gm` computes, with the same
    in-place effects on the inputs.
    """
    slot: dict[torch.fx.Node, int] = {}
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for node in placeholders:
        slot[node] = len(slot)
    constants = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        slot[node] = len(slot)
        constants[slot[node]] = getattr(gm, node.target)
    labels = region_labels(gm)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    output_node = gm.graph.output_node()
    runs = [list(run) for _, run in itertools.groupby(ops, key=labels.__getitem__)]
    region_of = {node: i for i, run in enumerate(runs) for node in run}

    def owner(node: torch.fx.Node) -> torch.fx.Node:
        """The node whose tensor `node` is: in-place ops return the tensor they wrote into."""
        while (written := node_meta.written_input(node)) is not None:
            node = written
        return node

    regions, readers = [], []
    for i, run in enumerate(runs):
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        inputs: list[int] = []

        def value(node: torch.fx.Node) -> torch.fx.Node:
            if node not in env:  # made before this region: a placeholder fed from the driver's slot
                env[node] = graph.placeholder(node.name)
                env[node].meta["val"] = node.meta.get("val")
                inputs.append(slot[owner(node)])
            return env[node]

        for node in run:
            for arg in node.all_input_nodes:
                value(arg)
            env[node] = graph.node_copy(node, value)
        # A value read later leaves the region as the tensor that holds it: an in-place op's result is
        # its input, written in place (made functional, the region would return a copy of it instead).
        crossing = list(dict.fromkeys(owner(n) for n in run if any(region_of.get(u) != i for u in n.users)))
        crossing = [n for n in crossing if region_of.get(n) == i]
        for node in crossing:
            if not isinstance(node.meta.get("val"), torch.Tensor):
                raise NotImplementedError(
                    f"region '{_describe(labels[node])}' would hand {node.format_node()} "
                    "(not a tensor) to a later region; compile.regional cannot cut here"
                )
            slot[node] = len(slot)
        graph.output([env[n] for n in crossing])
        regions.append(
            Region(
                label=_describe(labels[run[0]]),
                gm=torch.fx.GraphModule(torch.nn.Module(), graph),
                inputs=inputs,
                outputs=[slot[n] for n in crossing],
                drops=[],
            )
        )
        readers.append(set(inputs))
    # A value read by no later region (and not returned) is dropped before its last reader runs.
    kept = {slot[owner(n)] for n in output_node.all_input_nodes}
    last_reader = {}
    for i, read in enumerate(readers):
        for s in read:
            last_reader[s] = i
    for s, i in last_reader.items():
        if s not in kept and s >= len(placeholders):
            regions[i].drops.append(s)
    result = [("slot", slot[owner(o)]) if isinstance(o, torch.fx.Node) else ("value", o) for o in output_node.args[0]]
    return RegionPlan(
        regions=regions, n_inputs=len(placeholders), constants=constants, n_slots=len(slot), result=result
    )


def dedup_key(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Hashable:
    """What makes two region graphs interchangeable: their code, their inputs' layouts, their constants."""
    layouts = tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type) for t in example_inputs)
    constants = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target)
        if isinstance(value, torch.Tensor):
            value = (tuple(value.shape), value.dtype, value.detach().cpu().flatten().tolist())
        constants.append((node.target, repr(value)))
    return gm.code, layouts, tuple(constants)


class RegionalStep:
    """Runs a `RegionPlan` with one callable per region (compiled ones; several regions may share one).

    Called like the whole step: a list of the graph's flat inputs in, the flat outputs out.
    """

    def __init__(self, plan: RegionPlan, fns: list[RegionFn]):
        self.plan, self.fns = plan, fns

    def __call__(self, flat_inputs: list[torch.Tensor]) -> list[Any]:
        plan = self.plan
        values: list[Any] = [None] * plan.n_slots
        values[: plan.n_inputs] = flat_inputs
        for s, constant in plan.constants.items():
            values[s] = constant
        for region, fn in zip(plan.regions, self.fns, strict=True):
            args = [values[s] for s in region.inputs]
            for s in region.drops:
                values[s] = None  # `args` holds the last reference: the region frees it at its own last use
            for s, out in zip(region.outputs, fn(args), strict=True):
                values[s] = out
        return [values[ref] if kind == "slot" else ref for kind, ref in plan.result]
