"""Clean-up passes that preserve numerics bitwise: dead-code elimination and no-op removal.

Both read only `node.meta["val"]` (fake tensors, for shapes) and write no metadata.
"""

from __future__ import annotations

import torch
import torch.fx

from graph_trainer.tracer.graph_utils import eliminate_dead_code, storage_key

aten = torch.ops.aten


def dead_code_elimination(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Remove ops whose results nobody uses.

    Impure nodes survive (`Node.is_impure()`): in-place ops such as the traced
    optimizer's updates of parameters and state (`add_`, `copy_`, ...) and
    random ops, whose RNG draws must happen exactly as in eager. Preserves
    numerics bitwise. In place; returns `gm`.
    """
    eliminate_dead_code(gm.graph)
    gm.recompile()
    return gm


def _same_layout(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    return (
        va.shape == vb.shape
        and va.stride() == vb.stride()
        and va.dtype == vb.dtype
        and va.storage_offset() == vb.storage_offset()
    )


def _noop_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose value `node` provably equals (same storage, shape, strides), or None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    src = node.args[0]
    if node.target in (aten.detach.default, aten.alias.default):
        return src if _same_layout(node, src) else None
    if node.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        # _unsafe_view / reshape may copy; only a same-layout result is an alias of its input.
        same_storage = (
            isinstance(node.meta.get("val"), torch.Tensor)
            and isinstance(src.meta.get("val"), torch.Tensor)
            and storage_key(node.meta["val"]) == storage_key(src.meta["val"])
        )
        return src if same_storage and _same_layout(node, src) else None
    if node.target == aten.t.default and src.op == "call_function" and src.target == aten.t.default:
        inner = src.args[0]
        return inner if isinstance(inner, torch.fx.Node) and _same_layout(node, inner) else None
    return None


def remove_noops(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replace ops that provably return their input unchanged, then drop them.

    Removed: `aten.detach` and `aten.alias` (the step runs under no_grad, so a
    detach changes nothing), view/_unsafe_view/reshape to the same shape and
    strides on the same storage, and `t(t(x))`. Each replacement is checked on
    the fake values: same storage, shape, strides, offset and dtype. A node is
    kept when it feeds the graph output directly from a graph input (returning
    an input itself would alias the caller's tensor). Preserves numerics
    bitwise. In place; returns `gm`.
    """
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for node in list(gm.graph.nodes):
        src = _noop_source(node)
        if src is None:
            continue
        if src.op == "placeholder" and output in node.users:
            continue
        node.replace_all_uses_with(src)
        if not node.users:
            gm.graph.erase_node(node)
    # t(t(x)) leaves the inner t unused.
    eliminate_dead_code(gm.graph)
    gm.recompile()
    return gm
