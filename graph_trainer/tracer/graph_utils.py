"""Small graph helpers shared by the passes: op identity, storages, aliasing, FLOPs, fake values.

Everything here reads a graph; nothing rewrites one except `refresh_duplicated_values`,
which only replaces `meta["val"]` on nodes that share it with an earlier node, and `eliminate_dead_code`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.utils._pytree import tree_iter, tree_map

from graph_trainer.tracer import node_meta

aten = torch.ops.aten

# Compute-intensive ops whose outputs selective AC saves. Matmuls are counted for
# the "recompute every second matmul" rule; selective saves every attention output.
MATMUL_OPS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm})
ATTENTION_OPS = frozenset(
    {
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
        aten._scaled_dot_product_fused_attention_overrideable,
    }
)


# A mixture of experts' routing and expert matmuls: selective AC saves them all (not every second one). The
# grouped matmuls are the experts' compute; sort (the permutation) and topk (the router's choices) are small
# integer tensors whose recompute would run the whole router again.
ROUTING_OPS = frozenset({aten._grouped_mm, aten.sort, aten.topk})


def packet(node_or_target: Any) -> Any:
    """The OpOverloadPacket of a node's (or a target's) op, or None for non-ATen targets."""
    target = node_or_target.target if isinstance(node_or_target, torch.fx.Node) else node_or_target
    return getattr(target, "overloadpacket", None)


def is_matmul(target: Any) -> bool:
    return packet(target) in MATMUL_OPS


def is_attention(target: Any) -> bool:
    return packet(target) in ATTENTION_OPS


def is_routing(target: Any) -> bool:
    """A mixture of experts' grouped matmul, permutation or top-k choice (see `ROUTING_OPS`)."""
    return packet(target) in ROUTING_OPS


# The collectives a parallelism may put in the graph (torch's functional collectives), by kind of traffic.
_c10d = getattr(torch.ops, "_c10d_functional", None)  # absent from torch builds without distributed


def _c10d_packets(*names: str) -> frozenset:
    return frozenset(getattr(_c10d, n) for n in names if _c10d is not None and hasattr(_c10d, n))


ALL_GATHER_OPS = _c10d_packets("all_gather_into_tensor", "all_gather_into_tensor_out")
REDUCE_SCATTER_OPS = _c10d_packets("reduce_scatter_tensor")
ALL_REDUCE_OPS = _c10d_packets("all_reduce", "all_reduce_")
ALL_TO_ALL_OPS = _c10d_packets("all_to_all_single")
WAIT_OPS = _c10d_packets("wait_tensor")
COLLECTIVE_OPS = ALL_GATHER_OPS | REDUCE_SCATTER_OPS | ALL_REDUCE_OPS | ALL_TO_ALL_OPS
TRAFFIC_KINDS = {"all_gather": ALL_GATHER_OPS, "reduce_scatter": REDUCE_SCATTER_OPS,
                 "all_reduce": ALL_REDUCE_OPS, "all_to_all": ALL_TO_ALL_OPS}  # fmt: skip


def is_collective(node: torch.fx.Node) -> bool:
    """A functional collective (all-gather, reduce-scatter, all-reduce, all-to-all); its wait is not one."""
    return node.op == "call_function" and packet(node) in COLLECTIVE_OPS


def is_all_gather(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and packet(node) in ALL_GATHER_OPS


def is_reduce_scatter(target: Any) -> bool:
    """A reduce-scatter op (a node's target or an op seen by a dispatch policy)."""
    return packet(target) in REDUCE_SCATTER_OPS


def is_wait(node: torch.fx.Node) -> bool:
    """The `wait_tensor` that makes a collective's result usable."""
    return node.op == "call_function" and packet(node) in WAIT_OPS


def is_c10d_op(node: torch.fx.Node) -> bool:
    """Any `_c10d_functional` op: a collective or its wait."""
    return is_collective(node) or is_wait(node)


def is_all_to_all_or_its_wait(node: torch.fx.Node) -> bool:
    """An all-to-all (expert parallelism's token exchange) or the `wait_tensor` of one."""
    if is_wait(node):
        node = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else node
    return traffic_kind(node) == "all_to_all"


def traffic_kind(node: torch.fx.Node) -> str | None:
    """'all_gather', 'reduce_scatter', 'all_reduce' or 'all_to_all' for a collective, else None."""
    p = packet(node) if node.op == "call_function" else None
    return next((kind for kind, ops in TRAFFIC_KINDS.items() if p in ops), None)


def tensors(val: Any) -> list[torch.Tensor]:
    """Tensors inside a node value (a tensor, a tuple/list of them, or nothing)."""
    if isinstance(val, torch.Tensor):  # most nodes: skip the pytree walk, which dominated the estimate's time
        return [val]
    return [t for t in tree_iter(val) if isinstance(t, torch.Tensor)]


def storage_key(t: torch.Tensor) -> int:
    """A storage's identity: the address of its StorageImpl, shared by all views of it and stable while
    the tensor (for a node, its fake value) is alive."""
    return t.untyped_storage()._cdata


def storage_keys(node: torch.fx.Node) -> set[int]:
    """Identities of the storages the node's (fake) value lives in."""
    return {storage_key(t) for t in tensors(node.meta.get("val"))}


def is_mutating(node: torch.fx.Node) -> bool:
    """True for an op that writes into one of its inputs (add_, bernoulli_, copy_, ...)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The input nodes a mutating op writes into."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        out += [v for v in tree_iter(value) if isinstance(v, torch.fx.Node)]
    return out


def is_view(node: torch.fx.Node) -> bool:
    """A non-mutating op whose output lives in an input's storage (view, t, getitem, detach, ...)."""
    if node.op != "call_function" or is_mutating(node):
        return False
    out = storage_keys(node)
    if not out:
        return False
    inputs = set().union(*(storage_keys(a) for a in node.all_input_nodes)) if node.all_input_nodes else set()
    return out <= inputs


def _flop_formulas() -> dict[Any, Any]:
    """torch's FLOP formulas by op packet (`torch.utils.flop_counter`, what `FlopCounterMode` counts with),
    plus CPU attention, which torch does not count, under the formula of the same math's CUDA flash kernel."""
    from torch.utils.flop_counter import flop_registry  # a public name, though not documented

    formulas = dict(flop_registry)
    for cpu_op, same_math in (
        (aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention),
        (aten._scaled_dot_product_flash_attention_for_cpu_backward, aten._scaled_dot_product_flash_attention_backward),
    ):
        if cpu_op not in formulas and same_math in formulas:
            formulas[cpu_op] = formulas[same_math]
    return formulas


FLOP_FORMULAS = _flop_formulas()


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one op as `torch.utils.flop_counter.FlopCounterMode` counts them, from the node's fake values.

    Matmuls, convolutions and attention (forward and backward) are counted; torch
    counts no other op (elementwise ops, views, reductions: 0).
    """
    formula = FLOP_FORMULAS.get(packet(node)) if node.op == "call_function" else None
    if formula is None:
        return 0

    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    return int(formula(*tree_map(val, node.args), **tree_map(val, node.kwargs), out_val=node.meta.get("val")))


def eliminate_dead_code(graph: torch.fx.Graph) -> None:
    """What `graph.eliminate_dead_code()` removes (unused nodes that are not impure, random ops impure by torch's
    rule), without its lint (the pipeline lints after each pass) and asking purity only of nodes nobody uses:
    torch checks every node's purity (a schema and tag lookup per op) before it looks at its users, which costs
    much on graphs of tens of thousands of nodes. Works on a graph without an owning module too."""
    impure_random = _random_is_impure()
    for node in reversed(graph.nodes):
        if not node.users and not node.is_impure(impure_random):
            graph.erase_node(node)


def _random_is_impure() -> bool:
    """Whether dead-code elimination must keep random ops, by torch's rule: always, except inside a compile
    (a dynamo tracing context), where Inductor's `fallback_random` decides."""
    if torch._guards.TracingContext.try_get():
        return torch._inductor.config.fallback_random
    return True


def refresh_duplicated_values(graph: torch.fx.Graph) -> None:
    """Give nodes copied by a rewrite (they share `meta["val"]` with their original) their own fake values.

    Storage-level memory accounting keys on the fake tensor's storage: a
    recomputed copy must not look like the same storage as the original. Each
    such node is re-run on its inputs' fake values in their fake mode.
    """
    seen: set[int] = set()
    for node in graph.nodes:
        val = node.meta.get("val")
        if val is None:
            continue
        if id(val) not in seen or node.op != "call_function":
            seen.add(id(val))
            continue
        fake_mode = next((t.fake_mode for t in tensors(val) if hasattr(t, "fake_mode")), None)

        def arg_val(a):
            return a.meta["val"] if isinstance(a, torch.fx.Node) else a

        args = tree_map(arg_val, node.args)
        kwargs = tree_map(arg_val, node.kwargs)
        if fake_mode is None:
            new_val = node.target(*args, **kwargs)
        else:
            with fake_mode:
                new_val = node.target(*args, **kwargs)
        node.meta["val"] = new_val
        seen.add(id(new_val))


def layer_forward_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Forward op nodes inside a transformer layer, in graph order."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and node_meta.is_forward(n) and node_meta.layer_id(n) is not None
    ]


@contextlib.contextmanager
def lazy_codegen() -> Iterator[None]:
    """Graph modules made inside (by make_fx, `graph_module`) generate their Python code only when first run or
    read, and `recompile()` only marks them stale.

    For graphs that are analysed and never run (the planner's short traces): generating and compiling the code
    of a graph of tens of thousands of nodes after each pass cost a third of a plan. A module made here still
    runs: its first call generates the code. This is torch's own switch (Inductor uses it for the same reason).
    """
    with _use_lazy_graph_module(True):
        yield


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """`torch.fx.GraphModule(root, graph)`, whose code is generated lazily inside `lazy_codegen()`."""
    return _make_graph_module(root, graph)


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of `graph` that a pass may rewrite: new nodes, the same fake values (so storage identity, which the
    memory estimate reads, is kept), and node metadata dicts of their own. Its calling convention is the default:
    wrap it with `graph_module` to analyse it, not to run it."""
    out = torch.fx.Graph()
    value_map: dict[torch.fx.Node, torch.fx.Node] = {}
    out.output(out.graph_copy(graph, value_map))
    for node in out.nodes:
        for key in (node_meta.CUSTOM, node_meta.COLLECTIVE):
            if isinstance(node.meta.get(key), dict):
                node.meta[key] = dict(node.meta[key])
    return out


def count_nodes(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def node_by_name(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes}
