"""Static peak-memory estimate of a traced step (an analysis; the graph is not changed).

Reads: `node.meta["val"]` on every node (fake tensors from make_fx under
`FakeTensorMode`, or from `torch.fx.passes.fake_tensor_prop.FakeTensorProp`; view
aliasing is only right with fake values), and optionally
`node.meta["custom"]["phase"]` / `["module_fqn"]` written by the tracer.
Writes nothing.

The model is the code FX generates for the GraphModule. That code frees each
value right after its last use (`; add = mm = None` in `gm.code`) and a value
nobody uses right after the node that made it; graph outputs live until the
function returns. Counting is by storage, so a view keeps its base's bytes alive
and in-place ops add nothing. A storage is live from the first node whose value
holds it until every node whose value holds it has been freed. A node's output
shares an allocation only with an input holding the same fake storage, so a
remat'd node whose meta was copied from its forward twin still counts as a new
allocation (no FakeTensorProp needed after remat). Graph inputs
(placeholders) and module attributes (`get_attr`) are live throughout: the
caller and the module keep them. Each node's peak includes its inputs and its
outputs together (the op's outputs exist before its inputs can be freed).
Scratch memory inside one kernel is not modelled.

A graph whose tensors live on a CUDA device is counted as its caching allocator
counts active memory (`graph_trainer.observability.memory.allocated_bytes`): each storage
rounded up to 512 bytes, host (CPU) tensors such as per-step scalars not at all,
and, when the graph has a matmul, the cuBLAS workspace (category "workspace")
live throughout. These CUDA rules are derived from torch's allocator and cuBLAS
handle code, not yet measured against a GPU by this project.

Run under `torch.no_grad()` with the inputs alive, the graph's live tensor bytes
measured by `graph_trainer.observability.memory.LiveTensorTracker` equal this estimate to the
byte, after every op.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_iter

from graph_trainer.observability.memory import (
    ALLOC,
    FREE,
    MemoryEvent,
    allocated_bytes,
    process_cublas_workspace_bytes,
)
from graph_trainer.observability.units import to_gib
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.graph_utils import is_collective, is_matmul, is_wait, storage_key, tensors

INPUT = "input"
CONSTANT = "constant"
GRADIENT = "gradient"
OUTPUT = "output"
ACTIVATION = "activation"
WORKSPACE = "workspace"


@dataclass(frozen=True)
class SavedTensor:
    """One storage made in the forward and still needed once the backward starts."""

    node: str
    op: str
    module_fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Result of `estimate_peak_memory`; all sizes in bytes."""

    peak_bytes: int
    peak_node: str  # name of the node at whose execution the peak happens
    peak_op: str  # its op target
    peak_module_fqn: str
    peak_bytes_by_category: dict[str, int]
    final_bytes_by_category: dict[str, int]  # live when the step returns: inputs, constants, outputs
    input_bytes: int  # live before the first op: placeholders + module attributes
    saved_bytes: int  # forward storages still needed when the backward starts (0 without phase tags)
    timeline: tuple[int, ...] = field(repr=False)  # live bytes at each node, in graph order

    def summary(self) -> str:
        """A few human-readable lines (GiB) for the dry-run report."""
        where = f" in {self.peak_module_fqn}" if self.peak_module_fqn else ""
        lines = [
            f"estimated peak {to_gib(self.peak_bytes):.3f} GiB at {self.peak_node} ({self.peak_op}){where}",
            f"  saved for backward {to_gib(self.saved_bytes):.3f} GiB, inputs {to_gib(self.input_bytes):.3f} GiB",
        ]
        for cat, nbytes in sorted(self.peak_bytes_by_category.items(), key=lambda kv: -kv[1]):
            lines.append(f"  at peak: {cat:<16} {to_gib(nbytes):.3f} GiB")
        return "\n".join(lines)


@dataclass
class Allocation:
    """One allocation the estimate counts: its size, when it is made and freed (node indices), what made it and
    holds it, and its category. `storage_lifetimes` lists them."""

    nbytes: int
    born: int  # node index of the first node holding it (-1: before the first node)
    dies: float  # node index after which it is freed (inf: never within the call)
    producer: torch.fx.Node
    example: torch.Tensor  # the producer's (fake) tensor on this storage
    last_op_use: int = -1  # last node (other than output) whose value holds it or that reads it
    category: str = ACTIVATION
    holders: list[torch.fx.Node] = field(default_factory=list)  # the nodes whose values hold it


def _returned_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input a collective op hands back as its output, or None.

    The fake values of `_c10d_functional` ops are fresh tensors even where the
    op returns an input: `wait_tensor` returns the tensor the collective filled,
    and the `_out` variants return `out`. Without this they would count twice.
    """
    if is_wait(node):
        return node.args[0] if isinstance(node.args[0], torch.fx.Node) else None
    if not is_collective(node):
        return None
    return node_meta.written_input(node)


def _int(x: Any) -> int:
    """A size as an int, using the trace-time hint for a symbolic one."""
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else int(x.node.shape_env.size_hint(x.node.expr))
    return int(x)


def op_name(node: torch.fx.Node) -> str:
    """The op's name as a plan reports it (`mm.default`; a method or module target as written)."""
    return str(node.target) if node.op != "call_function" else getattr(node.target, "__name__", str(node.target))


def storage_lifetimes(
    gm: torch.fx.GraphModule, input_categories: list[str] | None
) -> tuple[list[torch.fx.Node], list[Allocation]]:
    """(the graph's nodes in order, every allocation the estimate counts): what `estimate_peak_memory` sums over
    time, for a caller that models the same timeline another way (`passes/remat_model.py`)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if input_categories is not None and len(input_categories) != len(placeholders):
        raise ValueError(f"input_categories has {len(input_categories)} entries for {len(placeholders)} graph inputs")
    in_cat = dict(zip(placeholders, input_categories or [INPUT] * len(placeholders), strict=True))
    device_type = graph_device_type(gm)
    output_node = next(n for n in reversed(nodes) if n.op == "output")
    outputs = {a for a in tree_iter(output_node.args) if isinstance(a, torch.fx.Node)}

    # When FX's generated code drops each node's value (see module docstring).
    node_dies: dict[torch.fx.Node, float] = {}
    for n in nodes:
        if n.op in ("placeholder", "get_attr") or n in outputs:
            node_dies[n] = math.inf
        elif not n.users:
            node_dies[n] = index[n]
        else:
            node_dies[n] = max(index[u] for u in n.users)

    # Allocation ids, not fake storages, are the unit: a node's output aliases an
    # input's allocation only if it shares that input's fake storage, else it is
    # new. (Remat copies meta, so a recomputed node carries the *same* fake value
    # as the forward node it recomputes; storage identity alone would merge them.)
    storages: list[Allocation] = []
    allocs_of: dict[torch.fx.Node, dict[int, int]] = {}  # node -> fake storage key -> allocation id
    held_by_inputs: dict[int, int] = {}  # placeholders/get_attr sharing a storage count once
    for i, n in enumerate(nodes):
        if n.op == "output":
            continue
        if "val" not in n.meta:
            raise ValueError(
                f"node {n.name} has no meta['val']: trace with make_fx under FakeTensorMode "
                "or run torch.fx.passes.fake_tensor_prop.FakeTensorProp first"
            )
        is_input = n.op in ("placeholder", "get_attr")
        if is_input:
            reachable = held_by_inputs
        else:
            reachable = {}
            for inp in n.all_input_nodes:
                reachable.update(allocs_of[inp])
        mine = allocs_of[n] = {}
        last_use = max((index[u] for u in n.users if u.op != "output"), default=i)
        returned = _returned_input(n)
        for t in tensors(n.meta["val"]):
            key = storage_key(t)
            aid = mine.get(key, reachable.get(key))
            if aid is None and returned is not None:
                aid = next(iter(allocs_of[returned].values()))
            if aid is None:
                aid = len(storages)
                nbytes = _int(t.untyped_storage().nbytes())
                # On a CUDA graph, host tensors (per-step scalars) take no device memory.
                nbytes = 0 if device_type == "cuda" and t.device.type == "cpu" else allocated_bytes(nbytes, device_type)
                st = Allocation(nbytes, -1 if is_input else i, node_dies[n], n, t)
                if n.op == "placeholder":
                    st.category = in_cat[n]
                elif n.op == "get_attr":
                    st.category = CONSTANT
                storages.append(st)
                if is_input:
                    held_by_inputs[key] = aid
            st = storages[aid]
            mine[key] = aid
            st.dies = max(st.dies, node_dies[n])
            st.holders.append(n)
            st.last_op_use = max(st.last_op_use, last_use)
            if n in outputs and st.born >= 0:
                # A gradient is often a view (t, view) of a storage an earlier node made, and a
                # clipped one the in-place result (an optimizer-phase `mul_`) of the backward's storage.
                if node_meta.is_backward(n) or node_meta.is_backward(st.producer):
                    st.category = GRADIENT
                elif st.category == ACTIVATION:
                    st.category = OUTPUT
    return nodes, storages


def graph_device_type(gm: torch.fx.GraphModule) -> str:
    """'cuda' when any graph input lives on a CUDA device, else the first input's device type ('cpu')."""
    types = [t.device.type for n in gm.graph.nodes if n.op == "placeholder" for t in tensors(n.meta.get("val"))]
    return "cuda" if "cuda" in types else (types[0] if types else "cpu")


def workspace_bytes(gm: torch.fx.GraphModule) -> int:
    """cuBLAS's workspace, held for the whole step by a CUDA graph with a matmul (0 elsewhere)."""
    if graph_device_type(gm) != "cuda" or not any(is_matmul(n.target) for n in gm.graph.nodes):
        return 0
    return process_cublas_workspace_bytes(torch.device("cuda"))


def estimate_peak_memory(gm: torch.fx.GraphModule, *, input_categories: list[str] | None = None) -> MemoryEstimate:
    """Peak live tensor bytes while `gm` runs under no_grad, by storage-level liveness over `meta['val']`.

    `input_categories`: one label per placeholder in graph order (e.g. "parameter",
    "buffer", "optimizer_state", "batch"); default "input". Other storages are
    "constant" (get_attr), "gradient" (returned, made by a backward node), "output"
    (other returned values, e.g. the loss) or "activation" (everything else).
    """
    nodes, storages = storage_lifetimes(gm, input_categories)
    n_nodes = len(nodes)
    # Sweep: +bytes at birth, -bytes after death.
    delta = [0] * (n_nodes + 1)
    workspace = workspace_bytes(gm)
    input_bytes = workspace
    for st in storages:
        if st.born < 0:
            input_bytes += st.nbytes
        else:
            delta[st.born] += st.nbytes
        if st.dies != math.inf:
            delta[int(st.dies) + 1] -= st.nbytes
    timeline, live = [], input_bytes
    for i in range(n_nodes):
        live += delta[i]
        timeline.append(live)
        # Frees happen after node i; applied when we reach i + 1.
    peak_idx = max(range(n_nodes), key=lambda i: (timeline[i], -i))
    peak_node = nodes[peak_idx]
    by_cat: dict[str, int] = defaultdict(int)
    final_by_cat: dict[str, int] = defaultdict(int)
    if workspace:
        by_cat[WORKSPACE] = final_by_cat[WORKSPACE] = workspace
    for st in storages:
        if st.born <= peak_idx <= st.dies:
            by_cat[st.category] += st.nbytes
        if st.dies == math.inf:
            final_by_cat[st.category] += st.nbytes
    saved = _saved(nodes, storages)
    return MemoryEstimate(
        peak_bytes=timeline[peak_idx],
        peak_node=peak_node.name,
        peak_op=op_name(peak_node),
        peak_module_fqn=node_meta.module_fqn(peak_node),
        peak_bytes_by_category=dict(by_cat),
        final_bytes_by_category=dict(final_by_cat),
        input_bytes=input_bytes,
        saved_bytes=sum(st.nbytes for st in saved),
        timeline=tuple(timeline),
    )


def allocation_events(gm: torch.fx.GraphModule) -> tuple[list[MemoryEvent], int]:
    """(the allocations and frees running `gm` makes, in order; how many of them are its inputs').

    The same storages and lifetimes as `estimate_peak_memory`: first every input's storage (placeholders and
    attributes, alive throughout), then node by node the storages it makes and, after it, those whose last
    holder FX's code drops there, in the order it drops them (`_drop_order`). Keys are allocation ids; sizes as
    the estimate counts them. The cuBLAS workspace is not in it. A caching allocator replays it
    (`graph_trainer.plan.caching_allocator.replay`).
    """
    nodes, storages = storage_lifetimes(gm, None)
    born: dict[int, list[int]] = defaultdict(list)
    dies: dict[int, list[int]] = defaultdict(list)
    for aid, st in enumerate(storages):
        born[st.born].append(aid)
        if st.dies != math.inf:
            dies[int(st.dies)].append(aid)
    events: list[MemoryEvent] = [(ALLOC, aid, storages[aid].nbytes) for aid in born.pop(-1, [])]
    inputs = len(events)
    index = {n: i for i, n in enumerate(nodes)}
    for i, node in enumerate(nodes):
        events += [(ALLOC, aid, storages[aid].nbytes) for aid in born.get(i, [])]
        order = _drop_order(node, index)
        last = {aid: max(order.get(h, -1) for h in storages[aid].holders) for aid in dies.get(i, [])}
        events += [(FREE, aid, 0) for aid in sorted(last, key=last.__getitem__)]
    return events, inputs


def _drop_order(node: torch.fx.Node, index: dict[torch.fx.Node, int]) -> dict[torch.fx.Node, int]:
    """The values FX's generated code sets to None after `node` (`a = b = None`, left to right): the inputs whose
    last user it is, in the order its arguments name them, then its own value if nothing uses it."""
    dropped = [n for n in node.all_input_nodes if max(n.users, key=index.__getitem__) is node]
    if not node.users:
        dropped.append(node)
    return {n: k for k, n in enumerate(dropped)}


def live_by_category(
    gm: torch.fx.GraphModule, index: int, *, input_categories: list[str] | None = None
) -> dict[str, int]:
    """Bytes live at the `index`-th node of `gm` (graph order), by category, as `estimate_peak_memory` counts
    them at its peak node (the depth-free planner reads them at a node that is not the short graph's peak)."""
    nodes, storages = storage_lifetimes(gm, input_categories)
    by_cat: dict[str, int] = defaultdict(int)
    workspace = workspace_bytes(gm)
    if workspace:
        by_cat[WORKSPACE] = workspace
    for st in storages:
        if st.born <= index <= st.dies:
            by_cat[st.category] += st.nbytes
    return dict(by_cat)


def _saved(nodes: list[torch.fx.Node], storages: list[Allocation]) -> list[Allocation]:
    """Storages made before the first backward node and used by it or a later node (not just returned)."""
    first_bwd = next((i for i, n in enumerate(nodes) if node_meta.is_backward(n)), None)
    if first_bwd is None:
        return []
    return [st for st in storages if 0 <= st.born < first_bwd <= st.last_op_use]


def saved_tensors(gm: torch.fx.GraphModule) -> list[SavedTensor]:
    """The tensors saved for backward (see `MemoryEstimate.saved_bytes`), largest first.

    Empty when no node carries the tracer's `phase == "backward"` tag.
    """
    nodes, storages = storage_lifetimes(gm, None)
    out = []
    for st in _saved(nodes, storages):
        n, t = st.producer, st.example
        out.append(
            SavedTensor(
                node=n.name,
                op=op_name(n),
                module_fqn=node_meta.module_fqn(n),
                shape=tuple(_int(s) for s in t.shape),
                dtype=t.dtype,
                nbytes=st.nbytes,
            )
        )
    out.sort(key=lambda s: -s.nbytes)
    return out
