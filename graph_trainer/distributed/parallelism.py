"""The parallelism seam: the small interface every parallelism implements, and a model parallelized by them.

A `Parallelism` splits a step's work over one dimension of the mesh (`graph_trainer.distributed.mesh`).
It is applied to the model in place by its `apply` (which returns None when the job does not use it), and
then answers the few questions the step, the clip, the divergence guard and the checkpoint ask:

- `wrap_loss`: the loss function as it must run (FSDP gathers the root unit around it);
- `count_reduce`: with gradient accumulation, the divisor of each rank's summed loss (tokens over the ranks);
- `grad_reduce` / `norm_reduce`: hooks traced into the step graph after the backward (replication averages
  the gradients; sharded gradients make the clip norm a sum over the ranks); `makes_grads`: whose gradient hook
  makes the gradients (FSDP's once-per-step sync) and so runs before the others';
- `allows`: whether it can split a model at given degrees (the trainer, the dry run and the search ask it);
- `across_micro_steps`: what it holds, and which collectives it runs once, in a step of several micro-batches;
- `check_traced`: refuse a traced step that the parallelism cannot run right;
- `step_metrics`: its own figures for each step's record (expert parallelism's dropped rows);
- the facts the layout search reads through `distributed/layout.py` (`carved_from`, `shards_state`,
  `within_node`, `screened_as`, `search_degrees`, `search_options`, `bf16_settings`, `reference_comm`), so that
  the search names no parallelism;
- `shard_sum`, `full_shapes`, `full_state`, `local_slices`: what the divergence guard, the checkpoint, exports
  and the loading of pretrained weights need of parameters that no rank holds whole. A parameter split by two
  parallelisms (FSDP's row block of TP's block) is answered by both: `ParallelModel.local_slices` composes them.

Every collective a parallelism puts in the graph is annotated with one tag (`node_meta.COLLECTIVE`: kind,
role, unit, layer), so the passes count, size, keep or re-issue collectives without knowing who made them.

`ParallelModel` composes the parallelisms a job uses. With none (one process) every answer is "nothing to
do", so the trainer, the builder and the planner never ask whether a model is sharded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from graph_trainer.distributed.mesh import Mesh, ring
from graph_trainer.step import CountReduce
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import GradReduce, LossFn, NormReduce, TracedStep
from graph_trainer.tracer.layers import transformer_layers

Owner = tuple[str, int | None]  # a parameter's module FQN and the index of the block it is in (None: outside them)


def mean_count_over(group: dist.ProcessGroup, world_size: int) -> CountReduce:
    """A `count_reduce` for gradients averaged over `group`: the valid tokens summed over it, divided by its size."""

    def reduce(count: torch.Tensor) -> torch.Tensor:
        total = count.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total / world_size

    return reduce


def gradient_owners(model: nn.Module, layers: str | None) -> list[Owner]:
    """The owner of each gradient the step's `grad_reduce` hook receives (the trainable parameters, in
    `named_parameters` order), blocks found in the container `layers` (the family's `ParallelPlan.layers`)."""
    blocks = transformer_layers(model, layers)
    owners = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            module = name.rpartition(".")[0]
            layer = next((i for fqn, i in blocks.items() if module == fqn or module.startswith(fqn + ".")), None)
            owners.append((module, layer))
    return owners


def owned_by(owner: Owner) -> dict[str, Any]:
    """Node tags (for `fx.traceback.annotate`) that make a gradient reduction an op of its parameter's module and
    block, as the rest of the block: a model's blocks then hold identical op sequences, which the depth-free plan
    (graph_trainer/plan/block_plan.py) relies on. Untagged, the reductions would sit outside the blocks, one more
    per parameter with every block, and no short trace could stand for the whole depth."""
    module, layer = owner
    tags: dict[str, Any] = {node_meta.MODULE_FQN: module}
    if layer is not None:
        tags[node_meta.LAYER_ID] = layer
    return tags


@dataclasses.dataclass(frozen=True)
class MicroSteps:
    """A parallelism's part in a step of several micro-batches beyond one micro-batch's graph: the bytes it holds
    alive across them (`held`), and its collectives, named as a plan counts them ('<kind> <op>'), that run once a
    step instead of once a micro-batch (`once_per_step`)."""

    held: int = 0
    once_per_step: tuple[str, ...] = ()
    # Whether one micro-batch's plan plus these is the accumulating step's peak to the byte (tested so), an upper
    # bound (False), or this parallelism has no say (None).
    exact: bool | None = None


@dataclasses.dataclass(frozen=True)
class ScheduleModel:
    """The layout search's model of a rank's step under a parallelism that runs each micro-batch through stages
    (pipeline parallelism), read off a one-process plan of one micro-batch of `micro_batch` sequences: in a step
    the rank does `work` times that micro-batch's work (its stages' share of every micro-batch), holds `state` of
    its state, keeps `in_flight` times its activations at its peak and `held_bytes` of receive buffers, idles `idle`
    of its compute time (the bubble), and sends `p2p_bytes` to its neighbours, counted as `p2p_key` ('<kind>
    send_recv')."""

    micro_batch: int
    work: float
    state: float
    in_flight: float
    held_bytes: int
    idle: float
    p2p_bytes: int
    p2p_key: str


class Parallelism:
    """One way of splitting the work over a mesh dimension. Every method's default does nothing."""

    kind: str = ""  # the `kind` of its collectives' tags, e.g. "fsdp"
    label: str = ""  # what a user calls it, e.g. "FSDP"
    mesh_dim: str = ""  # the mesh dimension its collectives run over ("" when it has none of its own)

    # What the layout search asks (`distributed/layout.py` reads these off the registered parallelisms; the search
    # itself names none). Its degree is the [parallelism] option named `mesh_dim`.
    carved_from: str = ""  # the mesh dimension its degree divides, when it multiplies no new ranks (ep: dp_shard)
    shards_state: bool = False  # parameters, gradients and optimizer state divided by its degree
    within_node: bool = False  # its rings must stay inside a node (a collective in every layer)
    # How the search's screen stands for its degree: "itself" (the reference plan has the same degree), "sharded"
    # (one degree > 1 stands for every other: the sharded state scales with 1 / degree), "left_out" (planned at 1,
    # its once-a-step collectives added: `reference_comm`) or "staged" (planned at 1, one micro-batch, and turned
    # into a rank's step by its `schedule_model`; references are not shared across its degrees).
    screened_as: str = "itself"
    searched: bool = True  # whether the search offers its degrees (False until its cost is modelled)
    plans_apart: bool = False  # --dry-run plans its ranks apart (`planned_ranks`, `plan.stage_plan`), not rank 0
    searched_options: tuple[str, ...] = ()  # its [parallelism] options the search may set (`search_options`)
    step_options: tuple[str, ...] = ()  # those of the whole step, not of one micro-batch's plan

    @classmethod
    def planned_ranks(cls, world_size: int, degree: int) -> list[int]:
        """When it `plans_apart`: the ranks of a job of `world_size` ranks and this `degree` whose plans differ
        (one a position along its mesh dimension), in order."""
        raise NotImplementedError

    @classmethod
    def apply(cls, model: nn.Module, mesh: Mesh, cfg: Any, plan: Any) -> Parallelism | None:
        """This parallelism applied to `model` in place for the job `cfg` on `mesh`; None when the job does not
        use it. `plan` is the model family's `ParallelPlan` (models/common/spec.py)."""
        raise NotImplementedError

    @classmethod
    def refuses(cls, cfg: Any, n_layers: int) -> str | None:
        """Why the job `cfg` (a model of `n_layers` blocks) cannot run with this parallelism's degree above 1,
        beyond what `allows` reads off the model: options it cannot run beside yet, in the one line `apply` raises;
        None when it can. The layout search skips a candidate for it (`parallelize.config_refusal`)."""
        return None

    @classmethod
    def allows(cls, block: nn.Module, plan: Any, degrees: Mapping[str, int], seq_len: int) -> str | None:
        """Why this parallelism cannot split the model at `degrees` (the mesh's, with `ep`), said in words; None
        when it can. `block` is the model with one block (on meta is enough: only sizes are read, and `block.args`
        holds the family's arguments); `plan` its family's `ParallelPlan`. The one check: `apply` refuses with it
        (the trainer and the dry run), the search skips layouts with it (`parallelize.refusal`)."""
        return None

    @classmethod
    def across_micro_steps(
        cls, degrees: Mapping[str, int], options: Mapping[str, Any], parameter_bytes: int
    ) -> MicroSteps:
        """What this parallelism changes in a step of several micro-batches, planned from one micro-batch's plan
        (`plan/accumulate.py`) in a layout of `degrees` with the [parallelism] `options` the step sets (those not
        given at their defaults), for a rank holding `parameter_bytes` of parameters."""
        return MicroSteps()

    @classmethod
    def search_degrees(cls, model_args: Any, host: int) -> list[int]:
        """A carved parallelism's degrees worth searching when its host dimension (`carved_from`) has degree
        `host`, for a model of `model_args`; 1 first."""
        return [1]

    @classmethod
    def search_options(
        cls, degrees: Mapping[str, int], accumulation: int, offered: Mapping[str, tuple[Any, ...]]
    ) -> dict[str, tuple[Any, ...]]:
        """Its [parallelism] options the search crosses at `degrees` with `accumulation` micro-steps, each with
        its values (`offered`: the values the user asks the search to try, by option)."""
        return {}

    @classmethod
    def describe_options(cls, options: Mapping[str, Any]) -> tuple[str, str]:
        """(words for the plan's shape, e.g. ", prefetch"; a mark after the batch column, e.g. "s") for the
        options a candidate sets."""
        return "", ""

    @classmethod
    def bf16_settings(cls, degrees: Mapping[str, int]) -> dict[str, str] | None:
        """The [training] options that run a bf16 step at `degrees` when this parallelism decides them (FSDP:
        bf16 gathered parameters, which set the compute dtype); None when it has no say."""
        return None

    @classmethod
    def schedule_model(
        cls, degrees: Mapping[str, int], options: Mapping[str, Any], local_batch: int, sequence_bytes: int
    ) -> ScheduleModel | None:
        """When it runs each micro-batch through stages at `degrees` (the search's screen plans it at 1): its
        model of the step with the [parallelism] `options` and `local_batch` sequences, each of whose activation
        between two stages is `sequence_bytes`; None when it does not."""
        return None

    @classmethod
    def reference_comm(cls, degrees: Mapping[str, int], gradient_bytes: int) -> dict[str, int]:
        """For `screened_as = "left_out"`: the collectives, '<kind> <op>' -> bytes a step, that the screen adds to a
        plan made without it, for a rank holding `gradient_bytes` of gradients."""
        return {}

    @classmethod
    def ring(cls, degrees: Mapping[str, int]) -> tuple[int, int]:
        """(size, stride) of the rings its collectives run on in a layout of `degrees` (`mesh.ring`)."""
        return ring(cls.mesh_dim, degrees)

    def wrap_loss(self, loss_fn: LossFn) -> LossFn:
        """`loss_fn` as it must run under this parallelism."""
        return loss_fn

    def splits_model(self) -> bool:
        """Whether a rank holds only some of the parameters, each whole (pipeline stages): every rank then
        checkpoints its own, as for sharded parameters."""
        return False

    def traced_model(self, model: nn.Module) -> nn.Module:
        """The model the step traces: `model` itself, unless this rank holds only part of it (pipeline stages: the
        whole model on the meta device, whose graph is then cut)."""
        return model

    def micro_batches_per_step(self) -> int | None:
        """How many micro-batches this parallelism cuts each local batch into (pipeline parallelism's schedule): the
        traced graph is then one micro-batch's (`trace_step`'s "micro" part); None when it cuts none."""
        return None

    def wrap_step(self, step: Any, optimizer: torch.optim.Optimizer | None, max_norm: float, parallel: Any) -> Any:
        """The training step the job runs around `step` (a traced `GraphStep`, or an `EagerStep` under `compile.mode
        eager`, which then runs no update of its own when this parallelism runs the step: it is given the
        `optimizer` and the clipping norm). `step`
        itself for a parallelism that leaves the step to the graph. `parallel` is the job's `ParallelModel`: a
        step that runs the graph's parts itself tells the other parallelisms what they need (`release`,
        `gathered_norms`)."""
        return step

    def gathered_norms(self, norms: Mapping[str, torch.Tensor]) -> None:
        """Under pipeline parallelism, before the clip's norm reduction: every trained parameter's gradient norm
        (this rank's part of it), by name, every stage's, gathered over the pp ranks. A norm reduction that reads
        the gradients themselves (TP's replicated norms, counted once) reads other stages' from here."""

    def release(self, names: Collection[str]) -> None:
        """Forget the parameters `names`, removed from the rank's model after this parallelism split them
        (pipeline stages drop another stage's embedding or output once the cut says which stage reads them)."""

    def holds(self, name: str) -> bool:
        """Whether the rank's state dict entry `name` is this rank's to save and load: not another pipeline stage's
        block's buffer, which the rank's model keeps but never updates (a stale copy of a tensor another rank
        holds live)."""
        return True

    def runs_step(self) -> bool:
        """Whether `wrap_step` runs the step around the traced graph (then the graph runs no update)."""
        return False

    def grad_reduce(self) -> GradReduce | None:
        """Traced after `autograd.grad`, before clipping: maps the raw gradients to the ones applied."""
        return None

    def makes_grads(self) -> bool:
        """Whether `grad_reduce` makes the gradients from sums this parallelism held back during the micro-batches
        (FSDP's `fsdp_grad_sync = "step"`) rather than mapping the backward's: its hook then runs before the
        others', which reduce what it made (TP sums the norms' gradients over tp)."""
        return False

    def norm_reduce(self) -> NormReduce | None:
        """Maps this rank's squared gradient norm to the global one (sharded gradients)."""
        return None

    def count_reduce(self) -> CountReduce | None:
        """Maps this rank's count of valid tokens to its loss divisor when the gradient reduction averages over
        ranks: the count over the ranks divided by their number (a collective, outside the graph, once a step)."""
        return None

    def check_traced(self, traced: TracedStep) -> TracedStep:
        """`traced` unchanged, or a `TraceError` naming what this parallelism cannot run."""
        return traced

    def step_metrics(self, model: nn.Module) -> dict[str, float]:
        """This parallelism's figures for the step's record, read after the step (the same on every rank: a
        collective when they sum over ranks). It says what needs saying (a warning) once, itself."""
        return {}

    def shard_sum(self) -> Callable[[float], float] | None:
        """Turns a per-rank sum over this rank's parameter shards into the sum over the whole parameters (a
        collective, outside the graph: the divergence guard's parameter norm); None when nothing is sharded."""
        return None

    def full_shapes(self) -> dict[str, torch.Size]:
        """Logical shape of every parameter this parallelism shards, by every name it is held under."""
        return {}

    def full_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (every parameter by name, as the parallelisms applied after this one leave it: their parts
        gathered) with this parallelism's parts gathered whole too. A collective: every rank calls it."""
        return state

    def local_slices(self, name: str, local: torch.Tensor) -> tuple[slice, ...] | None:
        """Which part of `name` as this parallelism received it (the full parameter, or the block an earlier
        parallelism left: TP's block for FSDP) this rank holds, one slice per dimension (padding left out: the
        rank may hold more rows than the slice), or None when this parallelism does not split `name`. `local`
        is this rank's part after every parallelism. Lets checkpoints and pretrained weights be read and
        written part by part."""
        return None


class ParallelModel:
    """A model and the parallelisms applied to it, answering for all of them (see the module docstring).

    When the step traces another model than the rank's (pipeline stages trace a meta copy of the whole model), the
    parallelisms applied after the one that made the copy are applied to the copy as well (`traced_parts`): the
    traced graph then gathers, shards and reduces as the rank runs it. What the trace and the step run (the loss as
    the parallelisms wrap it, the checks of the traced graph, the gradient, norm and token-count hooks, which take
    the gradients in the traced model's order) comes from the copy's (`tracing_parts`); what the rank holds (shapes,
    slices, full state, checkpoints) from the rank's own (`parts`)."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        parts: Sequence[Parallelism] = (),
        traced_parts: Sequence[Parallelism] | None = None,
    ):
        self.model, self.mesh, self.parts = model, mesh, list(parts)
        self.tracing_parts = self.parts if traced_parts is None else list(traced_parts)

    @property
    def shards_state(self) -> bool:
        """Whether some parameter is held in parts, or some rank holds only some of them (then every rank
        checkpoints its own)."""
        return bool(self.full_shapes()) or any(p.splits_model() for p in self.parts)

    def describe(self) -> str:
        """e.g. 'FSDP' or 'one process'."""
        return " + ".join(p.label for p in self.parts) or "one process"

    def wrap_loss(self, loss_fn: LossFn) -> LossFn:
        """The loss as the traced model runs it."""
        for part in self.tracing_parts:
            loss_fn = part.wrap_loss(loss_fn)
        return loss_fn

    def traced_model(self) -> nn.Module:
        """The model the step traces (`Parallelism.traced_model`; `model` for most jobs)."""
        model = self.model
        for part in self.parts:
            model = part.traced_model(model)
        return model

    def micro_batches_per_step(self) -> int | None:
        return next((n for p in self.parts if (n := p.micro_batches_per_step()) is not None), None)

    def runs_step(self) -> bool:
        return any(p.runs_step() for p in self.parts)

    def wrap_step(self, step: Any, optimizer: torch.optim.Optimizer | None, max_norm: float) -> Any:
        for part in self.parts:
            step = part.wrap_step(step, optimizer, max_norm, self)
        return step

    def gathered_norms(self, norms: Mapping[str, torch.Tensor]) -> None:
        """Every stage's gradient norms, by name, to the hooks reducing the clip norm (`Parallelism.gathered_norms`)."""
        for part in self.tracing_parts:
            part.gathered_norms(norms)

    def release(self, names: Collection[str]) -> None:
        """Tell every parallelism that the rank no longer holds the parameters `names` (`Parallelism.release`)."""
        for part in self.parts:
            part.release(names)

    def holds(self, name: str) -> bool:
        """Whether the rank's state dict entry `name` is the rank's own to checkpoint (`Parallelism.holds`)."""
        return all(part.holds(name) for part in self.parts)

    # The hooks on the step's gradients, norm and token count: the traced model's, whose gradients they are (the
    # rank's own parts but for a pipeline's, whose gradients come in the whole model's order).
    def grad_reduce(self) -> GradReduce | None:
        parts = self.tracing_parts
        makers = [p for p in parts if p.makes_grads()]  # first: the others reduce the gradients they make
        return _chain([p.grad_reduce() for p in makers + [p for p in parts if p not in makers]])

    def norm_reduce(self) -> NormReduce | None:
        return _chain([p.norm_reduce() for p in self.tracing_parts])

    def count_reduce(self) -> CountReduce | None:
        return _chain([p.count_reduce() for p in self.tracing_parts])

    def step_metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for part in self.parts:
            metrics.update(part.step_metrics(self.model))
        return metrics

    def check_traced(self, traced: TracedStep) -> TracedStep:
        for part in self.tracing_parts:
            traced = part.check_traced(traced)
        return traced

    def shard_sum(self) -> Callable[[float], float] | None:
        return _chain([p.shard_sum() for p in self.parts])

    def full_shapes(self) -> dict[str, torch.Size]:
        """The logical shape of every parameter the rank holds that some parallelism splits."""
        return _logical_shapes(self.parts)

    def whole_shapes(self) -> dict[str, torch.Size]:
        """The logical shape of every tensor of the whole model's state dict (the traced model's: every stage's
        under pipeline parallelism), by name: what a checkpoint of the job holds."""
        logical = _logical_shapes(self.tracing_parts)
        return {name: logical.get(name, t.shape) for name, t in self.traced_model().state_dict().items()}

    def local_slices(self, name: str, local: torch.Tensor) -> tuple[slice, ...]:
        """The part of the full parameter `name` that this rank's `local` holds, padding left out (the whole of
        it when no parallelism splits it). Each parallelism's slice lies inside the block of those applied before
        it (FSDP's rows inside TP's block), so the answers compose in the order they were applied."""
        box = None
        for part in self.parts:
            found = part.local_slices(name, local)
            if found is not None:
                box = found if box is None else tuple(_within(o, i) for o, i in zip(box, found, strict=True))
        return box if box is not None else tuple(slice(0, n) for n in local.shape)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by name (sharded ones gathered): for comparisons and exports."""
        state = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        for part in reversed(self.parts):  # undo the last split first (FSDP's shards of TP's blocks)
            state = part.full_state(state)
        return state


def _logical_shapes(parts: Sequence[Parallelism]) -> dict[str, torch.Size]:
    shapes: dict[str, torch.Size] = {}
    for part in reversed(parts):  # a later part shards the parts an earlier one made: the earlier knows the logical
        shapes.update(part.full_shapes())  # shape
    return shapes


def _within(outer: slice, inner: slice) -> slice:
    """`inner`, a slice of the block that `outer` cuts from a dimension, as a slice of the dimension: shifted by
    the block's start and cut at its end (the block's padding holds no real entries)."""
    start = min(outer.start + inner.start, outer.stop)
    return slice(start, max(start, min(outer.start + inner.stop, outer.stop)))


def _chain(hooks: list[Callable[[Any], Any] | None]) -> Callable[[Any], Any] | None:
    """The hooks applied in order, or None when there are none (the step then traces no hook at all)."""
    hooks = [h for h in hooks if h is not None]
    if not hooks:
        return None
    if len(hooks) == 1:
        return hooks[0]

    def chained(value: Any) -> Any:
        for hook in hooks:
            value = hook(value)
        return value

    return chained


def parallelize(
    model: nn.Module, mesh: Mesh, cfg: Any, plan: Any, parallelisms: Sequence[type[Parallelism]]
) -> ParallelModel:
    """Apply each of `parallelisms` that the job uses to `model`, in place, in order.

    `plan` is the model family's `ParallelPlan` (models/common/spec.py): which modules are the layers, and
    later which are column- or row-parallel. `apply` returns None when its degree is 1.
    """
    parts: list[Parallelism] = []
    traced, traced_parts = model, None
    for kind in parallelisms:
        part = kind.apply(model, mesh, cfg, plan)
        if part is None:
            continue
        parts.append(part)
        if traced_parts is not None:  # the step traces a copy: it is split alike (`ParallelModel`)
            copied = kind.apply(traced, mesh, cfg, plan)
            assert copied is not None, f"{kind.__name__} applies to the rank's model but not to the traced copy"
            traced_parts.append(copied)
        elif (copy := part.traced_model(model)) is not model:
            traced, traced_parts = copy, list(parts)
    return ParallelModel(model, mesh, parts, traced_parts)


__all__ = [
    "MicroSteps",
    "ScheduleModel",
    "Owner",
    "ParallelModel",
    "Parallelism",
    "gradient_owners",
    "mean_count_over",
    "owned_by",
    "parallelize",
]
