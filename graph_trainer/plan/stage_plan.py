"""The per-stage memory plan of a pipeline-parallel step (`parallelism.pp`): every pp rank's peak, exact on CPU.

A stage's peak depends on its schedule: how many micro-batches' saved activations it holds at once (GPipe all of
them, 1F1B up to pp - s on stage s), and on what torch's `PipelineStage` keeps (a receive buffer per micro-batch for
the activation and for its gradient, made at the first step and kept; each stage output until its backward; a
sent tensor while its send lives). Rather than model each of those, the plan runs the rank's real step: torch's own
schedule driving the rank's stages cut from the traced micro-step, on fake tensors, on torch's fake process group
(`planning_mesh` as that rank), under the live-tensor tracker that counts a fake tensor as the memory it stands for
(as the eager baseline is planned, `plan.eager_baseline`). Two steps run and the second is the plan: the first
makes torch's buffers (which the trainer's figure then counts as alive when a step starts, `held_tensors`) and
prunes the other stages' embedding, norm and output with their optimizer state. The AdamW update, which does not
run on fake tensors, is added as every eager update is (`peak_with_update`).

Two things of torch's runtime differ on the fake process group and are put back for the plan's run only:
- the first step's warm-up vote (every stage says its shapes are static, received from the next rank) cannot be
  received on a fake group, so the plan sets the outcome the real vote reaches when every shape is given
  (`build_schedule` gives them): static;
- a real send or receive (gloo's, NCCL's) holds its tensor until its work object is dropped, which torch's
  1F1B keeps for a while (the last warm-up forward's send); the fake group's works hold nothing, so the plan's
  works hold their tensors as the real ones do.
Checked against the trainer's measured peak on 2 gloo ranks to the byte, every rank, under every schedule, and
on 4 ranks with dp_replicate (tests/distributed/test_pipeline.py).

The same run plans one rank inside the running job (`plan_stage` on the job's own mesh, the preflight): on fake
tensors a collective or a send goes to its fake kernel, which communicates nothing, so no peer takes part.

Under `compile.mode eager` the rank's eager stages (`distributed.eager_pipeline`: the model's own modules) run
instead, by autograd on fake tensors: the plan of the eager pipeline, to the byte too.

Depth-free, as the plan without pp is (`plan_positions`): a deep model's stage plans are run at three shallower
depths and extended pass by pass (each forward, backward and weight pass keeps its own peak: the one holding the
step's peak can change with the depth), exact to the byte where the three are evenly spaced (else planned whole,
and said); the preflight inside the job traces its own depth, since the job's first step runs that trace.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import dataclasses
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graph_trainer.builder import build_job
from graph_trainer.distributed.layout import planned_apart
from graph_trainer.distributed.mesh import Mesh, ParallelDims, planning_mesh
from graph_trainer.distributed.pipeline import (
    job_stage_blocks,
    make_buffers,
    one_micro_batch,
    short_counts,
    without_stages,
)
from graph_trainer.errors import UserError
from graph_trainer.job_config.load import resolve_model_args
from graph_trainer.job_config.model_args import get_model_spec
from graph_trainer.job_config.pretrained import model_name
from graph_trainer.observability.log import get_logger
from graph_trainer.observability.memory import LiveTensorTracker, allocated_bytes
from graph_trainer.observability.units import MIB, to_gib
from graph_trainer.optimizer.update_memory import peak_with_update
from graph_trainer.plan.eager_baseline import materialize_fake
from graph_trainer.plan.step_plan import for_device, meta_batch
from graph_trainer.step import micro_batches
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.executor import Transformed
from graph_trainer.tracer.memory_estimate import op_name

logger = get_logger(__name__)

UPDATE = "the AdamW update"  # the last of a plan's `pass_peaks`: after the schedule


@dataclasses.dataclass
class StagePlan:
    """One pp rank's step: its peak and where it is."""

    rank: int  # its position along the pipeline (the pp coordinate)
    stages: tuple[int, ...]  # the stages it runs
    blocks: tuple[int, ...]  # the blocks they hold
    peak_bytes: int  # the step's peak: parameters, optimizer state, torch's buffers, activations, the update
    peak_in_update: bool  # the peak is in the AdamW update, after the schedule
    at: str  # the pass and op running at the peak ("stage 1 backward of micro-batch 2, aten.mm"), or "update"
    in_flight: int  # micro-batches whose forward has run on this rank and whose backward has not, at the peak
    most_in_flight: int  # the most at any time in the step
    held_bytes: int  # torch's receive buffers, kept from step to step
    state_bytes: int  # the optimizer state of the rank's parameters
    plan_s: float  # seconds the plan took
    made: str = "run at the job's depth and micro-batch count"  # how: or extended from smaller ones (`plan_positions`)
    # Each pass's own peak, in the order they ran, the update last (`UPDATE`): words -> (bytes, where, micro-batches
    # in flight); the largest is `peak_bytes`. What a deeper plan is extended from.
    pass_peaks: dict[str, tuple[int, str, int]] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # The traced micro-step the stages were cut from (`Transformed`; None for eager stages): the job's first step
    # reuses it rather than tracing again (`PipelinedStep.reuse_trace`).
    step_graph: Any = dataclasses.field(default=None, repr=False, compare=False)
    # The memory budget's choice the stages apply (`pipeline_budget_choice`; None: another AC mode), which the
    # job's step applies too (`Job.with_budget_choice`).
    budget_choice: Any = dataclasses.field(default=None, repr=False, compare=False)


class _PeakTracker(LiveTensorTracker):
    """The live-tensor tracker on fake tensors, which also notes the pass and graph node running when the peak rises
    (the stages' graphs run node by node: `run_graph`) and the micro-batches in flight then."""

    def __init__(self, device_type: str) -> None:
        super().__init__(count_fake=True)
        self.device_type = device_type
        self.now, self.op = "", ""
        self.outside = "in torch's schedule"  # where an op outside the stages' graphs runs ("eagerly": no graphs)
        self.node: fx.Node | None = None
        self.at, self.in_flight, self.most_in_flight = "", 0, 0
        # Each pass's own peak (its words `now` -> bytes, where, micro-batches in flight): a deep model's plan
        # extends each pass on its own, since the pass holding the step's peak can change with the depth.
        self._pass_peaks: dict[str, tuple[int, fx.Node | None, str, str, int]] = {}  # the words made at the end
        self._pass_peak = 0
        self.flight = self.ending = 0

    def run_graph(self, gm: fx.GraphModule, args: list[torch.Tensor]) -> Any:
        tracker = self

        class NoteNodes(fx.Interpreter):  # frees each value after its last use, as the graph's own code does
            def run_node(self, n: fx.Node) -> Any:
                tracker.node = n
                return super().run_node(n)

        try:
            return NoteNodes(gm).run(*args)
        finally:
            self.node = None

    def _size(self, s: torch.UntypedStorage) -> int:
        return allocated_bytes(s.nbytes(), self.device_type)  # as CUDA's allocator rounds each block

    def on_pass(self, stage: int, what: str, micro: int) -> None:
        """A pass starts: a micro-batch is in flight from its forward's start to its backward's end (the next pass's
        start; the weights' part of a split backward keeps little of it)."""
        self._pass_peak = 0
        self.now = f"stage {stage} {what} of micro-batch {micro}"
        self.flight -= self.ending
        self.ending = 0
        if what == "forward":
            self.flight += 1
            self.most_in_flight = max(self.most_in_flight, self.flight)
        elif what == "backward":
            self.ending = 1

    def begin(self) -> None:
        """A new step: nothing in flight, and no pass yet (the step makes its accumulators and cuts its batch)."""
        self.now = "the step's start"
        self.flight = self.ending = self.most_in_flight = 0
        self._pass_peaks, self._pass_peak = {}, 0

    def _update_peak(self) -> None:
        if self.current_bytes > self.peak_bytes:
            self.at, self.in_flight = self._where(self.node, self.now, self.op), self.flight
        if self.current_bytes > self._pass_peak:
            self._pass_peak = self.current_bytes
            self._pass_peaks[self.now] = (self.current_bytes, self.node, self.now, self.op, self.flight)
        super()._update_peak()

    def pass_peaks(self) -> dict[str, tuple[int, str, int]]:
        """Each pass's own peak since `begin`, in the order the passes ran: its words -> (bytes, where, micro-batches
        in flight). The step's peak is the largest."""
        return {k: (b, self._where(node, now, op), f) for k, (b, node, now, op, f) in self._pass_peaks.items()}

    def _where(self, node: fx.Node | None, now: str, op: str) -> str:
        """The pass and the op running, in words: e.g. 'stage 1 backward of micro-batch 2: mm in
        layers.5.feed_forward.w2 (layer 5)', or torch's op outside the graphs."""
        if node is None:
            return f"{now}: {op} {self.outside}" if now else op
        layer = node_meta.layer_id(node)
        module = node_meta.module_fqn(node) or "the top level"
        return f"{now}: {op_name(node)} in {module}" + ("" if layer is None else f" (layer {layer})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op = str(func.overloadpacket).replace("aten::", "aten.")
        return super().__torch_dispatch__(func, types, args, kwargs)


class _HeldWork:
    """A fake process group's work that keeps its tensors until it is dropped, as a real one does."""

    def __init__(self, work: Any, tensors: list[torch.Tensor]):
        self.work, self.tensors = work, tensors

    def wait(self, *args: Any) -> bool:
        return self.work.wait(*args)


@contextlib.contextmanager
def _as_real_runtime(schedule: Any) -> Iterator[None]:
    """torch's schedule on the fake process group as it runs on a real one (see the module docstring): the
    warm-up vote's outcome is static, and a send's or receive's work holds its tensor."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import InferenceMode

    def vote(stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    real_batch_p2p = schedules._batch_p2p

    def batch_p2p(ops: list, desc: str | None = None) -> list:
        return [_HeldWork(w, [op.tensor for op in ops]) for w in real_batch_p2p(ops, desc)]

    if not hasattr(schedule, "_warmup_p2p"):  # pragma: no cover - another torch's runtime: plan nothing wrong
        raise RuntimeError("torch's pipeline schedule has no _warmup_p2p: this torch's runtime is not modelled")
    schedule._warmup_p2p = vote
    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = real_batch_p2p
        del schedule._warmup_p2p


def plan_pipeline(cfg: Any, device: torch.device, choice: Any = None) -> Iterator[StagePlan]:
    """Every stage position's step plan (`StagePlan`, of the first data-parallel replica), in pipeline order, each
    as it is made. `choice`: the memory budget's (`pipeline_budget_choice`, solved at the job's depth: the plan of
    a shallower `cfg` applies it too, as the deep one will); None: solved here when the mode is `budget`."""
    dims = ParallelDims.from_config(cfg.parallelism)
    traced = None  # every rank cuts its stages from the same micro-step graph: traced once, by the first
    for position, rank in enumerate(planned_apart(dims.degrees()) or [0]):
        with planning_mesh(dims, device, rank=rank) as mesh:
            if choice is None:
                choice = pipeline_budget_choice(cfg, mesh)
            plan, traced = plan_stage(cfg, mesh, position, traced, choice)
        yield plan


def pipeline_budget_choice(cfg: Any, mesh: Mesh) -> Any:
    """The `budget` mode's choice for `cfg`'s pipeline (None in another mode): one process's choice for one
    micro-batch (`pipeline.one_micro_batch`: the step one process accumulating the pipeline's micro-batches runs),
    one per block class, solved at the job's depth on its short traces as the plan without pp solves it
    (`block_plan.deep_budget_model`), on `mesh` seen without its pp dimension. Every stage applies it to its
    blocks, so the pipeline recomputes what that process recomputes, and each rank's peak is its stage plan's.

    A fraction is of that process's no-AC activation memory; a size budget is refused under pp
    (`PipelineParallel.refuses`): one rank's peak depends on its position.

    Raises:
        UserError: the short traces do not extend in depth (one line); ConfigError: the budget is infeasible.
    """
    if cfg.activation_checkpoint.mode != "budget":
        return None
    from graph_trainer.passes.budget import solve_in_depth
    from graph_trainer.passes.budget_depth import NotExtendable
    from graph_trainer.plan.block_plan import deep_budget_model

    one = one_micro_batch(cfg)
    try:
        deep = deep_budget_model(one, without_stages(mesh))
    except NotExtendable as e:
        raise UserError(
            f"activation_checkpoint.mode budget under pp: its choice cannot be solved on the short traces ({e}); "
            "pass --activation_checkpoint.mode selective or full"
        ) from None
    return dataclasses.replace(solve_in_depth(deep, one.activation_checkpoint), micro_step=True)


# The smallest stage of the shallowest depth a stage plan is made at holds this many blocks (past the model's
# leading blocks on the first stage), as the plan without pp starts from 3. At 2, DeepSeek-V3's first stage (its
# dense block and 2, 3, 4 more) peaked at the start of its forward at the first depth and at its last block's
# experts at the others: not evenly spaced, so planned whole.
SHORT_STAGE = 3


def short_depths(cfg: Any) -> tuple[int, list[int]]:
    """(the job's depth, three shallower depths whose stage plans extend to it, or [] when the three together are
    not shallower than it: planning it whole is then less work): one block a stage apart, each stage losing the same
    number of blocks (so that an uneven split stays the same split, `pipeline.stage_blocks`), the shallowest with
    `SHORT_STAGE` blocks on its smallest stage past the model's leading blocks (DeepSeek-V3's dense ones, which the
    first stage keeps). A plan's work grows with the blocks it runs, so theirs does not grow with the depth."""
    args = resolve_model_args(cfg)
    spec = get_model_spec(cfg.model.name)
    lead = spec.leading_blocks(args) if spec.leading_blocks is not None else 0
    sizes = [len(blocks) for blocks in job_stage_blocks(cfg, args.n_layers)]
    spare = min(sizes[0] - lead, *sizes[1:]) - SHORT_STAGE
    depths = [args.n_layers - len(sizes) * (spare - i) for i in range(3)]
    return args.n_layers, (depths if sum(depths) < args.n_layers else [])


def _extended_label(labels: list[str], more: int) -> str | None:
    """Where the peak is, `more` steps past three plans' `labels` one step apart: the words must be the same and
    each number (a layer, a micro-batch) evenly spaced, as a peak's bytes are; None where they are not."""
    words = {re.sub(r"\d+", "#", label) for label in labels}
    numbers = [[int(n) for n in re.findall(r"\d+", label)] for label in labels]
    if len(words) > 1 or any(b - a != c - b for a, b, c in zip(*numbers, strict=True)):
        return None
    grown = iter(c + more * (c - b) for _, b, c in zip(*numbers, strict=True))
    return re.sub(r"\d+", lambda _: str(next(grown)), labels[-1])


_GROWN = ("peak_bytes", "held_bytes", "state_bytes", "in_flight", "most_in_flight")  # each a line, or planned whole


def _evenly(values: list[int], more: int) -> int | None:
    """The value `more` steps past three evenly spaced `values`; None when they are not."""
    a, b, c = values
    return c + more * (c - b) if b - a == c - b else None


def _extended(planned: list[list[StagePlan]], more: int, by_pass: bool) -> list[StagePlan] | int:
    """Every position's plan `more` steps past the last of `planned` (each position's plans at three points one step
    apart, in depth or in micro-batches), or the first position whose three plans are not evenly spaced.

    `by_pass` (the same passes at the three points: in depth): each pass's own peak is extended, and the largest at
    the far point is the peak, since the pass holding a stage's peak can change with the depth (ZBVZeroBubble at 40
    blocks: stage 0's weight pass overtakes stage 3's, which holds the peak at 8, 12 and 16). Else the peak itself,
    its micro-batches in flight and its place are (in micro-batches, where the passes grow in number)."""
    out = []
    for position, plans in enumerate(zip(*planned, strict=True)):
        grown = {name: _evenly([getattr(p, name) for p in plans], more) for name in _GROWN}
        if not by_pass:
            at = _extended_label([p.at for p in plans], more)
        else:
            passes = [p.pass_peaks for p in plans]
            if not passes[0] or any(list(q) != list(passes[0]) for q in passes):
                return position
            if any(max(b for b, _, _ in q.values()) != p.peak_bytes for p, q in zip(plans, passes, strict=True)):
                return position  # the passes do not account for the step's peak: nothing to extend it from
            peaks = {k: _evenly([q[k][0] for q in passes], more) for k in passes[0]}
            if None in peaks.values():
                return position
            top = max(peaks, key=peaks.__getitem__)  # the first pass to reach it, as the tracker notes a peak
            at = "update" if top == UPDATE else _extended_label([q[top][1] for q in passes], more)
            flight = _evenly([q[top][2] for q in passes], more)
            grown.update(peak_bytes=peaks[top], in_flight=flight)
        if at is None or None in grown.values():
            return position
        seconds = sum(p.plan_s for p in plans)
        out.append(dataclasses.replace(plans[-1], **grown, peak_in_update=at == "update", at=at, plan_s=seconds,
                                       pass_peaks={}, step_graph=None))  # fmt: skip
    return out


def plan_positions(cfg: Any, device: torch.device, say: Callable[[str], None] | None = None) -> list[StagePlan]:
    """Every stage position's plan at the job's depth and micro-batch count M (`plan_pipeline`'s), made from smaller
    runs where they are less work, and equal to it to the byte (tests/plan/test_stage_plan_counts.py):

    - past its warm-up a schedule repeats, each micro-batch adding the same bytes to a position's peak (its receive
      buffer, its slice of the batch; under GPipe its activations too, and one more micro-batch in flight), so a
      large M is planned at three smaller counts (`pipeline.short_counts`) and extended: two counts give the slope
      and a third checks it;
    - depth-free, as the plan without pp is: a stage's step repeats its blocks, each adding the same bytes to each
      of its passes (its parameters, gradients and AdamW state, its saved activations per micro-batch in flight),
      so at each count a deep model is planned at three shallower depths (`short_depths`) and extended pass by pass.

    Where three plans are not evenly spaced, the job itself is planned, said through `say` (`layouts/search.py`'s
    exact rows; the dry run)."""
    count, counts = short_counts(cfg)
    choice = budget_choice(cfg, device)
    if not counts:
        return _plan_in_depths(cfg, device, say, choice)
    planned = []
    for n in counts:
        short = copy.deepcopy(cfg)
        short.training.local_batch_size = n * cfg.parallelism.pp_microbatch_size
        planned.append(_plan_in_depths(short, device, say, choice))
    more, off = divmod(count - counts[-1], counts[1] - counts[0])
    out = None if off else _extended(planned, more, by_pass=False)
    if not isinstance(out, list):
        why = "not a whole number of steps past them" if off else f"not evenly spaced there (position {out})"
        (say or logger.warning)(f"stage plan: {count} micro-batches are {why} ({counts}); planned whole")
        return _plan_in_depths(cfg, device, say, choice)
    made = f"run at {counts[0]}, {counts[1]} and {counts[2]} micro-batches and extended to {count}"
    if planned[0][0].made != StagePlan.made:
        made += f"; at each, {planned[0][0].made}"
    return [dataclasses.replace(plan, made=made) for plan in out]


def budget_choice(cfg: Any, device: torch.device) -> Any:
    """`pipeline_budget_choice` for the plans of every position, depth and count (None in another mode), solved in
    this process on the first position's planning mesh (the dry run's; the preflight solves it on the job's)."""
    if cfg.activation_checkpoint.mode != "budget":
        return None
    dims = ParallelDims.from_config(cfg.parallelism)
    with planning_mesh(dims, device, rank=(planned_apart(dims.degrees()) or [0])[0]) as mesh:
        return pipeline_budget_choice(cfg, mesh)


def _plan_in_depths(
    cfg: Any, device: torch.device, say: Callable[[str], None] | None, choice: Any = None
) -> list[StagePlan]:
    """Every stage position's plan at the job's depth, made at three shallower depths when those are less work
    (`short_depths`) and extended pass by pass; a position whose passes are not evenly spaced there is planned at
    the job's depth, said through `say`. `choice`: the memory budget's, solved at the job's depth."""
    depth, depths = short_depths(cfg)
    if not depths:
        return list(plan_pipeline(cfg, device, choice))
    planned = []
    for n in depths:
        short = copy.deepcopy(cfg)
        short.model.n_layers = n
        planned.append(list(plan_pipeline(short, device, choice)))
    out = _extended(planned, (depth - depths[-1]) // (depths[1] - depths[0]), by_pass=True)
    if isinstance(out, int):
        (say or logger.warning)(
            f"stage plan: position {out}'s plans at {depths[0]}, {depths[1]} and {depths[2]} blocks are not evenly "
            f"spaced; planned at the job's {depth} blocks"
        )
        return list(plan_pipeline(cfg, device, choice))
    per_stage = job_stage_blocks(cfg, depth)
    made = f"run at {depths[0]}, {depths[1]} and {depths[2]} blocks and extended to {depth}"
    return [
        dataclasses.replace(plan, blocks=tuple(sorted(b for s in plan.stages for b in per_stage[s])), made=made)
        for plan in out
    ]


def stage_position(mesh: Mesh) -> int:
    """The position along the pipeline of `mesh`'s rank (the ranks of one position plan alike)."""
    ranks = planned_apart(mesh.dims.degrees()) or [0]
    return bisect.bisect_right(ranks, mesh.rank) - 1


def plan_stage(cfg: Any, mesh: Mesh, position: int, traced: Any = None, choice: Any = None) -> tuple[StagePlan, Any]:
    """The plan of `mesh`'s rank (at `position` along the pipeline), and the micro-step graph its stages were cut
    from (`traced`, or traced here when None), its stages applying the memory budget's `choice`
    (`pipeline_budget_choice`; None in another mode). `mesh` is torch's fake process group's (`planning_mesh`) or
    the running job's own: a collective or a send on fake tensors goes to its fake kernel, which communicates
    nothing, so a rank plans its own step inside the job without its peers (the preflight)."""
    start = time.perf_counter()
    device = mesh.device
    job = build_job(cfg, mesh, materialize=False).with_budget_choice(choice)
    step = job.build_step()
    graph_step = step.graph_step
    # Traced (unless given) and cut, or the eager stages built: on the meta model, so that the optimizer state of
    # what the rank does not hold goes with it.
    traced = step.prepare(micro_batches(meta_batch(cfg), step.n_micro, graph_step.count_reduce)[0], traced)
    if traced is not None:
        for_device(traced, device)
    update = job.eager_update()
    tracker = _PeakTracker(device.type)
    if cfg.compile.mode == "eager":
        tracker.outside = "(run eagerly)"
    for stage in step.stages:
        stage.on_pass, stage.run_graph = tracker.on_pass, tracker.run_graph
    b, s = cfg.training.local_batch_size, cfg.training.seq_len
    with FakeTensorMode(), _as_real_runtime(step.schedule):
        materialize_fake(job.model, device)
        batch = {name: torch.zeros(b, s, dtype=torch.long, device=device) for name in meta_batch(cfg)}
        # torch's buffers, as the first step makes them: the plan is of the step after it. A torch whose schedule
        # has no stage set-up makes them in a first step (the same plan, more time).
        if not make_buffers(step.schedule, step.stages, step.n_micro):
            logger.info("stage plan: torch's pipeline schedule has no stage set-up; a first step is run on fake "
                        "tensors to make its buffers")  # fmt: skip
            step.run(traced, micro_batches(batch, step.n_micro, graph_step.count_reduce), update=False)
        model = job.model
        held = step.held_tensors()
        tracker.track_existing([list(model.parameters()), list(model.buffers()), batch, held])
        tracker.begin()
        try:
            with tracker:  # the step cuts its batch (the token count is the step's) and runs the schedule
                step.run(traced, micro_batches(batch, step.n_micro, graph_step.count_reduce), update=False)
            peak, in_update = peak_with_update(tracker.peak_bytes, tracker.current_bytes, update)
            step_end = tracker.current_bytes  # what the update runs beside (`forget` sets it to 0)
        finally:
            tracker.forget()
    # cuBLAS's workspace on CUDA: made by the process's first matmul, held from then on (0 on CPU).
    held_always = update.state_bytes + step.workspace_bytes()
    peak += step.workspace_bytes()
    passes = {k: (b + held_always, at, f) for k, (b, at, f) in tracker.pass_peaks().items()}
    passes[UPDATE] = (step_end + update.scratch_bytes + held_always, "update", 0)
    plan = StagePlan(
        rank=position,
        stages=tuple(stage.index for stage in step.stages),
        blocks=tuple(step.held_blocks()),
        peak_bytes=peak,
        peak_in_update=in_update,
        at="update" if in_update else tracker.at,
        in_flight=0 if in_update else tracker.in_flight,
        most_in_flight=tracker.most_in_flight,
        held_bytes=sum(allocated_bytes(t.untyped_storage().nbytes(), device.type) for t in held),
        state_bytes=update.state_bytes,
        plan_s=time.perf_counter() - start,
        pass_peaks=passes,
        step_graph=None if traced is None else Transformed(traced, graph_step.memory_estimate),
        budget_choice=choice,
    )
    return plan, traced


def print_stage_plans(cfg: Any, device: torch.device, print_fn: Callable[[str], None]) -> None:
    """Every pp rank's plan (`plan_positions`: depth-free), one line each, then how they were made: the configured
    AC mode only, since each rank's plan runs its whole schedule on fake tensors."""
    p, t = cfg.parallelism, cfg.training
    eager = ", its stages run eagerly (compile.mode eager)" if cfg.compile.mode == "eager" else ""
    print_fn(
        f"dry run: {model_name(cfg)}, {resolve_model_args(cfg).n_layers} blocks, "
        f"{ParallelDims.from_config(p).describe()} under "
        f"{p.pp_schedule}, local batch {t.local_batch_size} x seq {t.seq_len} in micro-batches of "
        f"{p.pp_microbatch_size}, AC {cfg.activation_checkpoint.mode}, device {device.type}: each rank's step run "
        f"on fake tensors under torch's schedule{eager} (the AdamW update added)"
    )
    said: list[str] = []  # a position planned whole, said under the table rather than inside it
    plans = plan_positions(cfg, device, said.append)  # before the header: a refusal is then the line after the first
    print_fn(
        f"{'pp rank':7} {'stages':>7} {'blocks':>9} {'peak GiB':>9} {'state GiB':>9} {'buffers MiB':>11} "
        f"{'in flight':>9} {'most':>5} {'plan s':>7}  peak at"
    )
    for plan in plans:
        blocks = f"{plan.blocks[0]}-{plan.blocks[-1]}" if len(plan.stages) == 1 else ",".join(map(str, plan.blocks))
        print_fn(
            f"{plan.rank:7} {','.join(map(str, plan.stages)):>7} {blocks:>9} {to_gib(plan.peak_bytes):9.3f} "
            f"{to_gib(plan.state_bytes):9.3f} {plan.held_bytes / MIB:11.2f} {plan.in_flight:9} "
            f"{plan.most_in_flight:5} {plan.plan_s:7.1f}  {plan.at}"
        )
    for line in [*said, f"each rank's plan {plans[0].made} (plan s: the runs' seconds)"]:
        print_fn(line)
    if (c := plans[0].budget_choice) is not None:
        print_fn(
            f"budget {cfg.activation_checkpoint.memory_budget}: every stage applies one process's choice at a "
            f"micro-batch of {p.pp_microbatch_size}, one per block class solved on its "
            f"{' + '.join(map(str, c.short_depths))}-block traces: {c.recomputed}/{c.candidates} candidates "
            f"recomputed, {c.recompute_flops / 1e9:.3f} GFLOP of recompute a micro-batch "
            f"({'optimal' if c.optimal else 'not proven optimal: ' + c.status})"
        )


__all__ = [
    "StagePlan",
    "budget_choice",
    "pipeline_budget_choice",
    "plan_pipeline",
    "plan_positions",
    "plan_stage",
    "print_stage_plans",
    "short_depths",
    "stage_position",
]
