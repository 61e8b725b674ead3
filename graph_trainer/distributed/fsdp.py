"""Fully sharded data parallelism (`parallelism.dp_shard`): parameters, gradients and AdamW state sharded.

Layout: plain local shards with explicit collectives, not DTensor. Every
parameter is cut along dim 0 into `world_size` equal row blocks (zero rows pad
the last ones when dim 0 does not divide) and each rank keeps its block as the
module's own `nn.Parameter`, under the parameter's usual name. The optimizer,
the gradient clip and the memory tracker therefore see only local shards, and
the traced graph takes them as inputs. Plain tensors keep the step graph one
flat ATen graph: each collective is a `_c10d_functional` node a pass can see,
count and move, with no tensor subclass for make_fx to desugar.

Units: each transformer layer is one unit, and everything else (embeddings,
final norm, output projection, tied weights) is the root unit. Under pipeline
parallelism the root is cut into one unit per module outside the layers (the
embedding, the final norm, the output projection), since the first stage reads
the embedding and the last the rest: each stage then gathers and reduces only
its own. The gradients are the same elementwise sums either way. A unit's shards
are concatenated into one flat buffer and all-gathered at once (one collective
per unit), then cut back into full parameters that are put in the modules'
parameter slots for the duration of the unit's forward:
- a layer gathers inside its own `forward` (wrapped on the instance, so eager
  `torch.utils.checkpoint` recomputes it together with its gather);
- the root gathers around the whole loss function, since a chunked loss reads
  `model.output.weight` outside `model.forward`.
The gather is `AllGather`, whose backward is one reduce-scatter per unit
(sum, then divided by the world size: the mean gradient, as the replicated
path's all-reduce), so the gradients come out sharded like the parameters.
The padding rows get zero gradients, so AdamW keeps them zero.

Mixed precision follows FSDP2's `MixedPrecisionPolicy(param_dtype, reduce_dtype)`
with its defaults (`cast_forward_inputs=True`, no `output_dtype`): with a
`param_dtype` the shards are cast to it on their way into the flat buffer, so
the all-gather, the full parameters and the compute are in that dtype (and a
layer's floating-point inputs are cast to it too, as FSDP2 does before each
module's forward); the forward's outputs, logits included, stay in it. The
gradients arrive in `param_dtype`, are cast to `reduce_dtype` (None: reduced as
they arrive) for the reduce-scatter, and the reduced shard is cast back to the
shard's dtype. Shards, their gradients and AdamW state keep the shards' dtype.

In the traced graph every node of a gather carries the collective tag
(`node_meta.COLLECTIVE`: kind "fsdp", role "param_gather", its unit and the
unit's layer) and no layer id, so activation checkpointing leaves them alone;
the `fsdp_gather` pass then decides, per unit, whether the backward re-gathers
or keeps them. The reduce-scatters and the clip norm's all-reduce carry the tag
too, with roles "grad_reduce" and "norm_reduce".

Gradient accumulation (`training.global_batch_size`): by default (`parallelism.fsdp_grad_sync = "micro_batch"`,
as FSDP2 and torchtitan do) every micro-batch's backward reduce-scatters as above and the step adds up the
sharded gradients. With "step", each unit holds a whole flat gradient sum (a non-persistent model buffer,
`GRAD_SUM`, so the traced graphs take it as an input and write it in place): the micro-batches' backwards add into
it and reduce nothing, and the step's gradient reduction (`grad_reduce`, once, after the last micro-batch)
reduce-scatters each sum and zeroes it. One collective per unit per step instead of per micro-batch, for one
unsharded gradient of every parameter held all run.

`FSDP` is this package's `Parallelism` for the mesh's `dp_shard` dimension.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.utils._pytree as pytree

from graph_trainer.distributed.mesh import Mesh
from graph_trainer.distributed.parallelism import MicroSteps, Parallelism, mean_count_over
from graph_trainer.job_config.batching import accumulation_steps
from graph_trainer.runtime.device import DTYPES
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import TracedStep, TraceError
from graph_trainer.tracer.layers import transformer_layers

c10d = torch.ops._c10d_functional
ROOT = ""  # the root unit's name
GRAD_SUM = "_fsdp_grad_sum_{}"  # the model buffer holding unit i's whole gradient sum (fsdp_grad_sync = "step")
KIND = "fsdp"  # the collective tag's kind
MESH_DIM = "dp_shard"
GRAD_SYNC, PREFETCH = "fsdp_grad_sync", "fsdp_prefetch"  # its [parallelism] options the layout search crosses
# Set on the parameters another parallelism holds (expert parallelism's experts, which gathers them with a unit of
# its own on another mesh dimension): the model's FSDP leaves them alone.
EXPERT_PARALLEL = "expert_parallel"


@dataclasses.dataclass(frozen=True)
class ShardGroup:
    """The ranks a model is sharded over: this rank's index, their number and the process group's name."""

    rank: int
    world_size: int
    group_name: str
    group: dist.ProcessGroup | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> ShardGroup:
        return cls(dist.get_rank(group), dist.get_world_size(group), group.group_name, group)


class AllGather(torch.autograd.Function):
    """All-gather of a unit's shards into one flat buffer (forward); the mean gradient, reduce-scattered (backward).

    Forward: the shards are concatenated straight into this rank's slot of the
    output buffer and gathered in place, so there is no separate send buffer:
    a send buffer would be freed by gloo's worker thread at an unknowable moment
    after the wait, and the measured peak could no longer equal the estimate.
    Backward: one reduce-scatter (sum) of the flat gradient in `reduce_dtype`
    (None: the gradient's own dtype), divided by the world size in place and
    cast to the shards' dtype; the shards' gradients are views of its output.
    `param_dtype` (None: the shards' dtype) is the dtype of the gathered buffer.
    Both directions call the `_c10d_functional` ops and wait on them explicitly,
    so eagerly they run the very ops a trace records as graph nodes.
    With `grad_sum` (fsdp_grad_sync = "step") the backward adds the whole gradient into it in place and
    returns no shard gradient: `FSDP.reduce_grad_sums` reduce-scatters the sum once per step.
    """

    @staticmethod
    def forward(
        ctx: Any,
        group: ShardGroup,
        reduce_dtype: torch.dtype | None,
        param_dtype: torch.dtype | None,
        reduce_tag: dict[str, Any] | None,
        grad_sum: torch.Tensor | None,
        *shards: torch.Tensor,
    ) -> torch.Tensor:
        ctx.group, ctx.reduce_dtype, ctx.reduce_tag = group, reduce_dtype, reduce_tag
        ctx.grad_sum = grad_sum  # not saved for backward: it is written in place by every micro-batch
        ctx.shapes = [s.shape for s in shards]
        ctx.dtype = shards[0].dtype
        numel = sum(s.numel() for s in shards)
        dtype = param_dtype or shards[0].dtype
        out = shards[0].new_empty(group.world_size * numel, dtype=dtype)
        mine = out[group.rank * numel : (group.rank + 1) * numel]
        # cat casts as it copies: no temporary low-precision copy of each shard.
        torch.cat([s.reshape(-1) for s in shards], out=mine)
        out = c10d.all_gather_into_tensor_out(mine, group.world_size, group.group_name, out=out)
        return c10d.wait_tensor(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        if ctx.grad_sum is not None:  # fsdp_grad_sync = "step": add up the whole gradient, reduce it later
            ctx.grad_sum.add_(grad)
            return (None,) * (5 + len(ctx.shapes))
        with fx_traceback.annotate({node_meta.COLLECTIVE: ctx.reduce_tag}):
            shard = _mean_shard(grad, ctx.group, ctx.reduce_dtype, ctx.dtype)
        return (None, None, None, None, None, *_cut(shard, ctx.shapes))


def _mean_shard(
    grad: torch.Tensor, group: ShardGroup, reduce_dtype: torch.dtype | None, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's shard of the mean of a unit's flat gradient over the group: one reduce-scatter (sum) in
    `reduce_dtype` (None: the gradient's own), divided by the group size in place, cast to `dtype`."""
    grad = grad.contiguous().to(reduce_dtype or grad.dtype)
    shard = c10d.wait_tensor(c10d.reduce_scatter_tensor(grad, "sum", group.world_size, group.group_name))
    return shard.div_(group.world_size).to(dtype)


def _cut(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Views of `flat`, one per shape, in order."""
    out, start = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[start : start + n].view(shape))
        start += n
    return out


@dataclasses.dataclass
class Unit:
    """One all-gather's worth of parameters: the parameters' full shapes and the module slots that hold them."""

    name: str
    shapes: list[torch.Size]  # full (unpadded) shape of each parameter
    slots: list[list[tuple[nn.Module, str]]]  # per parameter: every (module, attribute) holding it (tied weights)
    param_names: list[str]  # per parameter: its name in model.named_parameters()
    layer: int | None = None  # the transformer layer the unit is (None: the root)

    def tag(self, role: str) -> dict[str, Any]:
        """The collective tag of this unit's gather (`node_meta.PARAM_GATHER`) or gradient reduction."""
        return node_meta.collective_tag(KIND, role, self.name, self.layer)

    def shard_rows(self, world_size: int) -> list[int]:
        return [math.ceil(s[0] / world_size) for s in self.shapes]

    def current(self) -> list[torch.Tensor]:
        """The tensors in the unit's slots now: the shards (or the tracer's stand-ins for them)."""
        return [module._parameters[attr] for (module, attr), *_ in self.slots]


def _gather(
    unit: Unit,
    group: ShardGroup,
    shards: list[torch.Tensor],
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    grad_sum: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Full parameters of `unit` from this rank's shards: one all-gather, then each cut back to its shape."""
    n = group.world_size
    reduce_tag = unit.tag(node_meta.GRAD_REDUCE)
    gathered = AllGather.apply(group, reduce_dtype, param_dtype, reduce_tag, grad_sum, *shards).view(n, -1)
    full = []
    for piece, shape in zip(gathered.split([s.numel() for s in shards], dim=1), unit.shapes, strict=True):
        rows = piece.shape[1] // max(1, math.prod(shape[1:]))
        full.append(piece.reshape(n * rows, *shape[1:])[: shape[0]])
    return full


class FSDP(Parallelism):
    """A model's parameters sharded over `group` (see the module docstring); built by `fully_shard_model`."""

    kind = KIND
    label = "FSDP"
    mesh_dim = MESH_DIM
    shards_state = True
    screened_as = "sharded"
    searched_options = (GRAD_SYNC, PREFETCH)
    step_options = (GRAD_SYNC,)

    def __init__(
        self,
        model: nn.Module,
        group: ShardGroup,
        units: list[Unit],
        *,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
    ):
        self.model, self.group, self.units = model, group, units
        # As FSDP2: a param_dtype the parameters already have casts nothing (and leaves the layers' inputs alone).
        if {t.dtype for u in units for t in u.current()} == {param_dtype}:
            param_dtype = None
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self._by_name = {u.name: u for u in units}
        # Gathered around the loss function: the root, or its parts (the units outside the layers).
        self.root_units = [u.name for u in units if u.layer is None]
        self._full_shapes = self.full_shapes()
        self.defers_grad_sync = False  # fsdp_grad_sync = "step" with accumulation: see `defer_grad_sync`

    @classmethod
    def apply(cls, model: nn.Module, mesh: Mesh, cfg: Any, plan: Any) -> FSDP | None:
        """FSDP over the mesh's `dp_shard` dimension with the configured mixed precision; None when its degree is 1."""
        if mesh.size(MESH_DIM) == 1:
            return None
        t = cfg.training
        fsdp = fully_shard_model(
            model,
            ShardGroup.of(mesh.group(MESH_DIM)),
            param_dtype=DTYPES[t.mixed_precision_param],
            reduce_dtype=DTYPES[t.mixed_precision_reduce],
            layers=plan.layers,
            split_root=mesh.size("pp") > 1,  # the stages hold different parts of it
        )
        if cfg.parallelism.fsdp_grad_sync == "step" and accumulation_steps(cfg) > 1:
            fsdp.defer_grad_sync()
        return fsdp

    @classmethod
    def search_options(
        cls, degrees: Mapping[str, int], accumulation: int, offered: Mapping[str, tuple[Any, ...]]
    ) -> dict[str, tuple[Any, ...]]:
        """With accumulation both gradient syncs, and the prefetch values asked for (off unless asked)."""
        if degrees.get(MESH_DIM, 1) == 1:
            return {}
        syncs = {GRAD_SYNC: ("micro_batch", "step")} if accumulation > 1 else {}
        return {**syncs, PREFETCH: offered.get(PREFETCH, (False,))}

    @classmethod
    def describe_options(cls, options: Mapping[str, Any]) -> tuple[str, str]:
        """', prefetch' in the shape's words; 's' after the batch when the gradients sync once a step."""
        return (", prefetch" if options.get(PREFETCH) else ""), ("s" if options.get(GRAD_SYNC) == "step" else "")

    @classmethod
    def bf16_settings(cls, degrees: Mapping[str, int]) -> dict[str, str] | None:
        """bf16 gathers, as on a GPU (the trainer refuses training.dtype bfloat16 beside bf16 parameters)."""
        if degrees.get(MESH_DIM, 1) == 1:
            return None
        return {"mixed_precision_param": "bfloat16", "dtype": "auto"}

    @classmethod
    def across_micro_steps(
        cls, degrees: Mapping[str, int], options: Mapping[str, Any], parameter_bytes: int
    ) -> MicroSteps:
        """The clip norm's all-reduce runs once a step, on the accumulated gradient shards. With
        `fsdp_grad_sync = "step"` so does each unit's reduce-scatter, and each unit's whole gradient sum (dp_shard
        times the rank's shards) is held across the micro-batches; the micro-batch's graph then lacks the
        reduce-scatters that would have made shards before the peak, so the plan is an upper bound. Reducing every
        micro-batch, it is the accumulating step's peak to the byte (tests/layouts/test_search.py)."""
        shard = degrees.get(MESH_DIM, 1)
        if shard == 1:
            return MicroSteps()
        deferred = options.get(GRAD_SYNC) == "step"
        once = (f"{KIND} all_reduce", *((f"{KIND} reduce_scatter",) if deferred else ()))
        return MicroSteps(held=shard * parameter_bytes if deferred else 0, once_per_step=once, exact=not deferred)

    def defer_grad_sync(self) -> None:
        """Reduce-scatter once per step (fsdp_grad_sync = "step"): give each unit a whole gradient sum, a zeroed
        non-persistent buffer of the model (so checkpoints leave it out and the traced graphs take it as input)."""
        for i, unit in enumerate(self.units):
            shards = unit.current()
            numel = self.group.world_size * sum(t.numel() for t in shards)
            self.model.register_buffer(
                GRAD_SUM.format(i), torch.zeros(numel, dtype=shards[0].dtype, device=shards[0].device), persistent=False
            )
        self.defers_grad_sync = True

    def _grad_sum(self, unit: Unit) -> torch.Tensor | None:
        """Unit's gradient sum as the model holds it now (the tracer's stand-in while tracing), or None."""
        if not self.defers_grad_sync:
            return None
        return getattr(self.model, GRAD_SUM.format(self.units.index(unit)))

    def grad_reduce(self) -> Callable[[list[torch.Tensor]], list[torch.Tensor]] | None:
        """With a deferred gradient sync, `reduce_grad_sums` (the step's one reduction); else nothing to do:
        every backward reduce-scatters already."""
        return self.reduce_grad_sums if self.defers_grad_sync else None

    def makes_grads(self) -> bool:
        return self.defers_grad_sync

    def reduce_grad_sums(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """The sharded mean gradients from the units' whole sums (one reduce-scatter each), the sums zeroed for
        the next step. `grads`: the trainable parameters' accumulated gradients, none computed for the units'
        parameters; another parallelism's (expert parallelism's experts, reduced in each backward) pass through."""
        by_name = {}
        for unit in self.units:
            total = self._grad_sum(unit)
            shards = unit.current()
            with fx_traceback.annotate({node_meta.COLLECTIVE: unit.tag(node_meta.GRAD_REDUCE)}):
                shard = _mean_shard(total, self.group, self.reduce_dtype, shards[0].dtype)
            total.zero_()  # after the reduce-scatter's wait: the next step starts from zero
            by_name.update(zip(unit.param_names, _cut(shard, [t.shape for t in shards]), strict=True))
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        assert len(names) == len(grads), "one gradient per trainable parameter"
        return [by_name.get(n, g) for n, g in zip(names, grads, strict=True)]

    @contextlib.contextmanager
    def gathered(self, name: str):
        """Inside: the unit's module slots hold full parameters computed (differentiably) from its shards."""
        unit = self._by_name[name]
        shards = unit.current()
        # The nodes of the gather belong to no layer: the fsdp_gather pass, not activation checkpointing,
        # decides whether the backward reads them or gathers again.
        with fx_traceback.annotate({node_meta.COLLECTIVE: unit.tag(node_meta.PARAM_GATHER), node_meta.LAYER_ID: None}):
            full = _gather(unit, self.group, shards, self.param_dtype, self.reduce_dtype, self._grad_sum(unit))
        for slots, t in zip(unit.slots, full, strict=True):
            for module, attr in slots:
                module._parameters[attr] = t
        try:
            yield
        finally:
            for slots, s in zip(unit.slots, shards, strict=True):
                for module, attr in slots:
                    module._parameters[attr] = s

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """`loss_fn` run with the root unit (or its parts) gathered (the layers gather in their own forward)."""
        if not self.root_units:
            return loss_fn

        @functools.wraps(loss_fn)
        def loss(model: nn.Module, batch: Any) -> torch.Tensor:
            with contextlib.ExitStack() as stack:
                for name in self.root_units:
                    stack.enter_context(self.gathered(name))
                return loss_fn(model, batch)

        return loss

    def release(self, names: Collection[str]) -> None:
        """Forget the parameters `names`, which this rank no longer holds (pipeline parallelism removed another
        stage's embedding or output after FSDP sharded them): their units, emptied, go too."""
        kept = []
        for unit in self.units:
            keep = [i for i, n in enumerate(unit.param_names) if n not in names]
            if keep:
                unit.shapes = [unit.shapes[i] for i in keep]
                unit.slots = [unit.slots[i] for i in keep]
                unit.param_names = [unit.param_names[i] for i in keep]
                kept.append(unit)
        self.units = kept
        self._by_name = {u.name: u for u in kept}
        self.root_units = [n for n in self.root_units if n in self._by_name]
        self._full_shapes = {n: s for n, s in self._full_shapes.items() if n not in names}

    def norm_reduce(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self._global_sq_norm

    def count_reduce(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return mean_count_over(self.group.group, self.group.world_size)

    def _global_sq_norm(self, sq_norm: torch.Tensor) -> torch.Tensor:
        """The global squared gradient norm from this rank's: summed over the ranks (a traceable all-reduce)."""
        with fx_traceback.annotate({node_meta.COLLECTIVE: node_meta.collective_tag(KIND, node_meta.NORM_REDUCE)}):
            return c10d.wait_tensor(c10d.all_reduce(sq_norm, "sum", self.group.group_name))

    def check_traced(self, traced: TracedStep) -> TracedStep:
        return check_gathered(traced, self._full_shapes)

    def shard_sum(self) -> Callable[[float], float]:
        return self._sum_over_group

    def _sum_over_group(self, value: float) -> float:
        total = torch.tensor(value, dtype=torch.float64, device=self._device())
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group.group)
        return total.item()

    def _device(self) -> torch.device:
        return self.units[0].current()[0].device

    def full_shapes(self) -> dict[str, torch.Size]:
        """The logical (unpadded) shape of every parameter, under each name it is held by (tied weights: two)."""
        full_by_id = {id(t): shape for u in self.units for t, shape in zip(u.current(), u.shapes, strict=True)}
        return {
            name: full_by_id[id(p)]
            for name, p in self.model.named_parameters(remove_duplicate=False)
            if id(p) in full_by_id
        }

    def local_slices(self, name: str, local: torch.Tensor) -> tuple[slice, ...] | None:
        """This rank's row block of `name` (torch.chunk's, as `_shard` cut it), the padding rows left out. `name`'s
        full shape is the one FSDP sharded: TP's block under tensor parallelism (`ParallelModel` places it)."""
        full_shape = self._full_shapes.get(name)
        if full_shape is None:
            return None
        rows = local.shape[0]
        start = min(self.group.rank * rows, full_shape[0])
        return (slice(start, min(start + rows, full_shape[0])), *(slice(0, n) for n in full_shape[1:]))

    def full_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` with every parameter gathered whole (unpadded), by name: for comparisons and exports, not for
        training. A collective: every rank of the group must call it.
        """
        out = dict(state)
        with torch.no_grad():
            for unit in self.units:
                for name, t in zip(
                    unit.param_names, _gather(unit, self.group, unit.current(), None, None), strict=True
                ):
                    out[name] = t.clone()
        return out

    def num_params(self) -> int:
        """Parameters of the whole (unsharded) model."""
        return sum(math.prod(shape) for u in self.units for shape in u.shapes)

    def shard_numel(self) -> int:
        """Elements this rank holds (padding included)."""
        return sum(t.numel() for u in self.units for t in u.current())


def _param_slots(
    module: nn.Module, prefix: str, skip: set[str]
) -> dict[int, tuple[nn.Parameter, str, list[tuple[nn.Module, str]]]]:
    """id(param) -> (param, first name, every slot holding it), over `module` minus submodules named in `skip`."""
    found: dict[int, tuple[nn.Parameter, str, list]] = {}
    for mod_name, mod in module.named_modules(prefix=prefix, remove_duplicate=False):
        if any(mod_name == s or mod_name.startswith(s + ".") for s in skip):
            continue
        for attr, p in mod._parameters.items():
            if p is None or getattr(p, EXPERT_PARALLEL, False):  # split by expert parallelism, not FSDP's
                continue
            entry = found.setdefault(id(p), (p, f"{mod_name}.{attr}" if mod_name else attr, []))
            entry[2].append((mod, attr))
    return found


def _shard(p: torch.Tensor, group: ShardGroup) -> nn.Parameter:
    """This rank's row block of `p` (dim 0), zero-padded to ceil(rows / world_size) rows."""
    rows = math.ceil(p.shape[0] / group.world_size)
    start = min(group.rank * rows, p.shape[0])
    block = p.detach()[start : start + rows]
    shard = torch.zeros((rows, *p.shape[1:]), dtype=p.dtype, device=p.device)
    if shard.device.type != "meta":
        shard[: block.shape[0]].copy_(block)
    return nn.Parameter(shard, requires_grad=p.requires_grad)


def fully_shard_model(
    model: nn.Module,
    group: ShardGroup,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    layers: str | None = None,
    split_root: bool = False,
) -> FSDP:
    """Replace every parameter of `model` by this rank's shard, in place, and install the gathers.

    Every rank must call it on an identically initialized model. Parameter names
    and order (`model.named_parameters()`) are unchanged; only shapes change.
    `param_dtype` / `reduce_dtype`: mixed precision as FSDP2's `MixedPrecisionPolicy`
    (see the module docstring); None keeps the parameters' dtype. `layers` names the
    container of the transformer blocks, each one unit (None: found as the tracer finds it). `split_root`: the
    parameters outside the blocks make one unit per top-level module holding them (named by it), and one for the
    model's own, rather than one root unit.

    Raises:
        ValueError: a 0-dimensional parameter (it has no dim 0 to shard).
    """
    layer_index = transformer_layers(model, layers)
    blocks = list(layer_index)
    groups = [(name, model.get_submodule(name), set()) for name in blocks]
    if split_root:
        outside = [name for name, _ in model.named_children() if not any(b.startswith(name + ".") for b in blocks)]
        groups += [(name, model.get_submodule(name), set()) for name in outside]
        groups.append((ROOT, model, set(blocks) | set(outside)))  # the model's own parameters, if any
    else:
        groups.append((ROOT, model, set(blocks)))
    units = []
    for name, module, skip in groups:
        found = _param_slots(module, name, skip)
        if not found:
            continue
        shapes, slots, names = [], [], []
        for p, pname, where in found.values():
            if p.dim() == 0:
                raise ValueError(f"parameter {pname} is 0-dimensional; FSDP shards dim 0")
            shard = _shard(p, group)
            for mod, attr in where:
                mod._parameters[attr] = shard
            shapes.append(p.shape)
            slots.append(where)
            names.append(pname)
        units.append(Unit(name, shapes, slots, names, layer_index.get(name)))
    fsdp = FSDP(model, group, units, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for name in blocks:
        if name in fsdp._by_name:
            layer = model.get_submodule(name)
            layer.forward = functools.partial(_gathered_forward, fsdp, name, type(layer).forward.__get__(layer))
            layer.forward.fsdp_inner = type(layer).forward.__get__(layer)  # what eager checkpointing must wrap
    return fsdp


def check_gathered(traced: TracedStep, held: Collection[str] | None = None) -> TracedStep:
    """`traced` unchanged if every read of a parameter in it goes through the parameter's gather.

    The graph's parameter inputs are this rank's shards. Outside the optimizer
    update, only the FSDP gather may read them; any other read computes on a
    shard where the full parameter was meant (e.g. a regularizer on a layer's
    weight written outside that layer's forward), which would be silently wrong.

    `held`: the parameters FSDP shards (None: every parameter of the graph).

    Raises:
        TraceError: naming the parameter, the op and the module that read it.
    """
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    param_nodes = traced.layout.split(placeholders)[0]  # the parameters lead the graph's inputs
    for name, node in zip(traced.layout.param_names, param_nodes, strict=True):
        if held is not None and name not in held:  # another parallelism's parameter (expert parallelism's experts)
            continue
        for user in node.users:
            if node_meta.gathered_unit(user) is None and node_meta.phase(user) != node_meta.OPTIMIZER:
                where = node_meta.module_fqn(user) or "the loss function (outside model.forward)"
                raise TraceError(
                    f"parameter {name} is read un-gathered (this rank's shard, {list(node.meta['val'].shape)}) "
                    f"by {user.target} in {where}: with parallelism.dp_shard a parameter is whole only inside its "
                    "own layer's forward (layer parameters) or the loss function (the others)",
                    fix="compute with it there, or use --parallelism.dp_replicate",
                )
    return traced


def _gathered_forward(fsdp: FSDP, name: str, forward: Callable, *args: Any, **kwargs: Any) -> Any:
    if fsdp.param_dtype is not None:
        # FSDP2's cast_forward_inputs: e.g. the RoPE tables reach each layer in the parameters' dtype.
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, functools.partial(_cast_floating, fsdp.param_dtype), (args, kwargs)
        )
    with fsdp.gathered(name):
        return forward(*args, **kwargs)


def _cast_floating(dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    return t.to(dtype) if torch.is_floating_point(t) else t


def layer_forward(layer: nn.Module) -> Callable:
    """The forward eager activation checkpointing should wrap: the FSDP-gathering one when the layer has it."""
    own = layer.__dict__.get("forward")
    if own is not None and hasattr(own, "fsdp_inner"):
        return own
    return type(layer).forward.__get__(layer)


__all__ = [
    "EXPERT_PARALLEL",
    "AllGather",
    "FSDP",
    "ShardGroup",
    "Unit",
    "check_gathered",
    "fully_shard_model",
    "layer_forward",
    "ROOT",
]
