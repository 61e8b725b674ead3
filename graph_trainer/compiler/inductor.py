"""Compiling the final step graph with Inductor (`compile.backend = "inductor"`).

The traced step is already a post-autograd ATen graph with flat tensor inputs
and a flat list of outputs, so it needs neither Dynamo (which would re-trace the
generated Python) nor AOTAutograd (which would partition forward and backward a
second time and CSE away the recomputed ops that `remat` placed in the
backward). This module goes straight to Inductor's graph-level entry point,
`torch._inductor.compile_fx.compile_fx_inner`, after the two things AOTAutograd
would have done for an inference graph:

1. functionalize: the step mutates its inputs in place (the optimizer updates
   parameters and state, clipping scales the gradients). `torch.func.functionalize`
   turns those into out-of-place ops plus a `copy_` of each new value into its
   input at the end; Inductor writes such values straight into the input buffers,
   so the update stays in place and nothing is returned for the caller to copy.
2. decompose with Inductor's decomposition table (compile_fx_inner expects
   ATen already lowered to the ops Inductor handles).

Both re-run the graph node by node under `make_fx` on fake tensors, in the
graph's own order: the pass pipeline's save/recompute decisions are kept, and
nothing is re-decided (no partitioner, no CSE). Inductor's lowering and
scheduler may still move computation; `pin_to_graph_order` (run as Inductor's
first post-grad pass, `PinToGraphOrder`) keeps a value at its place when
inlining it into a consumer past a matmul would cost memory, and
`KeepRematChoices` and `INDUCTOR_OPTIONS` turn off the fusions and reorderings
that measurably undid the plan (horizontal fusion, locality and peak-memory
reordering). `tests/compiler/test_compiled.py` checks the measured peak against the
uncompiled graph's for every activation-checkpointing mode.

Two ways to compile (`compile.regional`): the whole step as one graph
(`compile_step_graph`), or region by region, each distinct layer region once
(`compile_regions`, the default; `graph_trainer/compiler/regions.py` cuts the
graph and runs the regions). With FSDP, the in-place all-gather is made the
functional one first (`functional_collectives`), which functionalization takes.

Numerics: Inductor fuses pointwise ops and reorders reductions, so a compiled
step is NOT bitwise equal to eager (measured: ~1e-6 relative on the loss). It is
deterministic run to run on the same machine and build.

Compiled artifacts go to Inductor's FX graph cache (`TORCHINDUCTOR_CACHE_DIR`,
by default `/tmp/torchinductor_<user>`): a restarted run with the same graph,
config and torch version loads the compiled step instead of compiling it.

CUDA graphs (`compile.cudagraphs`, CUDA only): Inductor's CUDA-graph trees
replay the whole step; parameters, buffers and optimizer state are declared
static inputs (their addresses never change, and the step updates them in
place), so only the batch and the host scalars are copied in each replay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.fx
from torch._inductor import ir
from torch._inductor.choices import InductorChoices
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.compiler.options import BACKENDS, check_compile_config  # noqa: F401 (this module's API too)
from graph_trainer.compiler.regions import RegionalStep, dedup_key, split_into_regions
from graph_trainer.errors import UserError
from graph_trainer.observability.log import get_logger
from graph_trainer.tracer.capture import InputLayout
from graph_trainer.tracer.executor import Transformed

logger = get_logger(__name__)


def _new_escaping_buffers(node: Any, other: Any) -> list:
    """Buffers `node` writes that are read outside `node` and `other` and are not graph inputs."""
    inside = {n.get_name() for n in (*node.get_nodes(), *other.get_nodes())}
    return [
        buf
        for buf in node.get_outputs()
        if buf.get_name() not in V.graph.graph_inputs
        and not isinstance(buf.node.get_output_spec(), ir.MutationLayoutSHOULDREMOVE)
        and any(user.get_name() not in inside for user in buf.users)
    ]


class KeepRematChoices(InductorChoices):
    """Inductor's heuristics, minus the fusions that extend lifetimes the memory plan relies on.

    Horizontal fusion runs a recomputed op of the backward together with a
    forward op that reads the same saved tensor, so the recomputed value is made
    in the forward and kept alive until the backward: the remat plan is undone
    (measured on 2 layers, selective: peak 1.10x the uncompiled graph; full:
    1.07x). Inductor's own guard (no fusion of nodes > 64 apart) misses the last
    layer, whose backward starts right after the loss. Producer-consumer fusion,
    which is where the speed is, stays on.
    """

    @staticmethod
    def can_fuse_horizontal(scheduler, node1, node2, shared_data_score) -> bool:
        return False

    @staticmethod
    def can_fuse_vertical(scheduler, node1, node2, shared_data_score) -> bool:
        """No fusion that makes one kernel write two new buffers that outlive it.

        The graph's order computes such values one after the other, freeing the
        first before making the second (SwiGLU's backward: the two branch
        gradients); one kernel writing both keeps both alive at once (measured:
        +6 MiB, 1.03x the peak, on the debug model with selective AC). Values
        written into graph inputs (the optimizer's in-place updates) take no new
        memory and do not count, so AdamW still fuses into one kernel per parameter.
        """
        return not (_new_escaping_buffers(node1, node2) and _new_escaping_buffers(node2, node1))

    def uuid(self) -> str:
        """Its identity in Inductor's FX-graph cache key.

        Bump it when these heuristics change, or a step compiled under the old ones would be loaded.
        """
        return "graph_trainer.KeepRematChoices.v4"


# Inductor's lowering sets this node meta key itself (fx_passes/decompose_mem_bound_mm.py) to make a
# value a buffer of its own; graph.py's run_node realizes any node that carries it.
REALIZE_META_KEY = "inductor_realize_to_strides"


def _is_view(node: torch.fx.Node) -> bool:
    """Inductor lowers these to views of their input: no computation of their own, nothing to place."""
    target = node.target
    return target is torch.ops.aten._unsafe_view.default or bool(getattr(target, "is_view", False))


def _is_extern_call(node: torch.fx.Node) -> bool:
    """Ops Inductor runs as library calls with materialized inputs (mm, SDPA, fallbacks), never inlined."""
    from torch._inductor.lowering import lowerings, needs_realized_inputs

    return node.op == "call_function" and (node.target in needs_realized_inputs or node.target not in lowerings)


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def pin_to_graph_order(gm: torch.fx.GraphModule, dying_inputs: Collection[int] = ()) -> int:
    """Make Inductor compute a value at its own place when computing it later, past a library call, costs memory.

    Inductor's lowering inlines a pointwise value into the expression of its
    consumer unless something forces it into a buffer (several users, a library
    call reading it): the value is then computed where the consumer runs. When
    a matmul or another library call lies between the two in the graph's order,
    the inputs the value was the last to read stay alive across that call
    instead of the value itself. Measured on the debug model with selective AC:
    SwiGLU's backward `grad_h * w3x` (a pointwise node right after the `grad_h`
    matmul) was inlined into `silu_backward`, after the two `w3` gradient
    matmuls, so `grad_h` and `w3x` (6 MiB each) stayed alive across them in
    place of the 6 MiB product: peak 1.02x the uncompiled graph.

    A value is marked with `REALIZE_META_KEY` (so it is a buffer made at its
    place in the graph's order, the memory plan's order) only where inlining
    would cost memory: its consumer lies past a library call, and the bytes of
    the intermediate inputs whose lifetime that would extend exceed its own.
    Elsewhere inlining stays, as it often saves memory (AC none on the debug
    model: every such value pinned, the compiled peak rose from 0.92x to 0.99x
    the uncompiled one). Preserves the graph, its numerics and every other
    node's meta; the scheduler may still fuse a marked value with its consumer
    (producer-consumer fusion), and the fused kernel runs at the value's place.
    Returns the number of marked nodes.

    Graph inputs live through the graph (the caller holds them), except those at
    the positions in `dying_inputs`: a region of the step gets the values it reads
    last with no other reference, and frees them at their last use like any value.
    """
    nodes = list(gm.graph.nodes)
    dying = set(dying_inputs)
    held = {n for i, n in enumerate(n for n in nodes if n.op == "placeholder") if i not in dying}
    position = {n: i for i, n in enumerate(nodes)}
    externs_before = [0]  # externs_before[i]: library calls among nodes[:i]
    for n in nodes:
        externs_before.append(externs_before[-1] + _is_extern_call(n))

    def consumers(n: torch.fx.Node) -> list[torch.fx.Node]:
        """Non-view users of `n`, seen through chains of views."""
        out = []
        for user in n.users:
            out += consumers(user) if user.op == "call_function" and _is_view(user) else [user]
        return out

    def base(n: torch.fx.Node) -> torch.fx.Node:
        """The node whose buffer `n` views."""
        while n.op == "call_function" and _is_view(n) and isinstance(n.args[0], torch.fx.Node):
            n = n.args[0]
        return n

    marked = 0
    for n in nodes:
        if n.op != "call_function" or _is_view(n) or _is_extern_call(n) or not _nbytes(n):
            continue
        uses = [position[c] for c in consumers(n)]
        last_use = max(uses, default=position[n])
        if externs_before[last_use] == externs_before[position[n] + 1]:
            continue  # no library call in between: inlining moves nothing past one
        extended = 0
        for arg in {base(a) for a in n.all_input_nodes}:
            if arg in held:
                continue  # it lives through the graph either way
            other_uses = [position[c] for c in consumers(arg) if c is not n]
            if max(other_uses, default=-1) < last_use:
                extended += _nbytes(arg)
        if extended > _nbytes(n):
            n.meta[REALIZE_META_KEY] = True
            marked += 1
    return marked


class PinToGraphOrder(CustomGraphPass):
    """`pin_to_graph_order` as Inductor's first post-grad pass.

    Node meta is not part of Inductor's FX graph cache key, but a custom pass's
    `uuid()` is: two regions with the same code whose inputs die at different
    places get different pins, and must not load each other's compiled code.
    """

    def __init__(self, dying_inputs: Collection[int] = ()):
        self.dying_inputs = tuple(sorted(dying_inputs))

    def __call__(self, graph: torch.fx.Graph) -> None:
        pin_to_graph_order(graph.owning_module, self.dying_inputs)

    def uuid(self) -> Any:
        """Bump the version when `pin_to_graph_order`'s rule changes."""
        return "graph_trainer.pin_to_graph_order.v1", self.dying_inputs


# Inductor options for the whole-step graph: keep the graph's order, which is the memory plan.
# - inductor_choices_class: KeepRematChoices above (also makes it part of the FX-cache key).
# - reorder_for_locality moves producers next to consumers to help fusion, ignoring memory:
#   it can hoist a recomputed op out of the backward. Off.
# - reorder_for_peak_memory re-sorts kernels by Inductor's own estimate of the peak, which does not
#   know the plan: with activation_checkpoint.mode = budget it raised the measured peak 1.01x above
#   the graph's order, which the pass pipeline already chose for memory. Off.
# - comprehensive_padding pads strides for speed on GPU at the cost of memory. Off.
INDUCTOR_OPTIONS: dict[str, Any] = {
    "inductor_choices_class": KeepRematChoices,
    "reorder_for_locality": False,
    "reorder_for_peak_memory": False,
    "comprehensive_padding": False,
}


@dataclasses.dataclass
class CompiledStep:
    """The compiled step: call it with the flat graph inputs; returns the graph's flat outputs."""

    fn: Callable[[list[torch.Tensor]], Any]
    compile_time_s: float
    cudagraphs: bool
    regions: int  # graphs the step was cut into (1: the whole step)
    distinct_regions: int  # of which Inductor compiled this many (identical regions share one)

    def __call__(self, flat_inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.cudagraphs:
            # Outputs of the previous replay (loss, grads) have been consumed; let the tree reuse them.
            torch.compiler.cudagraph_mark_step_begin()
        return list(self.fn(list(flat_inputs)))  # boxed convention: the callee may clear its list


def _fake_inputs(gm: torch.fx.GraphModule, mode: FakeTensorMode) -> list[torch.Tensor]:
    """Static-shape fake tensors for the graph's placeholders, from their `meta["val"]`."""
    fakes = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta["val"]
        with mode:
            fakes.append(torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device))
    return fakes


def functionalize_for_inductor(
    gm: torch.fx.GraphModule, fake_inputs: list[torch.Tensor], mode: FakeTensorMode
) -> torch.fx.GraphModule:
    """`gm` re-traced functional and decomposed for Inductor, in the same node order.

    Input mutations become a `copy_` into the input at the end of the graph.
    Reads node meta only through `make_fx`; the result is a new GraphModule with
    flat inputs and the same outputs.
    """
    from torch._inductor.decomposition import select_decomp_table

    with torch.no_grad(), mode:
        return make_fx(
            torch.func.functionalize(gm, remove="mutations"),
            decomposition_table=select_decomp_table(),
            tracing_mode="real",
        )(*fake_inputs)


def _dispatching_empty_strided(size, stride, dtype):
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _route_cpu_allocations_through_dispatch(compiled: Any) -> None:
    """Make the compiled code allocate its CPU buffers with `torch.empty_strided`.

    Inductor's wrapper calls a C++ shortcut that skips the dispatcher, so the CPU
    live-tensor tracker (graph_trainer.observability.memory) would not see its buffers and would
    under-report the peak. The same allocation through the dispatcher costs ~2 us.
    """
    call = getattr(compiled, "current_callable", None)
    module_globals = getattr(call, "__globals__", None)
    if module_globals is not None and "empty_strided_cpu" in module_globals:
        module_globals["empty_strided_cpu"] = _dispatching_empty_strided


def _inductor(
    functional: torch.fx.GraphModule,
    fake_inputs: list[torch.Tensor],
    mode: FakeTensorMode,
    *,
    static_input_idxs: Sequence[int],
    cudagraphs: bool,
    options: dict[str, Any] | None,
    dying_inputs: Collection[int] = (),
) -> Callable:
    """`compile_fx_inner` on a functional graph, under the options that keep the graph's order
    (`dying_inputs`: see `pin_to_graph_order`)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    pin = PinToGraphOrder(dying_inputs)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(
            inductor_config.patch({**INDUCTOR_OPTIONS, "post_grad_custom_pre_pass": pin, **(options or {})})
        )
        stack.enter_context(torch._guards.tracing(torch._guards.TracingContext(mode)))
        stack.enter_context(V.set_choices_handler(inductor_config.inductor_choices_class()))
        use_cudagraphs = BoxedBool(cudagraphs)
        compiled = compile_fx_inner(
            functional, fake_inputs, cudagraphs=use_cudagraphs, static_input_idxs=list(static_input_idxs)
        )
    if cudagraphs and not use_cudagraphs:
        # Inductor turns CUDA graphs off (and says why in its log) for e.g. CPU tensors mutated in the
        # step or inputs on several devices; running without them silently would misreport the mode.
        raise UserError(
            "compile.cudagraphs = true, but Inductor could not capture this step as a CUDA "
            "graph (run with TORCH_LOGS=cudagraphs for the reason, e.g. a CPU tensor the step "
            "updates); set compile.cudagraphs = false"
        )
    _route_cpu_allocations_through_dispatch(compiled)
    return compiled


# FSDP's in-place gather (graph_trainer.distributed.fsdp); None where torch has no functional collectives.
_OUT_GATHER = getattr(
    getattr(getattr(torch.ops, "_c10d_functional", None), "all_gather_into_tensor_out", None), "default", None
)


def functional_collectives(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm` whose `out=` all-gathers are the functional op, for `torch.func.functionalize`.

    FSDP gathers into a buffer its own shard already sits in (`all_gather_into_tensor_out`,
    graph_trainer.distributed.fsdp), which functionalization cannot take (an op returning an alias of
    an argument). The functional `all_gather_into_tensor` computes the same tensor into a
    buffer of its own; every reader of the gather's result reads that instead. Node order,
    targets and meta are otherwise `gm`'s; `gm` is not modified.
    """
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in list(graph.nodes):
        if _OUT_GATHER is not None and node.target is _OUT_GATHER:
            with graph.inserting_before(node):
                gathered = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, node.args[:3])
            gathered.meta = dict(node.meta)
            node.replace_all_uses_with(gathered)
            graph.erase_node(node)
    return torch.fx.GraphModule(gm, graph)


def functional_gather_bytes(gm: torch.fx.GraphModule) -> int:
    """What compiling adds to `gm`'s memory estimate: the largest send buffer of an `out=` all-gather.

    `functional_collectives` gives each FSDP gather a buffer of its own, so the
    shard no longer sits in the gathered buffer while it is sent (measured on the
    debug model over 2 ranks: one layer's shard, 1,704,960 bytes, above the
    uncompiled step's peak). The largest gather's shard bounds it; 0 without FSDP.
    """
    if _OUT_GATHER is None:
        return 0
    return max((_nbytes(n.args[0]) for n in gm.graph.find_nodes(op="call_function", target=_OUT_GATHER)), default=0)


def _functional(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[torch.Tensor], FakeTensorMode]:
    """`gm` made functional for Inductor, with the fake inputs and the fake mode it was traced under."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # A shape env in the tracing context is what lets Inductor's FX graph cache key the graph.
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    fake_inputs = _fake_inputs(gm, mode)
    return functionalize_for_inductor(gm, fake_inputs, mode), fake_inputs, mode


def compile_step_graph(
    gm: torch.fx.GraphModule,
    *,
    static_input_idxs: Sequence[int] = (),
    cudagraphs: bool = False,
    options: dict[str, Any] | None = None,
) -> CompiledStep:
    """Compile the step graph `gm` (flat tensor inputs, flat list output) with Inductor, as one graph.

    Args:
        gm: the final graph (after the pass pipeline); it is not modified.
        static_input_idxs: graph inputs that keep their address from step to step
            (parameters, buffers, optimizer state): CUDA graphs read and update them
            in place instead of copying them into the graph's own buffers.
        cudagraphs: replay the step as a CUDA graph (CUDA only).
        options: Inductor config overrides on top of `INDUCTOR_OPTIONS`.
    """
    start = time.perf_counter()
    functional, fake_inputs, mode = _functional(functional_collectives(gm))
    compiled = _inductor(
        functional, fake_inputs, mode, static_input_idxs=static_input_idxs, cudagraphs=cudagraphs, options=options
    )
    return CompiledStep(
        fn=compiled, compile_time_s=time.perf_counter() - start, cudagraphs=cudagraphs, regions=1, distinct_regions=1
    )


def compile_regions(gm: torch.fx.GraphModule, *, options: dict[str, Any] | None = None) -> CompiledStep:
    """Compile the step graph `gm` region by region (`graph_trainer.compiler.regions`), each distinct region once.

    Each region is made functional on its own (so identical layers give identical
    code) and compiled the first time its code and input layouts are seen; later
    identical regions run the same compiled function on their own tensors.
    Takes and returns what `compile_step_graph` does; `gm` is not modified.
    """
    start = time.perf_counter()
    plan = split_into_regions(functional_collectives(gm))
    compiled_by_key: dict[Any, Callable] = {}
    fns = []
    for region in plan.regions:
        functional, fake_inputs, mode = _functional(region.gm)
        dying = tuple(i for i, s in enumerate(region.inputs) if s in region.drops)
        key = (dedup_key(functional, fake_inputs), dying)
        if key not in compiled_by_key:
            compiled_by_key[key] = _inductor(
                functional,
                fake_inputs,
                mode,
                static_input_idxs=(),
                cudagraphs=False,
                options=options,
                dying_inputs=dying,
            )
        fns.append(compiled_by_key[key])
    return CompiledStep(
        fn=RegionalStep(plan, fns),
        compile_time_s=time.perf_counter() - start,
        cudagraphs=False,
        regions=len(plan.regions),
        distinct_regions=len(compiled_by_key),
    )


def static_input_indices(layout: InputLayout) -> list[int]:
    """Indices of the inputs that live across steps: parameters, buffers and optimizer state (not batch, scalars)."""
    return [i for i, category in enumerate(layout.categories) if category in ("parameter", "buffer", "optimizer_state")]


class InductorStage:
    """The compile stage run on each final graph (after the pass pipeline): sets `TracedStep.compiled`.

    Takes and returns the pipeline's `Transformed` (adding its `compile_time_s`).
    The graph itself (`traced.gm`) and its memory estimate stay the uncompiled
    ones (plus `functional_gather_bytes` with FSDP): the estimate is the
    preflight's upper bound, and the graph is what passes, dumps and tests read. `GraphStep` adds up the
    compile times, logged
    as `compile/inductor_time_s`.

    Args:
        cudagraphs: replay the step as one CUDA graph (needs `regional=False`).
        regional: compile region by region, each distinct region once (`compile_regions`);
            else the whole step as one graph (`compile_step_graph`).
    """

    def __init__(self, *, cudagraphs: bool, regional: bool = False):
        self.cudagraphs, self.regional = cudagraphs, regional

    def __call__(self, result: Transformed) -> Transformed:
        traced = result.traced
        if self.regional:
            traced.compiled = compile_regions(traced.gm)
        else:
            traced.compiled = compile_step_graph(
                traced.gm, static_input_idxs=static_input_indices(traced.layout), cudagraphs=self.cudagraphs
            )
        compiled = traced.compiled
        result.compile_time_s = compiled.compile_time_s
        extra = functional_gather_bytes(traced.gm)
        if extra and result.memory_estimate is not None:
            result.memory_estimate = dataclasses.replace(
                result.memory_estimate, peak_bytes=result.memory_estimate.peak_bytes + extra
            )
        how = (
            f"{compiled.regions} regions, {compiled.distinct_regions} distinct ones compiled"
            if self.regional
            else "as one graph" + (" with CUDA graphs" if self.cudagraphs else "")
        )
        logger.info(
            f"inductor: compiled the step in {compiled.compile_time_s:.1f} s ({how}); numerics are not "
            "bitwise with eager (fused kernels round differently)"
        )
        return result
