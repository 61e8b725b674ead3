"""A plan whose cost does not grow with depth: trace 3 and 4 blocks, prove the blocks identical, extend to L.

A model of L identical transformer blocks is planned from two short traces of the same job, with 3 and 4
blocks, each traced once and shared by every activation-checkpointing mode (the trace does not depend on
the mode; only the passes do). Each node of a short step graph gets a key: the class of its block (`first`,
`mid_first` = block 1, `mid_last` = block k-2, `last`, or `outside` for the embedding, loss and global
ops) and its rank among the nodes of that class. The keys of the 3- and 4-block graphs must match one to
one, node for node (op, shapes, phase, module, policy), and the middle blocks of each graph must hold the same
sequence of ops and shapes, before and after the passes: that is the proof that the middle blocks are identical
and the first and last the same at any depth (they may differ from the middle ones: FSDP's prefetch leaves the
last block's gathered parameters alive into its backward). Otherwise the plan falls back to a full trace.

Why two depths suffice, exactly: at a node of a `first`, `last` or `outside` class, what is alive from the
other blocks is one identical contribution per middle block (their parameters and optimizer state, the
activations they saved, the gradients they made), so the live bytes there are affine in L. Inside the
middle blocks they are affine in the block's index, so their maximum is at the first or the last middle
block, which is what `mid_first` and `mid_last` are. Every count the plan reports is then affine in L and
known at L = 3 and 4: the live bytes at each key (hence the peak, its place and its categories), the
saved bytes, the FLOPs, the bytes per collective kind, and the eager update's state and scratch. This
assumes no storage lives from one block into the block after next; the tests check the result against
full traces at 8 and 16 blocks, and 8B dimensions at 8 blocks, to the byte.

The local batch is extended the same way (`plan_batches`, for the planner's search and for a batch whose chunked
loss would trace many chunks): the short steps are traced at two batches one sequence apart (3 + 4 blocks at
each), and a node of a chunked loss also gets its chunk's class (first, first and last middle, last; the
loss tags each chunk's ops, `loss.LOSS_CHUNK`). Every tensor's bytes are affine in the batch and so is the
number of chunks, so every count is affine in the batch at any depth: the plan at any (depth, batch) follows
from the four short steps, and costs what they cost however large the batch. Batch 1 is traced on its own
(some of its graphs have other ops; see `_grids`).

The `budget` mode chooses one decision per block class on a deep model, solved on the short steps' models
extended to depth L (`passes/budget_depth.py`, `_budget_choice`); the short steps are tagged with that choice and
extended as the other modes are, and the deep step applies the same choice (`StepPlan.budget_choice`). Across a
grid of two batches its choice is not solved per batch: there it is approximated from the none and full plans, an
upper bound, marked approximate.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch
import torch.fx

from graph_trainer import stages
from graph_trainer.builder import Job, build_job
from graph_trainer.distributed.mesh import Mesh
from graph_trainer.errors import ConfigError, UserError
from graph_trainer.job_config.batching import accumulation_steps
from graph_trainer.job_config.load import resolve_model_args
from graph_trainer.job_config.memory_budget import check_memory_budget, parse_memory_budget
from graph_trainer.job_config.model_args import get_model_spec
from graph_trainer.job_config.pretrained import model_name
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.log import get_logger, quiet
from graph_trainer.observability.units import GIB
from graph_trainer.optimizer.update_memory import EagerUpdate
from graph_trainer.passes import CLEAN_UP, build_pipeline, fsdp_policy_of, fsdp_prefetch_of
from graph_trainer.passes.activation_checkpoint import (
    attention_choices,
    choose_attention,
    compared_graphs,
    pin_attention,
)
from graph_trainer.passes.budget import DeepModel, deep_model, solve_in_depth
from graph_trainer.passes.budget_depth import BlockChoice, NotExtendable
from graph_trainer.passes.communication import communication_bytes
from graph_trainer.plan.step_plan import (
    AC_MODES,
    StepPlan,
    extra_compiled_bytes,
    finish_plan,
    meta_batch,
    node_blocks,
    peak_location,
    plan_of,
    plan_step,
    running_blocks,
    with_ac_mode,
)
from graph_trainer.runtime.gc_pause import gc_paused
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import TracedStep
from graph_trainer.tracer.executor import Transformed
from graph_trainer.tracer.graph_utils import copy_graph, graph_module, lazy_codegen, node_flops, tensors
from graph_trainer.tracer.memory_estimate import MemoryEstimate, estimate_peak_memory, live_by_category

logger = get_logger(__name__)

SHORT = (3, 4)  # the depths traced: 3 has one middle block, 4 has a first and a last middle block


def leading_blocks(cfg: JobConfig) -> int:
    """How many blocks before the `first` one are keyed one by one (`ModelSpec.leading_blocks` less one: the last
    of the blocks that differ from the rest can be the `first` class): 0 for a model of identical blocks."""
    spec = get_model_spec(cfg.model.name)
    if spec.leading_blocks is None:
        return 0
    return max(0, spec.leading_blocks(resolve_model_args(cfg)) - 1)


def short_depths(cfg: JobConfig) -> tuple[int, int]:
    """The depths a model is traced at: 3 and 4 blocks after its leading blocks (`leading_blocks`)."""
    lead = leading_blocks(cfg)
    return lead + SHORT[0], lead + SHORT[1]


APPROXIMATE_MODES = ("budget",)  # approximate where its choice is not solved: extended to another batch


class NotUniform(Exception):
    """The short graphs do not prove the blocks identical; the reason says where they differ."""


def plan_modes(
    cfg: JobConfig,
    mesh: Mesh,
    modes: Iterable[str] = AC_MODES,
    *,
    log_passes: bool = False,
    fast: bool = True,
    on_fallback: Callable[[str], None] | None = None,
) -> dict[str, StepPlan | UserError]:
    """One rank's plan of `cfg`'s step for each AC mode in `modes` (a mode that cannot be planned maps to its
    UserError), at a cost that does not grow with the number of blocks (see the module docstring).

    Deep models (more than 4 blocks) are extended from traces of 3 and 4 blocks; shallower ones, `fast` False,
    or blocks the short graphs do not prove identical are traced whole, once for all modes. A deep model traced
    whole is a fallback: said in one line through `on_fallback` (default: a warning), or a ConfigError with
    `plan.require_depth_free` (see `fall_back`).
    """
    modes, refused = _refused_modes(cfg, list(modes))
    if refused:
        planned = (
            plan_modes(cfg, mesh, modes, log_passes=log_passes, fast=fast, on_fallback=on_fallback) if modes else {}
        )
        return {m: refused[m] if m in refused else planned[m] for m in [*modes, *refused]}
    if accumulation_steps(cfg) > 1:
        # The accumulating step is two graphs (a micro-step run k times, then the update); the extension reads one
        # whole-step graph. Each mode is planned whole: its cost grows with depth, not with k.
        if fast and resolve_model_args(cfg).n_layers > short_depths(cfg)[-1]:
            why = "the accumulating step is two graphs (a micro-step run k times, then the update)"
            fall_back(cfg, f"{why}, traced whole once a mode", on_fallback)
        return _planned_per_mode(cfg, mesh, modes, log_passes)
    batch = cfg.training.local_batch_size
    return plan_batches(cfg, mesh, modes, [batch], log_passes=log_passes, fast=fast, on_fallback=on_fallback)[batch]


def _refused_modes(cfg: JobConfig, modes: list[str]) -> tuple[list[str], dict[str, UserError]]:
    """(the modes a job could run, {mode: why not} for those its other options rule out, as the trainer would at
    load: a size budget with a graph that is not the whole step)."""
    refused: dict[str, UserError] = {}
    for mode in modes:
        try:
            check_memory_budget(with_ac_mode(cfg, mode))
        except ConfigError as e:
            refused[mode] = e
    return [m for m in modes if m not in refused], refused


def fall_back(cfg: JobConfig, why: str, say: Callable[[str], None] | None = None) -> None:
    """Say in one line that a deep model is planned by tracing its whole depth, and why (`say`, default a warning);
    with `plan.require_depth_free`, refuse instead (ConfigError: one line, exit 2). At 70B a whole trace costs
    minutes a mode, where the depth-free plan costs seconds."""
    depth = resolve_model_args(cfg).n_layers
    if cfg.plan.require_depth_free:
        raise ConfigError(
            f"plan.require_depth_free: the {depth} blocks of {model_name(cfg)} cannot be planned "
            f"depth-free ({why}); drop --plan.require_depth_free to trace the whole depth (slower)"
        )
    (say or logger.warning)(
        f"planning the whole depth ({depth} blocks, slower than the depth-free plan): {why} "
        "(--plan.require_depth_free makes this an error)"
    )


@gc_paused()  # the plan's objects live until it is done: see runtime/gc_pause.py
def plan_batches(
    cfg: JobConfig,
    mesh: Mesh,
    modes: Iterable[str],
    batches: Iterable[int],
    *,
    log_passes: bool = False,
    fast: bool = True,
    extrapolate: bool = False,
    on_fallback: Callable[[str], None] | None = None,
) -> dict[int, dict[str, StepPlan | UserError]]:
    """`plan_modes` of `cfg` at each local batch of `batches` (cfg's own local batch is ignored; one step a
    micro-batch: no accumulation), from the fewest short traces: several batches, or one batch with many loss
    chunks, are extended from short steps at two small batches one sequence apart (`_grids`), so the cost grows
    neither with depth nor with the local batch. `extrapolate`: batches below the grid's (local batch 1) are
    extended from it too, marked approximate, instead of traced on their own (the search's screen).

    Where the short graphs do not prove the blocks identical, the batches are traced whole: `fall_back` says so
    once, naming the first block, node and field that differ (or refuses, with `plan.require_depth_free`)."""
    modes, batches = list(modes), sorted(set(batches))
    depth = resolve_model_args(cfg).n_layers
    if not (fast and depth > short_depths(cfg)[-1]):
        return {b: _traced_whole(with_local_batch(cfg, b), mesh, modes, log_passes) for b in batches}
    out: dict[int, dict[str, StepPlan | UserError]] = {}
    whole: list[int] = []  # the batches to trace whole, once a grid's blocks proved different
    for grid, targets in _grids(cfg, batches, extrapolate):
        if whole:  # the blocks differ at one batch: the other grids are not tried (they cost two traces each)
            whole += targets
            continue
        try:
            with lazy_codegen():
                out.update(_extended(cfg, mesh, modes, depth, grid, targets, log_passes, on_fallback))
        except NotUniform as e:
            fall_back(cfg, f"the short traces do not prove the blocks identical: {e}", on_fallback)
            whole += targets
    out.update({b: _traced_whole(with_local_batch(cfg, b), mesh, modes, log_passes) for b in whole})
    return out


def with_local_batch(cfg: JobConfig, batch: int) -> JobConfig:
    """`cfg` with another local batch and no accumulation (a copy)."""
    out = copy.deepcopy(cfg)
    out.training.local_batch_size = batch
    out.training.global_batch_size = -1
    return out


def _traced_whole(cfg: JobConfig, mesh: Mesh, modes: list[str], log_passes: bool) -> dict[str, StepPlan | UserError]:
    """Trace all blocks once and plan every mode on a copy of the trace."""
    job = build_job(cfg, mesh, materialize=False)
    with lazy_codegen():
        return _planned_from_one_trace(job, modes, log_passes)


def _planned_from_one_trace(job: Job, modes: list[str], log_passes: bool) -> dict[str, StepPlan | UserError]:
    cfg = job.cfg
    traced, elapsed = _trace(job)
    out: dict[str, StepPlan | UserError] = {}
    for mode in modes:
        mode_job = job.with_config(with_ac_mode(cfg, mode))
        try:
            result = _transform(mode_job, traced, log_passes)
        except UserError as e:
            out[mode] = e
            continue
        out[mode] = plan_of(mode_job, result, elapsed, blocks_traced=job.model.args.n_layers)
    return out


def _planned_per_mode(
    cfg: JobConfig, mesh: Mesh, modes: list[str], log_passes: bool
) -> dict[str, StepPlan | UserError]:
    """Each mode's step traced and planned whole (`plan_step`)."""
    out: dict[str, StepPlan | UserError] = {}
    for mode in modes:
        try:
            out[mode] = plan_step(build_job(with_ac_mode(cfg, mode), mesh, materialize=False), log_passes=log_passes)
        except UserError as e:
            out[mode] = e
    return out


def _trace(job: Job) -> tuple[TracedStep, float]:
    """The job's step traced once, before any check or pass: what every AC mode's pipeline starts from."""
    start = time.perf_counter()
    with quiet():
        traced = stages.trace(job, meta_batch(job.cfg))
    return traced, time.perf_counter() - start


def _transform(job: Job, traced: TracedStep, log_passes: bool) -> Transformed:
    """`job`'s checks and pass pipeline (its AC mode) run on a copy of `traced`, which stays as it was."""
    with _logged(log_passes):
        return stages.transform(job, copy_traced(traced))


def copy_traced(traced: TracedStep) -> TracedStep:
    """A copy of a traced step whose graph the passes may rewrite (`graph_utils.copy_graph`): `traced` stays as it
    was."""
    return dataclasses.replace(traced, gm=graph_module(traced.gm, copy_graph(traced.gm.graph)))


# The extension from short steps: two depths, at one local batch or two.


@dataclasses.dataclass
class _Short:
    """One short step (a point of the grid) planned for one mode: its job, final graph, estimate and eager update."""

    job: Job
    gm: torch.fx.GraphModule
    est: MemoryEstimate
    update: EagerUpdate | None
    keys: dict[_Key, int]  # node key -> index in graph order
    categories: list[str]


def _extended(
    cfg: JobConfig,
    mesh: Mesh,
    modes: list[str],
    depth: int,
    grid: _Grid,
    targets: list[int],
    log_passes: bool,
    on_fallback: Callable[[str], None] | None = None,
) -> dict[int, dict[str, StepPlan | UserError]]:
    """Each target batch's plans for `modes`, extended from the short steps of `grid`; a budget choice that cannot
    be solved on them is said through `on_fallback` (default: a warning), as a whole-trace fallback is."""
    # The budget is exact at one traced batch (its choice is solved there, `_budget_choice`); extended to other
    # batches, or where its choice cannot be solved, it is read off the none and full plans, approximate. Their
    # variants are there either way: a variant runs its passes only when a plan needs it.
    exact = [m for m in modes if m not in APPROXIMATE_MODES]
    variants = exact + [m for m in ("none", "full", "budget") if m not in exact and "budget" in modes]
    choices = {mode: attention_choices(with_ac_mode(cfg, mode).activation_checkpoint) or ("",) for mode in variants}
    shorts: dict[_Point, dict[tuple[str, str], _Variant | UserError]] = {}
    compared: dict[_Point, dict[str, dict[str, _Short] | UserError]] = {}
    start = time.perf_counter()
    for point in grid.points:
        job = build_job(_short_config(cfg, *point), mesh, materialize=False)
        shorts[point], compared[point] = _plan_short(job, choices, log_passes and point == grid.reference)

    parts: dict[int, dict[str, _Parts | UserError]] = {b: {} for b in targets}
    budget_choice = None
    if "budget" in modes and len(grid.batches) == 1:
        variants = {p: shorts[p][("budget", "")] for p in grid.points}
        budget_choice = _budget_choice(cfg, grid, variants, depth, on_fallback or logger.warning)
        if isinstance(budget_choice, UserError):
            for b in targets:
                parts[b]["budget"] = budget_choice
        elif budget_choice is not None:
            exact.append("budget")
    if "budget" in modes and budget_choice is None:  # approximate: read off the none and full plans
        exact += [m for m in ("none", "full") if m not in exact]
    for mode in exact:
        failed = next((c[mode] for c in compared.values() if isinstance(c.get(mode), UserError)), None)
        failed = failed or next(
            (s[(mode, c)] for s in shorts.values() for c in choices[mode] if isinstance(s[(mode, c)], UserError)),
            None,
        )
        for batch in targets:
            if failed is not None:
                parts[batch][mode] = failed
                continue
            choice = choices[mode][0]
            if all(compared[p].get(mode) for p in grid.points):  # as the pass chooses at depth L (`compared_graphs`)
                peaks = {
                    c: grid.peak({p: compared[p][mode][c] for p in grid.points}, depth, batch)[1] for c in choices[mode]
                }
                choice = choose_attention(peaks)
            try:
                parts[batch][mode] = _extend(
                    grid, {p: shorts[p][(mode, choice)].finished() for p in grid.points}, depth, batch
                )
            except UserError as e:
                parts[batch][mode] = e
    elapsed = time.perf_counter() - start  # the whole plan, all modes and batches together (they share the traces)
    out: dict[int, dict[str, StepPlan | UserError]] = {}
    for batch in targets:
        deep = _ArgsOnly(with_local_batch(cfg, batch), job)
        out[batch] = {}
        for mode in modes:
            mode_job = deep.for_mode(mode)
            part = parts[batch].get(mode) or _approximate_budget(
                mode_job.cfg, parts[batch]["none"], parts[batch]["full"], parts[batch].get("selective")
            )
            if isinstance(part, _Parts) and batch < grid.batches[0]:  # extrapolated (see `_grids`)
                part = dataclasses.replace(part, approximate=True)
            out[batch][mode] = part if isinstance(part, UserError) else part.plan(mode_job, elapsed, grid.blocks_traced)
            if mode == "budget" and isinstance(budget_choice, BlockChoice) and isinstance(part, _Parts):
                out[batch][mode].budget_choice = budget_choice
                _check_target(part.est.peak_bytes, budget_choice, on_fallback or logger.warning)
    return out


def _check_target(graph_peak: int, choice: BlockChoice, say: Callable[[str], None]) -> None:
    """Say, in one line, a depth-free plan of the budget's choice whose graph peaks above the target the choice was
    solved for: the choice's model and the plan read the same short traces, so one of them misreads the deep step
    (a prefetched gather read in its own block did, `running_blocks`); the plan is the estimate the step runs at."""
    if graph_peak > choice.target_bytes:
        say(
            f"memory_budget: the depth-free plan puts the budget's choice at {graph_peak / GIB:.4f} GiB of graph, "
            f"above the {choice.target_bytes / GIB:.4f} GiB it was solved for (its model: "
            f"{choice.peak_bytes / GIB:.4f} GiB); planned as traced, please report it with this config"
        )


def _budget_choice(
    cfg: JobConfig, grid: _Grid, variants: dict[_Point, _Variant | UserError], depth: int, say: Callable[[str], None]
) -> BlockChoice | UserError | None:
    """The budget's choice at `depth`, solved on the short steps' models and set on their variants so that their
    passes apply it (as the deep step's will: `StepPlan.budget_choice`); the refusal of an infeasible budget; or
    None, said in one line, where the short models do not extend in depth (the plan is then approximate)."""
    if any(isinstance(v, UserError) for v in variants.values()):
        return next(v for v in variants.values() if isinstance(v, UserError))
    three, four = (variants[p] for p in grid.points)
    args, kwargs = _short_budget_args(cfg, (three.job, four.job), three.clean, four.clean)
    try:
        with quiet():
            deep = deep_model(*args, **kwargs, depth=depth)
            choice = solve_in_depth(deep, args[2])
    except NotExtendable as e:
        say(f"the budget plan is approximate: its choice cannot be solved on the short traces ({e})")
        return None
    except UserError as e:
        return e
    for v in variants.values():
        v.job = v.job.with_budget_choice(choice)
    return choice


def _short_budget_args(
    cfg: JobConfig, jobs: tuple[Job, Job], three: TracedStep, four: TracedStep
) -> tuple[tuple, dict]:
    """What `deep_model` reads of the two short steps (`three`, `four`: cleaned up), before
    the depth: the graphs, their input categories, the budget's section, each op's counterpart and block, and what
    FSDP does to the gathers after the budget (its gather policy and prefetch), and the jobs' eager updates."""
    lead, layers = leading_blocks(cfg), jobs[1].spec.parallel_plan.layers
    gm3, gm4 = three.gm, four.gm
    keys3, keys4 = _keys(gm3, lead + 3, layers, lead), _keys(gm4, lead + 4, layers, lead)
    nodes3, nodes4 = list(gm3.graph.nodes), list(gm4.graph.nodes)
    counterpart = {nodes4[i]: nodes3[keys3[k]] for k, i in keys4.items() if k in keys3}
    # The loss's middle chunks have no key (`_keys`); outside the blocks the two steps run the same ops in the
    # same order, so the n-th op there is the n-th op there.
    outside3, outside4 = ([n for _, n, b in node_blocks(gm, layers) if b is None] for gm in (gm3, gm4))
    if len(outside3) == len(outside4):
        for a, b in zip(outside4, outside3, strict=True):
            counterpart.setdefault(a, b)
    return (
        (gm3, gm4),
        (three.layout.categories, four.layout.categories),
        with_ac_mode(cfg, "budget").activation_checkpoint,
    ), {
        "counterpart": counterpart,
        "block_of": {n: b for _, n, b in node_blocks(gm4, layers)},
        "lead": lead,
        "fsdp_policy": fsdp_policy_of(with_ac_mode(cfg, "budget")),
        "gathers_prefetched": fsdp_prefetch_of(cfg),
        "eager_updates": (jobs[0].eager_update(), jobs[1].eager_update()),
    }


def deep_budget_model(cfg: JobConfig, mesh: Mesh) -> DeepModel:
    """The budget's model of `cfg`'s deep step under per-class choices (`passes.budget.deep_model`), from its two
    short steps traced at its own batch: what the budget pass's choice is solved on, at the cost of short traces.

    Raises:
        NotExtendable: the short steps' models do not extend in depth.
    """
    depth = resolve_model_args(cfg).n_layers
    cleaned, jobs = [], []
    for blocks in short_depths(cfg):
        job = build_job(_short_config(cfg, blocks, cfg.training.local_batch_size), mesh, materialize=False)
        traced, _ = _trace(job)
        cleaned.append(stages.transform(job, traced, until=CLEAN_UP).traced)
        jobs.append(job)
    args, kwargs = _short_budget_args(cfg, tuple(jobs), *cleaned)
    return deep_model(*args, **kwargs, depth=depth)


def _short_config(cfg: JobConfig, blocks: int, batch: int) -> JobConfig:
    """`cfg` cut to `blocks` blocks at local batch `batch`: one point of the grid."""
    out = with_local_batch(cfg, batch)
    out.model.n_layers = blocks
    return out


def _plan_short(
    job: Job, choices: dict[str, tuple[str, ...]], log_passes: bool
) -> tuple[dict[tuple[str, str], _Variant | UserError], dict[str, dict[str, _Short] | UserError]]:
    """One short depth, traced once and checked, its clean-up passes run once (`passes.CLEAN_UP`: no option
    changes them), with its blocks checked identical as traced.

    Returns each (AC mode, attention choice) of `choices` as a `_Variant` that runs its mode's other passes when
    the plan needs it (only the choice made at depth L is), or the UserError its config raised; and for each mode
    whose `full` pass compares attention choices, the graphs it compares (`compared_graphs`) as shorts, by choice
    ({} when it compares none).
    """
    k, layers = job.model.args.n_layers, job.spec.parallel_plan.layers
    variants: dict[tuple[str, str], Job | UserError] = {}
    for mode, mode_choices in choices.items():
        for choice in mode_choices:
            try:
                variant = job.with_config(_pinned(job.cfg, mode, choice))
                build_pipeline(variant.cfg, dump_dir=None)  # a pass configuration it cannot run: refused untraced
                variants[(mode, choice)] = variant
            except UserError as e:
                variants[(mode, choice)] = e
    traced, _ = _trace(job)
    _check_blocks(traced.gm, k, layers, leading_blocks(job.cfg), "as traced")
    runnable = [v for v in variants.values() if not isinstance(v, UserError)]
    if not runnable:
        return variants, {}
    try:
        with _logged(log_passes):
            clean = stages.transform(runnable[0], traced, until=CLEAN_UP).traced
    except UserError as e:  # what the parallelism cannot run, whatever the mode
        return dict.fromkeys(variants, e), {}
    shorts = {v: j if isinstance(j, UserError) else _Variant(j, clean, log_passes) for v, j in variants.items()}
    compared: dict[str, dict[str, _Short] | UserError] = {}
    for mode, mode_choices in choices.items():
        if len(mode_choices) > 1:
            try:
                graphs = compared_graphs(clean.gm, with_ac_mode(job.cfg, mode).activation_checkpoint)
            except UserError as e:
                compared[mode] = e
                continue
            compared[mode] = {c: _compared_short(job, clean.gm, g, clean.layout.categories) for c, g in graphs.items()}
    return shorts, compared


def _logged(log_passes: bool) -> contextlib.AbstractContextManager:
    """The passes' log as asked: shown (the preflight's step), else quiet (the other plans would only add noise)."""
    return contextlib.nullcontext() if log_passes else quiet()


@dataclasses.dataclass
class _Variant:
    """One AC mode (with its attention choice pinned) of a short step: the rest of its passes, run on a copy of
    the cleaned trace when the plan first needs it, with its blocks checked identical after them."""

    job: Job
    clean: TracedStep
    log_passes: bool
    _short: _Short | None = None

    def finished(self) -> _Short:
        if self._short is None:
            with _logged(self.log_passes):
                result = stages.transform(self.job, copy_traced(self.clean), after=CLEAN_UP)
            job, gm = self.job, result.traced.gm
            k, layers, lead = job.model.args.n_layers, job.spec.parallel_plan.layers, leading_blocks(job.cfg)
            _check_blocks(gm, k, layers, lead, f"after the passes of AC mode {job.cfg.activation_checkpoint.mode}")
            categories = self.clean.layout.categories
            self._short = _Short(
                job, gm, result.memory_estimate, job.eager_update(), _keys(gm, k, layers, lead), categories
            )
        return self._short


def _pinned(cfg: JobConfig, mode: str, choice: str) -> JobConfig:
    """`cfg` in AC mode `mode`, with attention's outputs pinned to `choice` (`pin_attention`) unless it is ""."""
    cfg = with_ac_mode(cfg, mode)
    if choice:
        cfg.activation_checkpoint = pin_attention(cfg.activation_checkpoint, choice)
    return cfg


def _compared_short(job: Job, root: torch.fx.GraphModule, graph: torch.fx.Graph, categories: list[str]) -> _Short:
    """A graph the `full` pass compares (`compared_graphs`) as a short, with its keys and estimate."""
    gm = graph_module(root, graph)
    est = estimate_peak_memory(gm, input_categories=categories)
    k, layers = job.model.args.n_layers, job.spec.parallel_plan.layers
    return _Short(job, gm, est, None, _keys(gm, k, layers, leading_blocks(job.cfg)), categories)


@dataclasses.dataclass
class _ArgsOnly:
    """What `finish_plan` reads of the deep job, without building it: its config and parameter count."""

    cfg: JobConfig
    short: Job

    def for_mode(self, mode: str) -> _ArgsOnly:
        return dataclasses.replace(self, cfg=with_ac_mode(self.cfg, mode))

    def num_params(self) -> int:
        return self.short.spec.num_params(resolve_model_args(self.cfg))


@dataclasses.dataclass
class _Parts:
    """A deep step's graph estimate, eager update, peak location, FLOPs and traffic, before `finish_plan`."""

    est: MemoryEstimate
    update: EagerUpdate | None
    location: tuple[int | None, str, str]
    flops: int
    comm: dict[str, int]
    approximate: bool = False

    def plan(self, job: _ArgsOnly, elapsed: float, blocks_traced: int) -> StepPlan:
        return finish_plan(
            job,
            self.est,
            self.update,
            self.location,
            num_params=job.num_params(),
            flops=self.flops,
            comm=self.comm,
            trace_time_s=elapsed,
            blocks_traced=blocks_traced,
            approximate=self.approximate,
        )


_Point = tuple[int, int]  # a short step traced: (blocks, local batch)


@dataclasses.dataclass(frozen=True)
class _Grid:
    """The short steps traced: 3 and 4 blocks at each of `batches`, one local batch or two one sequence apart.

    A value at a node key is affine in the depth (one identical block apart) at each traced batch, and affine in
    the local batch at any depth: every activation's bytes are, and so is the number of loss chunks (a key names
    the first, the first and last middle, and the last chunk, as it names blocks). So from the grid's points every
    (depth, batch) value follows exactly: extend in depth at each traced batch, then in the batch."""

    batches: tuple[int, ...]
    depths: tuple[int, int] = SHORT  # the two short depths (`short_depths`), one identical block apart

    @property
    def points(self) -> list[_Point]:
        return [(k, b) for b in self.batches for k in self.depths]

    @property
    def reference(self) -> _Point:
        """The point whose node order, names and modules stand for the deep step's."""
        return self.depths[-1], self.batches[-1]

    @property
    def blocks_traced(self) -> int:
        return sum(k for k, _ in self.points)

    def at(self, values: dict[_Point, int], depth: int, batch: int) -> int:
        """The value at (`depth`, `batch`) of what is `values[point]` at each point."""

        def in_depth(b: int) -> int:
            short, longer = values[(self.depths[0], b)], values[(self.depths[1], b)]
            return short + (depth - self.depths[0]) * (longer - short)

        low = in_depth(self.batches[0])
        if len(self.batches) == 1:
            return low
        return low + (batch - self.batches[0]) * (in_depth(self.batches[1]) - low)

    def at_dict(self, values: dict[_Point, dict[str, int]], depth: int, batch: int) -> dict[str, int]:
        names = dict.fromkeys(k for p in reversed(self.points) for k in values[p])  # a stable order
        out = {k: self.at({p: values[p].get(k, 0) for p in self.points}, depth, batch) for k in names}
        return {k: v for k, v in out.items() if v}

    def peak(self, shorts: dict[_Point, _Short], depth: int, batch: int) -> tuple[_Key, int]:
        """The deep step's graph peak (the compile stage's extra included) and the key of the node it is at.

        NotUniform unless the short graphs have the same keys running the same ops."""
        _check_same_nodes(self, shorts)
        ref = shorts[self.reference]
        # The peak: the largest extended live bytes; ties go to the earliest node, as in the estimate (key order in
        # the reference graph is node order in the deep one).
        key = max(
            ref.keys,
            key=lambda k: (
                self.at({p: s.est.timeline[s.keys[k]] for p, s in shorts.items()}, depth, batch),
                -ref.keys[k],
            ),
        )
        live = self.at({p: s.est.timeline[s.keys[key]] for p, s in shorts.items()}, depth, batch)
        compiled = self.at({p: extra_compiled_bytes(s.job.cfg, s.gm) for p, s in shorts.items()}, depth, batch)
        return key, live + compiled


def _grids(cfg: JobConfig, batches: list[int], extrapolate: bool) -> list[tuple[_Grid, list[int]]]:
    """How to plan `batches`: (grid, the batches extended from it). One batch with few loss chunks is traced at
    that batch (3 + 4 blocks); several batches, or one whose chunked loss would trace many chunks, are extended
    from two small batches one apart (3 + 4 blocks at each).

    The grid's batches are 2 or more: at local batch 1 some graphs have other ops (under tensor parallelism a
    [1, s, d] activation is contiguous where a [2, s, d] one needs a copy), so batch 1 is traced on its own, or,
    with `extrapolate`, extended from the grid and marked approximate. A batch is extended only where its loss
    chunks are whole and at least 3 (so that a key's chunk classes exist)."""
    chunk, seq = cfg.training.loss_chunk_size, cfg.training.seq_len
    depths = short_depths(cfg)

    def chunks(b: int) -> int:  # loss chunks at local batch b (0: a whole loss)
        return b * seq // chunk if chunk else 0

    def extendable(b: int) -> bool:
        return not chunk or (b * seq % chunk == 0 and chunks(b) >= 3)

    low = next((b for b in range(2, max(batches) + 3) if extendable(b) and extendable(b + 1)), None)
    if low is None:
        return [(_Grid((b,), depths), [b]) for b in batches]
    extended = [b for b in batches if extendable(b) and (b >= low or extrapolate)]
    if len(extended) == 1 and (not chunk or chunks(extended[0]) < 2 * (chunks(low) + chunks(low + 1))):
        extended = []  # one batch with few loss chunks: its own two traces cost less
    grids = [(_Grid((low, low + 1), depths), extended)] if extended else []
    return grids + [(_Grid((b,), depths), [b]) for b in batches if b not in extended]


def _check_same_nodes(grid: _Grid, shorts: dict[_Point, _Short]) -> None:
    """NotUniform unless every short graph has the reference's keys, a key's node the same op everywhere, with
    the same shapes, phase, module and policy in a block at the same batch (at another batch, all but the shapes).
    Outside the blocks only the op must agree (some shapes there count the blocks: the clip's stack of norms)."""
    nodes = {p: list(s.gm.graph.nodes) for p, s in shorts.items()}
    for point, short in shorts.items():
        against = (grid.depths[-1], point[1]) if point[0] != grid.depths[-1] else grid.reference
        if point == against:
            continue
        other = shorts[against]
        graphs = f"the {_point_words(point)} and the {_point_words(against)} graph"
        if short.keys.keys() != other.keys.keys():
            key = next(k for k in [*other.keys, *short.keys] if k not in short.keys or k not in other.keys)
            has, lacks = (against, point) if key in other.keys else (point, against)
            raise NotUniform(
                f"{_key_words(key)} is in the {_point_words(has)} graph, not in the {_point_words(lacks)} one"
            )
        shapes = point[1] == against[1]
        for k, i in other.keys.items():
            a, b = nodes[point][short.keys[k]], nodes[against][i]
            if k[0] == "outside":
                if a.target != b.target:
                    raise NotUniform(f"{_key_words(k)} differs between {graphs}, field op: {a.target} vs {b.target}")
                continue
            x, y = _signature(a, shapes), _signature(b, shapes)
            if x != y:
                raise NotUniform(f"{_key_words(k)} differs between {graphs}, {_field_difference(x, y)}")


def _point_words(point: _Point) -> str:
    return f"{point[0]}-block, local batch {point[1]}"


def _key_words(key: _Key) -> str:
    """A node key in words: 'node 12 of the mid_last block (loss chunk first)'."""
    cls, chunk, rank = key
    where = "outside the blocks" if cls == "outside" else f"of the {cls} block"
    return f"node {rank} {where}" + (f" (loss chunk {chunk})" if chunk else "")


def _extend(grid: _Grid, shorts: dict[_Point, _Short], depth: int, batch: int) -> _Parts:
    """The deep step's numbers from the short ones (see the module docstring for why this is exact)."""
    key, peak_bytes = grid.peak(shorts, depth, batch)
    ref = shorts[grid.reference]

    def at(read) -> int:
        return grid.at({p: read(s) for p, s in shorts.items()}, depth, batch)

    def at_dict(read) -> dict[str, int]:
        return grid.at_dict({p: read(s) for p, s in shorts.items()}, depth, batch)

    est = MemoryEstimate(
        peak_bytes=peak_bytes,
        peak_node="",
        peak_op="",
        peak_module_fqn="",
        peak_bytes_by_category=at_dict(lambda s: live_by_category(s.gm, s.keys[key], input_categories=s.categories)),
        final_bytes_by_category=at_dict(lambda s: s.est.final_bytes_by_category),
        input_bytes=at(lambda s: s.est.input_bytes),
        saved_bytes=at(lambda s: s.est.saved_bytes),
        timeline=(),
    )
    update = None
    if ref.update is not None:
        update = EagerUpdate(
            ref.update.implementation, at(lambda s: s.update.state_bytes), at(lambda s: s.update.scratch_bytes)
        )
    return _Parts(
        est,
        update,
        _deep_location(
            ref.gm, ref.keys[key], key[0], depth, ref.job.spec.parallel_plan.layers, grid.depths[0] - SHORT[0]
        ),
        flops=at(lambda s: _flops(s.gm)),
        comm=at_dict(lambda s: communication_bytes(s.gm)),
    )


def budget_bracket(peak: float, peaks: Mapping[str, int]) -> tuple[str, str, float]:
    """(the planned mode above `peak`, the one below, w) between which a budget's unsolved plan peaking at `peak` is
    read, from the planned modes' `peaks` ("none" and "full", and "selective" when planned): its FLOPs and saved
    bytes are the one above's plus w (0 to 1) of the way to the one below's. Selective replaces whichever of none
    and full lies on the far side of `peak`, since the policy never costs more than a fixed mode that fits."""
    above, below = "none", "full"
    selective = peaks.get("selective")
    if selective is not None and peaks["full"] < selective < peaks["none"]:
        if peak >= selective:
            below = "selective"
        else:
            above = "selective"
    span = peaks[above] - peaks[below]
    return above, below, min((peaks[above] - peak) / span, 1.0) if span > 0 else 0.0


def _approximate_budget(
    cfg: JobConfig, none: _Parts | UserError, full: _Parts | UserError, selective: _Parts | UserError | None = None
) -> _Parts | UserError:
    """The `budget` mode's plan where its choice is not solved, approximated from the deep none and full plans
    (marked approximate).

    The pass's exact policy fits its target (inputs + `memory_budget` of the no-AC activations, or the whole
    step's peak the budget names, less the eager update's state beside the graph) whenever any choice does, so
    the peak is taken as the target (at most none's): an upper bound. Below full AC's peak it may still fit (it
    chooses per op, not per layer), so the target is not refused here; the pass refuses an unreachable one at the
    trace, in one line with the smallest reachable peak. FLOPs and saved bytes are interpolated, in the same
    proportion, between the two planned modes whose peaks bracket the target: full and none, or with `selective`
    planned (the search plans it) selective and whichever of the two lies on the target's side, since the policy
    never costs more than a fixed mode that fits (full's where the target is below it). Used where the choice is
    not solved: batches extended from a grid of two, or short models that do not extend in depth (said).
    """
    if isinstance(none, UserError):
        return none
    if isinstance(full, UserError):
        return full
    budget = parse_memory_budget(cfg.activation_checkpoint.memory_budget)
    target = budget.target(input_bytes=none.est.input_bytes, no_ac_peak=none.est.peak_bytes)
    if budget.peak_bytes is not None and none.update is not None:  # the eager update's state is beside the graph
        target -= none.update.state_bytes
    peak = int(min(target, none.est.peak_bytes))
    parts = {"none": none, "full": full, **({"selective": selective} if isinstance(selective, _Parts) else {})}
    above, below, w = budget_bracket(peak, {mode: p.est.peak_bytes for mode, p in parts.items()})
    none, full = parts[above], parts[below]

    def mix(a: int, b: int) -> int:
        return int(round(a + w * (b - a)))

    est = dataclasses.replace(
        none.est,
        peak_bytes=peak,
        saved_bytes=mix(none.est.saved_bytes, full.est.saved_bytes),
        peak_bytes_by_category={
            **none.est.peak_bytes_by_category,
            "activation": none.est.peak_bytes_by_category.get("activation", 0) - (none.est.peak_bytes - peak),
        },
    )
    comm = {k: mix(none.comm.get(k, 0), full.comm.get(k, 0)) for k in dict.fromkeys([*none.comm, *full.comm])}
    return _Parts(est, none.update, (None, "", "approximate"), mix(none.flops, full.flops), comm, approximate=True)


def _flops(gm: torch.fx.GraphModule) -> int:
    return sum(node_flops(n) for n in gm.graph.nodes)


def _deep_location(
    gm: torch.fx.GraphModule, index: int, cls: str, depth: int, layers: str | None, lead: int
) -> tuple[int | None, str, str]:
    """The (layer, module, op) in the deep model of the `index`-th node of the reference graph, of class `cls` (the
    class of the block it runs in, `running_blocks`: a prefetched gather's own block is the next or previous)."""
    layer, module, op = peak_location(gm, index, layers)
    if layer is None:
        return layer, module, op
    runs_in = next(b for i, _, b in running_blocks(gm, layers) if i == index)
    if runs_in is None:  # issued after the root unit's gather: its own block's class says where it is
        runs_in, cls = layer, _classes(layer, lead + SHORT[1], lead)[0]
    deep = runs_in if cls.startswith("lead") else {
        "first": lead, "mid_first": lead + 1, "mid_last": depth - 2, "last": depth - 1
    }[cls]  # fmt: skip
    deep += layer - runs_in
    if layers:
        module = re.sub(rf"(^|\.){re.escape(layers)}\.{layer}(?=\.|$)", rf"\g<1>{layers}.{deep}", module)
    return deep, module, op


# Node keys and the proof that the blocks are identical.


_Key = tuple[str, str, int]  # (block class, loss-chunk class or "", rank among the nodes of its block and chunk)


def _positions(index: int, count: int) -> list[str]:
    """The classes the `index`-th of `count` identical units (blocks, loss chunks) stands for: `first`, `mid_first`
    (unit 1), `mid_last` (unit count-2), `last`; unit 1 of 3 is both middles, and units 2 to count-3 none."""
    if index == 0:
        return ["first"]
    if index == count - 1:
        return ["last"]
    return [c for c, j in (("mid_first", 1), ("mid_last", count - 2)) if j == index]


def _classes(layer: int | None, k: int, lead: int) -> list[str]:
    """The block classes a node of block `layer` of a `k`-block graph stands for (`outside` the blocks); the
    `lead` leading blocks are each their own (`lead0`, `lead1`, ...)."""
    if layer is None:
        return ["outside"]
    return [f"lead{layer}"] if layer < lead else _positions(layer - lead, k - lead)


def _keys(gm: torch.fx.GraphModule, k: int, layers: str | None, lead: int) -> dict[_Key, int]:
    """Each running node's key -> its index in graph order. A node of a chunked loss (`node_meta.loss_chunk`) is
    keyed by its chunk's class as well; the nodes of middle chunks other than the first and last have none. A node
    is keyed by the block it runs in (`running_blocks`): a gather prefetched into the block before its own is alive
    beside what that block's neighbours saved, which under a budget's per-class choice differs between the first
    block (the 3-block step's neighbour) and a middle one (the 4-block step's)."""
    blocks = running_blocks(gm, layers)
    chunks = 1 + max((c for _, n, _ in blocks if (c := node_meta.loss_chunk(n)) is not None), default=-1)
    ranks: Counter = Counter()
    keys: dict[_Key, int] = {}
    for i, node, layer in blocks:
        chunk = node_meta.loss_chunk(node)
        rank = ranks[(layer, chunk)]
        ranks[(layer, chunk)] += 1
        for cls in _classes(layer, k, lead):
            for chunk_cls in [""] if chunk is None else _positions(chunk, chunks):
                keys[(cls, chunk_cls, rank)] = i
    return keys


class _Signature(NamedTuple):
    """What must agree between two blocks' nodes (`_signature`); the fields' words are `_FIELD_WORDS`."""

    op: str
    outputs: tuple
    phase: object
    module: str
    policy: object
    rematerialized: bool


_FIELD_WORDS = {
    "op": "op",
    "outputs": "output shapes and dtypes",
    "phase": "phase",
    "module": "module",
    "policy": "memory policy",
    "rematerialized": "rematerialized",
}


def _signature(node: torch.fx.Node, shapes: bool = True) -> _Signature:
    """What must agree between two blocks' nodes: the op, its outputs' shapes (with `shapes`) and dtypes, its place
    in the step, its module (block index left out) and what the memory policy made of it."""
    vals = tuple((tuple(t.shape) if shapes else None, t.dtype) for t in tensors(node.meta.get("val")))
    module = re.sub(r"\.\d+(?=\.|$)", ".#", node_meta.module_fqn(node))
    return _Signature(
        str(node.target),
        vals,
        node_meta.phase(node),
        module,
        node.meta.get(node_meta.RECOMPUTE) is not None and str(node.meta.get(node_meta.RECOMPUTE)),
        node_meta.is_rematerialized(node),
    )


def _clipped(value: object, limit: int = 60) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_difference(a: _Signature, b: _Signature) -> str:
    """'field F: a vs b' for the first field in which two nodes' signatures differ."""
    name = next(f for f in _Signature._fields if getattr(a, f) != getattr(b, f))
    return f"field {_FIELD_WORDS[name]}: {_clipped(getattr(a, name))} vs {_clipped(getattr(b, name))}"


def _first_difference(a: list[_Signature], b: list[_Signature]) -> str:
    """Where two node sequences first differ: the node's index and op, and the field (one line)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # unequal lengths are a difference too, below
        if x != y:
            return f"at its node {i} ({x.op}), {_field_difference(x, y)}"
    n = min(len(a), len(b))
    extra = (a if len(a) > n else b)[n].op
    return f"at its node {n} ({extra}), field op: one has {len(a)} nodes, the other {len(b)}"


def _check_blocks(gm: torch.fx.GraphModule, k: int, layers: str | None, lead: int, when: str) -> None:
    """NotUniform unless every middle block of the `k`-block graph holds the same op sequence (`_signature`), and
    every middle chunk of its chunked loss the same as chunk 1; its message names the first block (or chunk),
    node and field that differ.

    The first and the last block may differ from the middle ones (FSDP's prefetch: the last block's backward
    keeps the parameters its forward gathered, the others gather again); `_check_same_nodes` then proves them the
    same at every short depth, key by key, which is all the extension needs."""
    blocks: dict[int, list[_Signature]] = {}
    chunks: dict[int, list[_Signature]] = {}
    for _, node, layer in node_blocks(gm, layers):
        if layer is not None:
            blocks.setdefault(layer, []).append(_signature(node))
        if node_meta.loss_chunk(node) is not None:
            chunks.setdefault(node_meta.loss_chunk(node), []).append(_signature(node))
    if sorted(blocks) != list(range(k)):
        raise NotUniform(f"the {k}-block graph {when} tags blocks {sorted(blocks)}")
    for layer in range(lead + 2, k - 1):
        if blocks[layer] != blocks[lead + 1]:
            where = _first_difference(blocks[layer], blocks[lead + 1])
            raise NotUniform(f"block {layer} of the {k}-block graph {when} differs from block {lead + 1} {where}")
    if chunks and sorted(chunks) != list(range(len(chunks))):
        raise NotUniform(f"the {k}-block graph {when} tags loss chunks {sorted(chunks)}")
    for chunk in range(2, len(chunks) - 1):
        if chunks[chunk] != chunks[1]:
            where = _first_difference(chunks[chunk], chunks[1])
            raise NotUniform(f"loss chunk {chunk} of the {k}-block graph {when} differs from chunk 1 {where}")


__all__ = [
    "SHORT",
    "NotUniform",
    "copy_traced",
    "fall_back",
    "leading_blocks",
    "plan_batches",
    "plan_modes",
    "short_depths",
    "with_local_batch",
]
