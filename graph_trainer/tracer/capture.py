"""Capture of the whole training step as one FX graph.

`trace_step` traces forward, loss, `torch.autograd.grad`, gradient clipping and,
optionally, the optimizer update with `make_fx` on fake tensors: nothing the
size of an activation is allocated, so big models trace on a small machine.
Parameters, buffers, the batch, optimizer state and per-step host scalars all
enter as flat graph inputs, so one graph serves every step and passes can
rewrite it without a pytree calling convention to keep.

Graph outputs: `[loss, grad_norm, *grads]`, one gradient per trainable parameter
(`requires_grad=True`, in `layout.grad_names` order: frozen parameters enter the graph
but get no gradient), passed through the optional `grad_reduce` hook (e.g. the
data-parallel all-reduce), then clipped when max_norm > 0; the loss is this process's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import os
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.errors import UserError
from graph_trainer.loss import lm_loss
from graph_trainer.observability.log import get_logger
from graph_trainer.optimizer.clip import clip_grads_
from graph_trainer.tracer import fake_rules, node_meta
from graph_trainer.tracer.guards import TraceGuard, recording_reads, tensor_meta
from graph_trainer.tracer.layers import transformer_layers

_ = fake_rules  # imported for its registrations: fp32 torch._grouped_mm traces

logger = get_logger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]
# Maps the raw gradients to the ones clipped and applied, e.g. averaged over data-parallel
# ranks with traceable collectives (graph_trainer.distributed.launch.GradAverager).
GradReduce = Callable[[list[torch.Tensor]], list[torch.Tensor]]
# Maps this process's squared gradient norm to the global one when gradients are sharded
# (graph_trainer.distributed.fsdp.FSDP.norm_reduce); see graph_trainer.optimizer.adamw.clip_grads_.
NormReduce = Callable[[torch.Tensor], torch.Tensor]
# Once per step, after the gradients, under no_grad: writes the model's own per-step state (its buffers) in place,
# e.g. a mixture of experts' balancing bias (models.common.spec.ModelSpec.step_update).
StepUpdate = Callable[[nn.Module], None]


class TraceError(UserError):
    """The step could not be traced; the message names the module, source line and op.

    `problem` is the message without the advice at its end; the advice is in API
    terms unless the caller (the CLI trainer) passes its own `fix`.
    """

    API_FIX = "fix the code, or run the step untraced with graph_trainer.eager.EagerStep"

    def __init__(self, problem: str, fix: str | None = API_FIX):
        super().__init__(f"{problem}; {fix}" if fix else problem)
        self.problem, self.fix = problem, fix


class GraphOptimizer(Protocol):
    """An optimizer whose update can be traced into the step graph (see `GraphAdamW`).

    `state_tensors()` and `host_scalars()` hold the same number of tensors for each
    parameter, in `params` order: that is how the tracer tags each update op with
    its parameter's module and layer.
    """

    params: list[torch.Tensor]

    def state_tensors(self) -> list[torch.Tensor]: ...

    def host_scalars(self) -> list[torch.Tensor]: ...

    def update_(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        state: list[torch.Tensor],
        scalars: list[torch.Tensor],
    ) -> None: ...

    def after_step(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """How the flat graph inputs are laid out: params, buffers, batch leaves, optimizer state, host scalars, and
    the gradient accumulators of a micro-step or update graph (`Part`).

    `grad_names` are the trainable parameters (a subset of `param_names`, same order):
    the graph returns one gradient for each, and a traced optimizer updates exactly these.
    """

    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    batch_spec: pytree.TreeSpec
    num_batch: int
    num_opt_state: int
    num_scalars: int
    grad_names: tuple[str, ...]
    num_grad_accum: int = 0  # one per trainable parameter in a micro-step or update graph, else none

    @property
    def sizes(self) -> tuple[int, ...]:
        return (
            len(self.param_names),
            len(self.buffer_names),
            self.num_batch,
            self.num_opt_state,
            self.num_scalars,
            self.num_grad_accum,
        )

    @property
    def categories(self) -> list[str]:
        """One category per graph input, for memory accounting."""
        names = ("parameter", "buffer", "batch", "optimizer_state", "scalar", "gradient")
        return [name for name, n in zip(names, self.sizes, strict=True) for _ in range(n)]

    def split(self, flat: list) -> list[list]:
        """Split flat inputs into [params, buffers, batch leaves, optimizer state, scalars, gradient accumulators]."""
        out, start = [], 0
        for n in self.sizes:
            out.append(list(flat[start : start + n]))
            start += n
        return out


CONSTANT_LEAF_TYPES = (bool, int, float, str, type(None))

# What a traced graph covers of a training step:
#   "step"   the whole step: forward, loss, backward, gradient reduction, clipping [, update] -> [loss, norm, *grads]
#   "micro"  one micro-batch of an accumulated step: forward, loss, backward [, gradient reduction], each gradient
#            added in place into its accumulator (a graph input)                          -> [loss]
#   "update" the end of an accumulated step, on the accumulators: [gradient reduction,] clipping [, update]
#                                                                                         -> [norm, *grads]
PARTS = ("step", "micro", "update")


def as_pytree(batch: Any) -> Any:
    """`batch` with any Mapping that is not a dict (e.g. a tokenizer's BatchEncoding) made a dict, recursively."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        return {k: as_pytree(v) for k, v in batch.items()}
    if isinstance(batch, dict):
        return {k: as_pytree(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(as_pytree(v) for v in batch)
    return batch


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensor leaves of a batch, in graph-input order (Python constants are baked into the graph)."""
    return [t for t in pytree.tree_leaves(as_pytree(batch)) if isinstance(t, torch.Tensor)]


def batch_signature(batch: Any) -> tuple:
    """What a graph is specialized on in a batch: per leaf, its path, shape, dtype and device
    (for a Python constant, its type and value)."""
    leaves, _ = pytree.tree_flatten_with_path(as_pytree(batch))
    return tuple(
        (pytree.keystr(path), tuple(t.shape), t.dtype, t.device.type)
        if isinstance(t, torch.Tensor)
        else (pytree.keystr(path), type(t).__name__, t)
        for path, t in leaves
    )


def describe_change(old: tuple, new: tuple) -> str:
    """A short human reason for a signature change, e.g. "['input'] shape (4, 256) -> (4, 128)"."""
    if [leaf[0] for leaf in old] != [leaf[0] for leaf in new]:
        return f"batch structure changed: {[leaf[0] for leaf in old]} -> {[leaf[0] for leaf in new]}"
    diffs = []
    for (path, *a), (_, *b) in zip(old, new, strict=True):
        # A tensor's leaf holds (shape, dtype, device), a Python constant's (type, value): names for the longer.
        for what, x, y in zip(("shape", "dtype", "device"), a, b, strict=False):
            if x != y:
                diffs.append(f"{path} {what} {x} -> {y}")
    return "; ".join(diffs) or "signature changed"


@dataclasses.dataclass
class TracedStep:
    """A traced training step: the graph plus what is needed to feed it from the live model."""

    gm: torch.fx.GraphModule
    layout: InputLayout
    signature: tuple
    trace_time_s: float
    # Set by a compile stage (graph_trainer.compiler.inductor): runs instead of `gm`, same inputs and outputs.
    compiled: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
    # What the trace baked in besides the batch (module attributes it read, global state, trainable set).
    guard: TraceGuard | None = None

    def __call__(self, flat_inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Run a whole-step graph: (loss, grad_norm, grads)."""
        out = self.run(flat_inputs)
        return out[0], out[1], list(out[2:])

    def run(self, flat_inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's outputs, run under no_grad: autograd must not record the traced backward a second time."""
        with torch.no_grad():
            out = self.compiled(flat_inputs) if self.compiled is not None else self.gm(*flat_inputs)
        return list(out)


def check_no_compiled_autograd() -> None:
    """Refuse compiled autograd: our backward is already in the graph, and it would rewrite it."""
    enabled = getattr(getattr(torch, "_dynamo", None), "config", None)
    enabled = getattr(enabled, "compiled_autograd", False)
    try:
        from torch._dynamo import compiled_autograd

        enabled = enabled or bool(getattr(compiled_autograd, "compiled_autograd_enabled", False))
    except ImportError:  # pragma: no cover - torch without dynamo
        pass
    if enabled:
        raise TraceError(
            "torch._dynamo compiled autograd is enabled, but graph_trainer already traces "
            "the backward into the step graph; turn compiled autograd off "
            "(torch._dynamo.config.compiled_autograd = False)",
            fix=None,
        )


# Advice for a model that checkpoints itself: the graph's own memory policy does the same job.
USE_MEMORY_POLICY = (
    "turn it off (Hugging Face: model.gradient_checkpointing_disable(), or "
    "activation_checkpointing_disable() in transformers 5) and use graph_trainer's "
    "memory policy instead: GraphStep(model, transform=graph_trainer.passes."
    "memory_policy_transform('full'))"
)


def check_no_module_checkpointing(model: nn.Module) -> None:
    """Refuse a model that checkpoints its own layers (Hugging Face's `gradient_checkpointing_enable()`).

    `torch.utils.checkpoint` re-runs a layer during the backward, outside the traced
    parameters (they are swapped back by then), so the trace cannot follow it; the
    memory policy pass recomputes on the graph instead, bitwise.
    """
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is True:  # the flag transformers sets
            where = f"module '{name}'" if name else f"the model ({type(model).__name__})"
            raise TraceError(
                f"{where} has gradient checkpointing on (e.g. Hugging Face's "
                "gradient_checkpointing_enable() or activation_checkpointing_enable()): it re-runs layers with "
                "torch.utils.checkpoint "
                "during the backward, which a traced step cannot follow",
                fix=USE_MEMORY_POLICY,
            )


class _ModuleAnnotator:
    """Forward hooks that annotate every traced op with its module FQN and layer index.

    Forward annotations reach only forward nodes; `_copy_forward_annotations`
    carries them to the backward nodes afterwards. The stack of open modules also
    tells which module a failing op was in.
    """

    def __init__(self, model: nn.Module, layers: str | None = None):
        self.model = model
        self.layers = transformer_layers(model, layers)
        self.stack: list[tuple[str, contextlib.AbstractContextManager]] = []

    def _layer_of(self, fqn: str) -> int | None:
        for prefix, index in self.layers.items():
            if fqn == prefix or fqn.startswith(prefix + "."):
                return index
        return None

    @contextlib.contextmanager
    def installed(self):
        handles = []
        for fqn, module in self.model.named_modules():
            tags = {node_meta.MODULE_FQN: fqn}
            layer = self._layer_of(fqn)
            if layer is not None:
                tags[node_meta.LAYER_ID] = layer
            handles.append(module.register_forward_pre_hook(self._enter_hook(fqn, tags)))
            handles.append(module.register_forward_hook(self._exit))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            while self.stack:  # a failed forward leaves modules open
                self.stack.pop()[1].__exit__(None, None, None)

    def _enter_hook(self, fqn: str, tags: dict):
        def hook(module, args):
            ctx = fx_traceback.annotate(tags)
            ctx.__enter__()
            self.stack.append((fqn, ctx))

        return hook

    def _exit(self, module, args, output):
        self.stack.pop()[1].__exit__(None, None, None)

    def current_module(self) -> str | None:
        return self.stack[-1][0] if self.stack else None


def _draws_random_numbers(node: torch.fx.Node) -> bool:
    """Whether the op consumes the RNG. Ops tagged `nondeterministic_seeded` do, except attention
    kernels (tagged because they take a dropout_p) called with dropout_p == 0."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            value = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else arg.default_value)
            return value != 0
    return True


def _mark_random_ops(graph: torch.fx.Graph) -> None:
    """Tag ops that draw from the RNG (dropout, SDPA with dropout_p > 0) so no pass recomputes them."""
    for node in graph.nodes:
        if node.op == "call_function" and _draws_random_numbers(node):
            node.meta[node_meta.CUSTOM] = {**node.meta.get(node_meta.CUSTOM, {}), node_meta.RANDOM: True}


def _warn_nondeterministic_accumulation(graph: torch.fx.Graph) -> None:
    """Warn once per trace when an op sums duplicate indices in a thread-dependent order.

    `aten.index_put` with accumulate=True (the backward of `weight[indices]`, e.g. Hugging Face's batched_mm
    experts) gives gradients that differ by ~1e-10 between two eager runs, and so between eager and the
    graph, unless torch.use_deterministic_algorithms(True) picks its sorted kernel.
    """
    if torch.are_deterministic_algorithms_enabled():
        return
    for node in graph.nodes:
        accumulate = node.kwargs.get("accumulate", node.args[3] if len(node.args) > 3 else False)
        if node.op == "call_function" and node.target is torch.ops.aten.index_put.default and accumulate:
            logger.warning(
                f"the step accumulates with aten.index_put (accumulate=True) in module "
                f"'{node_meta.module_fqn(node)}', which sums repeated indices in a thread-dependent order: eager "
                "runs differ from each other (and from the graph) in the last bits; call "
                "torch.use_deterministic_algorithms(True) (--training.deterministic true) for bitwise runs"
            )
            return


def _link_backward_to_forward(root: Any) -> None:
    """Make each backward node carry the seq_nr of the forward op it differentiates.

    make_fx stamps `meta["seq_nr"]` on backward nodes from fx.traceback's
    grad_fn stack, which autograd itself does not fill; these hooks push each
    autograd node's sequence number while it runs (what AOTAutograd does too).
    """
    seen, queue = set(), [root]
    while queue:
        fn = queue.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        seq_nr = fn._sequence_nr()
        fn.register_prehook(lambda grad_outputs, s=seq_nr: fx_traceback.set_grad_fn_seq_nr(s))
        fn.register_hook(lambda grad_inputs, grad_outputs: fx_traceback.reset_grad_fn_seq_nr())
        queue.extend(next_fn for next_fn, _ in fn.next_functions)


def _copy_forward_annotations(graph: torch.fx.Graph) -> None:
    """Give each backward node the module FQN and layer of the forward op with the same autograd seq_nr."""
    first_forward: dict[int, torch.fx.Node] = {}
    for node in graph.nodes:
        if node_meta.is_forward(node) and node_meta.SEQ_NR in node.meta:
            first_forward.setdefault(node.meta[node_meta.SEQ_NR], node)
    for node in graph.nodes:
        if not node_meta.is_backward(node):
            continue
        source = first_forward.get(node.meta.get(node_meta.SEQ_NR))
        # annotate() shares one dict among many nodes: copy before writing.
        tags = dict(node.meta.get(node_meta.CUSTOM, {}))
        # A backward op annotated with its module while traced (a parallelism's gradient reduction) keeps it.
        if source is not None and node_meta.MODULE_FQN not in tags:
            tags[node_meta.MODULE_FQN] = node_meta.module_fqn(source)
            if node_meta.layer_id(source) is not None:
                tags[node_meta.LAYER_ID] = node_meta.layer_id(source)
        node.meta[node_meta.CUSTOM] = tags


def _user_frame(exc: BaseException) -> str:
    """'file:line: source' of the innermost frame outside torch and this tracer."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(os.path.dirname(__file__))
    best = None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = os.path.abspath(frame.filename)
        if path.startswith(torch_dir) or path.startswith(here) or frame.filename.startswith("<"):
            continue
        best = frame
    if best is None:
        return "unknown source line"
    line = (best.line or linecache.getline(best.filename, best.lineno)).strip()
    return f"{best.filename}:{best.lineno}: {line}"


def _failed_op(exc: BaseException) -> str | None:
    func = getattr(exc, "func", None)
    if func is not None:
        return str(func)
    return None


def _explain(exc: BaseException) -> str:
    name = type(exc).__name__
    checkpoint_py = os.path.join("torch", "utils", "checkpoint.py")
    if any(frame.filename.endswith(checkpoint_py) for frame in traceback.extract_tb(exc.__traceback__)):
        return (
            "the model calls torch.utils.checkpoint, which re-runs code during the backward outside the "
            f"traced parameters; {USE_MEMORY_POLICY}"
        )
    if "DataDependent" in name or "GuardOnDataDependent" in name:
        return (
            "the step reads a tensor's value in Python (data-dependent control flow, .item(), "
            "bool(tensor)), which a trace on fake tensors cannot know"
        )
    text = str(exc).lower()
    if "UnsupportedOperator" in name or ("fake" in text and "impl" in text):
        return "an op has no fake-tensor implementation (register one with torch.library.register_fake)"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else name
    return f"{name}: {first}"


def _partial_graph_code() -> str | None:
    tracer = getattr(proxy_tensor, "_CURRENT_MAKE_FX_TRACER", None)  # private: guarded
    graph = getattr(getattr(tracer, "fx_tracer", None), "graph", None)
    if graph is None:
        return None
    return graph.python_code(root_module="self", verbose=True).src


def trainable_parameter_names(model: nn.Module) -> tuple[str, ...]:
    """Names of `model`'s parameters that require grad, in `named_parameters()` order (tied ones once)."""
    return tuple(name for name, p in model.named_parameters() if p.requires_grad)


def _fake_like(mode: FakeTensorMode, t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    with mode:
        fake = torch.empty_strided(
            t.shape, t.stride(), dtype=t.dtype, device=device if device is not None else t.device
        )
    return fake


def trace_step(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn = lm_loss,
    max_norm: float = 0.0,
    optimizer: GraphOptimizer | None = None,
    device: torch.device | str | None = None,
    failure_dir: Path | None = None,
    grad_reduce: GradReduce | None = None,
    layers: str | None = None,
    norm_reduce: NormReduce | None = None,
    part: str = "step",
    step_update: StepUpdate | None = None,
) -> TracedStep:
    """Trace one whole training step of `model` on a batch shaped like `batch` (or one `part` of it).

    Args:
        model: any nn.Module whose `loss_fn(model, batch)` is traceable; it may live
            on the meta device (then pass `device`): only shapes and dtypes are read.
        batch: a pytree of tensors (e.g. {"input": ..., "labels": ...}).
        loss_fn: forward + loss; the default is the causal-LM cross-entropy.
        max_norm: clip the global grad norm to this (<= 0: compute the norm only).
        optimizer: when given, its update is traced into the graph (in place on
            params and optimizer state).
        device: the device the graph is traced for (default: where the params are).
        failure_dir: where the partial graph goes when tracing fails.
        grad_reduce: applied to the gradients right after `autograd.grad`, before
            clipping; its ops are traced into the graph in the backward phase
            (e.g. the data-parallel all-reduce).
        layers: FQN of the module whose children are the transformer blocks
            (e.g. "model.layers"); None guesses it (see `graph_trainer.tracer.layers`).
            Nodes are tagged with their block's index, and activation
            checkpointing recomputes inside blocks only.
        norm_reduce: makes the clipping norm global when gradients are sharded (see `NormReduce`).
        part: "step" (the whole step), or with gradient accumulation "micro" (a micro-batch's forward and
            backward, accumulated in place into gradient inputs) or "update" (clipping and the update on the
            accumulated gradients; `batch` is ignored): see `PARTS`.
        step_update: traced once per step after the gradients, before clipping, with the model's buffers in its
            slots: its in-place writes to them are the graph's (the "step" part's, or the "update" part's).

    Raises:
        TraceError: with the module FQN, source line and op that could not be traced.
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    _check_traceable(model, optimizer)
    device = torch.device(device) if device is not None else None
    batch = as_pytree(batch) if part != "update" else {}
    layout, constants, inputs = _lay_out_inputs(model, batch, optimizer if part != "micro" else None, part)
    step = _StepFunction(model, layout, constants, loss_fn, max_norm, optimizer, grad_reduce, norm_reduce, layers)
    step.part, step.step_update = part, step_update
    with recording_reads(model) as reads:
        gm, trace_time = _make_graph(step, _fake_inputs(inputs, layout, device), failure_dir)
    _annotate_graph(gm, layout, step.annotator)
    n_tensors = len(layout.param_names) + len(layout.buffer_names)
    named = zip((*layout.param_names, *layout.buffer_names), inputs[:n_tensors], strict=True)
    guard = TraceGuard.capture(reads, device_type(inputs, device), layout.grad_names, tensor_meta(named))
    return TracedStep(gm=gm, layout=layout, signature=batch_signature(batch), trace_time_s=trace_time, guard=guard)


def device_type(inputs: list[torch.Tensor], device: torch.device | None) -> str:
    """The device type the graph is traced for: `device`'s, else the first input's (a parameter's)."""
    return device.type if device is not None else inputs[0].device.type


# The phases of `trace_step`, in order.


def _check_traceable(model: nn.Module, optimizer: GraphOptimizer | None) -> None:
    """Refuse, before tracing, what a trace cannot follow or what has nothing to train."""
    check_no_compiled_autograd()
    check_no_module_checkpointing(model)
    params = dict(model.named_parameters())
    grad_names = trainable_parameter_names(model)
    if not grad_names:
        raise TraceError(
            "no parameter of the model requires grad, so there is nothing to train",
            fix="set requires_grad=True on the parameters to train",
        )
    if optimizer is not None and [id(p) for p in optimizer.params] != [id(params[n]) for n in grad_names]:
        raise TraceError(
            "the traced optimizer must hold exactly the model's trainable parameters "
            "(requires_grad=True), in model.named_parameters() order; build it from "
            "[p for p in model.parameters() if p.requires_grad]",
            fix=None,
        )


def _lay_out_inputs(
    model: nn.Module, batch: Any, optimizer: GraphOptimizer | None, part: str = "step"
) -> tuple[InputLayout, list[Any], list[torch.Tensor]]:
    """The graph's flat inputs: (their layout, every batch leaf in order with Python constants in place, the
    live tensors whose shapes the inputs take: parameters, buffers, batch tensors, optimizer state, scalars)."""
    leaves_with_paths, batch_spec = pytree.tree_flatten_with_path(batch)
    for path, leaf in leaves_with_paths:
        if not isinstance(leaf, (torch.Tensor, *CONSTANT_LEAF_TYPES)):
            raise TraceError(
                f"batch leaf {pytree.keystr(path)} is a {type(leaf).__name__}: a batch may hold "
                "tensors and Python bool/int/float/str/None constants (the graph is specialized on "
                "the constants' values)",
                fix="convert it to a tensor or drop it from the batch",
            )
    leaves = [leaf for _, leaf in leaves_with_paths]
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    batch_tensors_ = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    opt_state = optimizer.state_tensors() if optimizer is not None else []
    scalars = optimizer.host_scalars() if optimizer is not None else []
    grad_names = trainable_parameter_names(model)
    # Accumulators are shaped like their parameters (the shards, with FSDP).
    accums = [params[n] for n in grad_names] if part != "step" else []
    layout = InputLayout(
        tuple(params),
        tuple(buffers),
        batch_spec,
        len(batch_tensors_),
        len(opt_state),
        len(scalars),
        grad_names,
        len(accums),
    )
    return layout, leaves, [*params.values(), *buffers.values(), *batch_tensors_, *opt_state, *scalars, *accums]


class _StepFunction:
    """The function make_fx traces: flat inputs -> [loss, grad_norm, *grads], each phase annotated.

    Parameters and buffers are swapped into the model for the forward (functional_call's own mechanism, but
    around `loss_fn` rather than `forward` alone); the backward is `torch.autograd.grad`; the optimizer phase
    clips and, with a traced optimizer, updates in place. A failure records the module it happened in.
    """

    def __init__(
        self,
        model: nn.Module,
        layout: InputLayout,
        batch_leaves: list[Any],
        loss_fn: LossFn,
        max_norm: float,
        optimizer: GraphOptimizer | None,
        grad_reduce: GradReduce | None,
        norm_reduce: NormReduce | None,
        layers: str | None,
    ):
        self.model, self.layout, self.batch_leaves, self.loss_fn = model, layout, batch_leaves, loss_fn
        self.max_norm, self.optimizer = max_norm, optimizer
        self.grad_reduce, self.norm_reduce = grad_reduce, norm_reduce
        self.annotator = _ModuleAnnotator(model, layers)
        self.failure: dict[str, Any] = {}
        self.part = "step"  # see PARTS
        self.step_update: StepUpdate | None = None

    def __call__(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        params, buffers, batch, state, host, accums = self.layout.split(list(flat))
        try:
            by_name = dict(zip(self.layout.param_names, params, strict=True))
            trained = [by_name[n] for n in self.layout.grad_names]
            if self.part == "update":
                # Swapped in as for the forward: a reduction may read the model's buffers (FSDP's gradient sums).
                with self._swapped(params, buffers):
                    grads = self._reduce(accums)
                self._step_update(params, buffers)
                return [self._update(trained, grads, state, host), *grads]
            loss = self._forward(params, buffers, batch)
            grads = self._backward(loss, trained)
            if self.part == "micro":
                self._accumulate(accums, grads)
                return [loss]
            self._step_update(params, buffers)
            grad_norm = self._update(trained, grads, state, host)
            return [loss, grad_norm, *grads]
        except Exception:
            self.failure["module"] = self.annotator.current_module()
            self.failure["graph"] = _partial_graph_code()
            raise

    def _swapped(self, params: list, buffers: list):
        """The graph's parameter and buffer inputs in the model's slots (tied modules follow the one name)."""
        layout = self.layout
        tensors = {
            **dict(zip(layout.param_names, params, strict=True)),
            **dict(zip(layout.buffer_names, buffers, strict=True)),
        }
        return torch.nn.utils.stateless._reparametrize_module(self.model, tensors, tie_weights=True)

    def _forward(self, params: list, buffers: list, batch: list) -> torch.Tensor:
        layout = self.layout
        with fx_traceback.annotate({node_meta.PHASE: node_meta.FORWARD}):
            with self._swapped(params, buffers):
                tensor_leaves = iter(batch)
                leaves = [next(tensor_leaves) if isinstance(leaf, torch.Tensor) else leaf for leaf in self.batch_leaves]
                loss = self.loss_fn(self.model, pytree.tree_unflatten(leaves, layout.batch_spec))
        _link_backward_to_forward(loss.grad_fn)
        return loss

    def _backward(self, loss: torch.Tensor, trained: list[torch.Tensor]) -> list[torch.Tensor]:
        with fx_traceback.annotate({node_meta.PHASE: node_meta.BACKWARD}):
            # allow_unused: with a deferred gradient sync (FSDP's fsdp_grad_sync = "step") a micro-batch's backward
            # adds into the parallelism's own sums and returns no parameter gradient.
            grads = list(torch.autograd.grad(loss, trained, allow_unused=self.part == "micro"))
        # An accumulated step reduces once, the sums (the update part): a micro-batch keeps its gradients local.
        return self._reduce(grads) if self.part == "step" else grads

    def _reduce(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.grad_reduce is None:
            return grads
        with fx_traceback.annotate({node_meta.PHASE: node_meta.BACKWARD}):
            return list(self.grad_reduce(grads))

    def _accumulate(self, accums: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Each gradient added in place into its accumulator, as autograd accumulates into `param.grad`."""
        with fx_traceback.annotate({node_meta.PHASE: node_meta.BACKWARD}), torch.no_grad():
            for acc, grad in zip(accums, grads, strict=True):
                if grad is not None:
                    acc.add_(grad)

    def _step_update(self, params: list, buffers: list) -> None:
        """The model's once-per-step buffer update (see `trace_step`) on the graph's buffers, in the update's phase."""
        if self.step_update is None:
            return
        with fx_traceback.annotate({node_meta.PHASE: node_meta.OPTIMIZER}), torch.no_grad():
            with self._swapped(params, buffers):
                self.step_update(self.model)

    def _update(self, trained: list, grads: list, state: list, host: list) -> torch.Tensor:
        with fx_traceback.annotate({node_meta.PHASE: node_meta.OPTIMIZER}), torch.no_grad():
            grad_norm = clip_grads_(grads, self.max_norm, self.norm_reduce)
            if self.optimizer is not None:
                self.optimizer.update_(trained, grads, state, host)
        return grad_norm


def _fake_inputs(inputs: list[torch.Tensor], layout: InputLayout, device: torch.device | None) -> list[torch.Tensor]:
    """Fake tensors shaped like `inputs` on `device`: nothing the size of a parameter is allocated."""
    fake_mode = FakeTensorMode()
    n_params, n_buffers, n_batch, n_state, n_scalars, _ = layout.sizes
    first_scalar = n_params + n_buffers + n_batch + n_state
    fakes = []
    for i, t in enumerate(inputs):
        on = None if first_scalar <= i < first_scalar + n_scalars else device  # host scalars stay on the CPU
        fake = _fake_like(fake_mode, t, on)
        fakes.append(fake.requires_grad_(t.requires_grad) if i < n_params else fake)
    return fakes


def _make_graph(
    step: _StepFunction, fake_inputs: list[torch.Tensor], failure_dir: Path | None
) -> tuple[torch.fx.GraphModule, float]:
    """make_fx of `step` on fake tensors (node metadata kept, modules annotated); its time."""
    start = time.perf_counter()
    try:
        with fx_traceback.preserve_node_meta(), step.annotator.installed():
            gm = make_fx(step, tracing_mode="fake")(*fake_inputs)
    except Exception as exc:
        raise _trace_error(exc, step.failure, failure_dir) from exc
    return gm, time.perf_counter() - start


def _annotate_graph(gm: torch.fx.GraphModule, layout: InputLayout, annotator: _ModuleAnnotator) -> None:
    """What make_fx cannot annotate while tracing: backward and update ops' modules and layers, random ops."""
    _copy_forward_annotations(gm.graph)
    _tag_optimizer_ops(gm.graph, layout, annotator)
    _mark_random_ops(gm.graph)
    _warn_nondeterministic_accumulation(gm.graph)
    gm.recompile()


def _tag_optimizer_ops(graph: torch.fx.Graph, layout: InputLayout, annotator: _ModuleAnnotator) -> None:
    """Give each optimizer-phase op the module FQN and layer of the one parameter (or module's buffers) it works for.

    An op works for trainable parameter i when everything it reads of the step
    comes from parameter i: the parameter, its gradient, its share of the
    optimizer state and host scalars, or ops already working for i. An op of the
    model's step update (`ModelSpec.step_update`, e.g. a router's balancing bias)
    works for a module when all it reads are that module's buffers, or ops working
    for them. Ops that mix parameters (the global gradient norm, the clip factor)
    stay untagged. With the tags, every layer's update is a run of its own, as its
    forward and backward are, and a depth-free plan sees it in its block.
    """
    placeholders = list(graph.find_nodes(op="placeholder"))
    n_params, n_buffers, n_batch, n_state, n_scalars, n_accums = layout.sizes
    trained = [layout.param_names.index(name) for name in layout.grad_names]
    owner: dict[torch.fx.Node, int | str | None] = {}  # a trained parameter's index, or a module's FQN (buffers)
    for i, index in enumerate(trained):
        owner[placeholders[index]] = i
    for b, name in enumerate(layout.buffer_names):
        owner[placeholders[n_params + b]] = name.rpartition(".")[0]
    start = n_params + n_buffers + n_batch
    for count, first in ((n_state, start), (n_scalars, start + n_state)):
        if trained and count % len(trained) == 0:
            per_param = count // len(trained)
            for k in range(count):
                owner[placeholders[first + k]] = k // per_param
    for i in range(n_accums):
        owner[placeholders[start + n_state + n_scalars + i]] = i
    returned = graph.output_node().args[0]
    for i, grad in enumerate(returned[1:] if n_accums else returned[2:]):
        # The graph returns the clipped gradient, the result of an in-place op on the one autograd made.
        while isinstance(grad, torch.fx.Node):
            owner[grad] = i
            grad = node_meta.written_input(grad)
    for node in graph.nodes:  # a buffer written in place before the update (a forward's counts) is still its own
        written = node_meta.written_input(node)
        if node_meta.phase(node) != node_meta.OPTIMIZER and isinstance(owner.get(written), str):
            owner[node] = owner[written]
    mixed: set[torch.fx.Node] = set()  # ops that mix parameters, or read such an op and own nothing
    for node in graph.nodes:
        if node.op != "call_function" or node_meta.phase(node) != node_meta.OPTIMIZER:
            continue
        read = {owner.get(arg) for arg in node.all_input_nodes} - {None}
        reads_mixed = any(arg in mixed and arg not in owner for arg in node.all_input_nodes)
        if len(read) != 1:
            if read or reads_mixed:
                mixed.add(node)
            continue
        i = read.pop()
        if reads_mixed and node not in owner:
            # One parameter's value folded into a global one (a running sum over the gradients): the op is that
            # parameter's, but what it makes is global, so ops reading it work for no single parameter.
            mixed.add(node)
        else:
            owner[node] = i
        fqn = i if isinstance(i, str) else layout.grad_names[i].rpartition(".")[0]
        tags = {**node.meta.get(node_meta.CUSTOM, {}), node_meta.MODULE_FQN: fqn}
        layer = annotator._layer_of(fqn)
        if layer is not None:
            tags[node_meta.LAYER_ID] = layer
        node.meta[node_meta.CUSTOM] = tags


def _trace_error(exc: Exception, failure: dict, failure_dir: Path | None) -> TraceError:
    module = failure.get("module")
    where = f"module '{module}'" if module else "the loss or optimizer code"
    op = _failed_op(exc)
    msg = f"cannot trace the training step in {where} at {_user_frame(exc)}"
    if op:
        msg += f" (op {op})"
    msg += f": {_explain(exc)}"
    if failure.get("graph") and failure_dir is not None:
        failure_dir.mkdir(parents=True, exist_ok=True)
        path = failure_dir / "partial_graph.py"
        path.write_text(failure["graph"])
        msg += f"; partial graph written to {path}"
    return TraceError(msg)


__all__ = [
    "TraceError",
    "TracedStep",
    "InputLayout",
    "GraphOptimizer",
    "GradReduce",
    "NormReduce",
    "PARTS",
    "StepUpdate",
    "trace_step",
    "batch_signature",
    "check_no_compiled_autograd",
]
