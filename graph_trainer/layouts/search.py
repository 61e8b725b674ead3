"""The layout search: candidates, pruning, the screen, and the exact plans of the best screened ones.

Candidates are every factorization of the GPU count over the mesh degrees the config schema offers, with
every carved degree worth trying (ep for a model with routed experts) and every option the parallelisms cross
(FSDP's gradient sync and prefetch), crossed with the AC mode, the local batch x accumulation steps that give
the global batch, `loss_chunk_size` and the optimizer in or out of the graph. What each degree and option
means is asked of `distributed.layout`, which reads it off the registered parallelisms; nothing here names one.
What the trainer refuses is skipped and counted (`trainer_refuses`).
Pruning drops what cannot fit even without activations; the screen reads the rest off one depth-free plan per
reference shape (every AC mode and local batch at once, `block_plan.plan_batches`); the top `exact` candidates
are then planned exactly, and only those are ranked.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from graph_trainer.builder import build_model
from graph_trainer.distributed import layout
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.distributed.parallelism import ScheduleModel
from graph_trainer.distributed.parallelize import config_refusal, refusal
from graph_trainer.errors import UserError
from graph_trainer.job_config.load import resolve_model_args, validate
from graph_trainer.job_config.memory_budget import parse_memory_budget
from graph_trainer.job_config.model_args import get_model_spec
from graph_trainer.job_config.schema import JobConfig, ParallelismConfig
from graph_trainer.layouts.cluster import Cluster
from graph_trainer.layouts.cost_model import StepTime, step_time
from graph_trainer.layouts.progress import silent
from graph_trainer.observability.log import get_logger
from graph_trainer.plan.accumulate import accumulated
from graph_trainer.plan.block_plan import APPROXIMATE_MODES, budget_bracket, plan_batches, short_depths
from graph_trainer.plan.stage_plan import StagePlan, plan_positions
from graph_trainer.plan.step_plan import StepPlan
from graph_trainer.runtime.device import compute_dtype

logger = get_logger(__name__)

# The mesh dimensions whose cost the search models, outermost first; those the schema lacks are left out.
MESH_DEGREES = layout.searched_dims()
BYTES_PER_PARAM_STATE = 16  # fp32 parameter + fp32 gradient + AdamW's two fp32 moments


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search space. Its parallelisms are read off `distributed.layout`, never named here."""

    degrees: tuple[tuple[str, int], ...]  # every parallelism's degree (`layout.canonical`): the mesh's, then carved
    ac_mode: str
    local_batch: int
    loss_chunk_size: int
    trace_optimizer: bool
    accumulation: int = 1  # micro-steps per step: the global batch is local batch x dp degree x accumulation
    options: tuple[tuple[str, Any], ...] = ()  # the parallelisms' [parallelism] options it sets (`option_choices`)
    memory_budget: str = ""  # AC budget only: `activation_checkpoint.memory_budget` (the search's: the device's memory)

    @property
    def dp(self) -> int:
        return layout.data_parallel(dict(self.degrees))

    @property
    def ranks_per_data_rank(self) -> int:
        """The ranks that share one data rank's batch (the model-parallel ones): the world over the dp degree."""
        return layout.world_size(dict(self.degrees)) // self.dp

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.dp * self.accumulation

    def overrides(self) -> list[str]:
        """The trainer options that ask for this candidate (an option at its default left out; a step option,
        such as the gradient sync of accumulation, after the global batch it concerns)."""
        per_step = layout.step_options()
        out = [f"--parallelism.{name} {n}" for name, n in self.degrees if n > 1]
        out += _option_overrides({k: v for k, v in self.options if k not in per_step})
        out.append(f"--activation_checkpoint.mode {self.ac_mode}")
        if self.memory_budget:
            out.append(f"--activation_checkpoint.memory_budget {self.memory_budget}")
        out += [
            f"--training.local_batch_size {self.local_batch}",
            f"--training.loss_chunk_size {self.loss_chunk_size}",
            f"--compile.trace_optimizer {str(self.trace_optimizer).lower()}",
        ]
        if self.accumulation > 1:
            out.append(f"--training.global_batch_size {self.global_batch}")
            out += _option_overrides({k: v for k, v in self.options if k in per_step})
        return out

    def layout(self) -> str:
        return layout.words(dict(self.degrees))

    def parallelism_settings(self) -> dict[str, Any]:
        """Every carved degree and searched option this candidate could set, at its value or default (plan.json's
        columns: the same keys for every row)."""
        degrees, options = dict(self.degrees), dict(self.options)
        out: dict[str, Any] = {name: degrees.get(name, 1) for name in layout.carved()}
        for name in sorted(layout.searched_options()):
            out[name] = options.get(name, getattr(_DEFAULTS, name))
        return out

    def batch(self) -> str:
        """'local batch x accumulation', with the parallelisms' marks (a deferred gradient sync: 's')."""
        return f"{self.local_batch} x {self.accumulation}" + layout.describe_options(dict(self.options))[1]

    def ac(self) -> str:
        """The AC mode, with the budget it plans to: 'full', 'budget 81920MiB'."""
        return f"{self.ac_mode} {self.memory_budget}" if self.memory_budget else self.ac_mode

    def label(self) -> str:
        """The candidate in a few words, for lists and progress: 'dp_shard 8, AC full, local batch 2 x 4'."""
        return f"{self.layout()}, AC {self.ac()}, local batch {self.batch()}"

    def apply(self, cfg: JobConfig) -> JobConfig:
        """`cfg` with this candidate's settings (a copy)."""
        out = copy.deepcopy(cfg)
        degrees = dict(self.degrees)
        for name in layout.degree_options():
            setattr(out.parallelism, name, degrees.get(name, 1))
        for name in layout.step_options():  # the user's, meaningless (or refused) at another accumulation
            setattr(out.parallelism, name, getattr(_DEFAULTS, name))
        for name, value in self.options:
            setattr(out.parallelism, name, value)
        if out.training.dtype == "bfloat16":  # the bf16 plan, as on a GPU (FSDP: bf16 gathers)
            for name, value in layout.bf16_settings(degrees).items():
                setattr(out.training, name, value)
        out.activation_checkpoint.mode = self.ac_mode
        if self.memory_budget:
            out.activation_checkpoint.memory_budget = self.memory_budget
        out.training.local_batch_size = self.local_batch
        out.training.loss_chunk_size = self.loss_chunk_size
        out.compile.trace_optimizer = self.trace_optimizer
        out.training.global_batch_size = self.global_batch if self.accumulation > 1 else -1
        return out

    def micro(self) -> Candidate:
        """This candidate's micro-step: the same but one micro-batch a step (what is planned, then accumulated)."""
        per_step = layout.step_options()
        options = tuple((k, v) for k, v in self.options if k not in per_step)
        return dataclasses.replace(self, accumulation=1, options=options)


_DEFAULTS = ParallelismConfig()


def _option_overrides(options: dict[str, Any]) -> list[str]:
    """'--parallelism.<option> <value>' for each option not at its default."""
    return [
        f"--parallelism.{k} {str(v).lower() if isinstance(v, bool) else v}"
        for k, v in options.items()
        if v != getattr(_DEFAULTS, k)
    ]


def offered_degrees() -> tuple[str, ...]:
    """The mesh degrees the config schema has today (tp joins when tensor parallelism lands)."""
    fields = {f.name for f in dataclasses.fields(ParallelismConfig)}
    return tuple(name for name in MESH_DEGREES if name in fields)


def factorizations(gpus: int, names: tuple[str, ...]) -> Iterator[dict[str, int]]:
    """Every way to write `gpus` as a product of one degree per name."""
    if len(names) == 1:
        yield {names[0]: gpus}
        return
    for d in range(1, gpus + 1):
        if gpus % d == 0:
            for rest in factorizations(gpus // d, names[1:]):
                yield {names[0]: d, **rest}


def model_allows(cfg: JobConfig, degrees: dict[str, int], gpus_per_node: int) -> str | None:
    """Why the model refuses these degrees (None: it allows them): each parallelism's own check, as the trainer
    runs it (`parallelize.refusal`: tp divides the heads, KV heads, split widths and sequence; ep the experts),
    and a ring that must stay within a node (`layout.spans_nodes`)."""
    why = refusal(_one_block(cfg), get_model_spec(cfg.model.name).parallel_plan, degrees, cfg.training.seq_len)
    if why is not None:
        return why.split(";")[0]
    return layout.spans_nodes(degrees, gpus_per_node)


def _one_block(cfg: JobConfig) -> torch.nn.Module:
    """`cfg`'s model with one block of each kind, on the meta device: the sizes tp splits, whatever the depth, at
    no cost. A family with leading dense blocks (DeepSeek-V3's `n_dense_layers`, 3 at 671B) keeps them, and one
    block after them: its arguments refuse fewer blocks than dense ones."""
    short = copy.deepcopy(cfg)
    short.model.n_layers = getattr(resolve_model_args(cfg), "n_dense_layers", 0) + 1
    return build_model(short, None)


def trainer_refuses(cfg: JobConfig, cand: Candidate) -> str | None:
    """Why the trainer refuses `cand` (None: it accepts it): the one gate every candidate passes, so the search
    proposes a combination (tp with accumulation, ep below dp_shard, HSDP) as soon as the trainer takes it.

    It runs the trainer's own checks: the config validation (`job_config.load.validate`), the mesh's
    (`ParallelDims.from_config`), what a parallelism cannot run beside (`parallelize.config_refusal`: pp beside
    accumulation or the optimizer in the graph) and each parallelism's at the candidate's degrees, ep included
    (`parallelize.refusal`, which the trainer's parallelisms run when they split the model).
    """
    trial = cand.apply(cfg)
    try:
        validate(trial)
        ParallelDims.from_config(trial.parallelism)
    except UserError as e:
        return str(e).split(";")[0].split(":")[0]
    why = config_refusal(trial, resolve_model_args(trial).n_layers)  # what a parallelism cannot run beside yet
    if why is not None:
        return why.split(";")[0].split(":")[0]
    if any(name in layout.carved() for name, _ in cand.degrees):  # the mesh's degrees were checked by `layouts`
        plan = get_model_spec(trial.model.name).parallel_plan
        why = refusal(_one_block(trial), plan, dict(cand.degrees), trial.training.seq_len)
        if why is not None:
            return why.split(";")[0].split(":")[0]
    return None


def layouts(cfg: JobConfig, cluster: Cluster, *, pipelines: bool = True) -> tuple[list[dict[str, int]], list[str]]:
    """(the layouts to search, 'layout: why' for each one skipped); without `pipelines`, none whose ranks plan
    apart (pipeline stages: `layout.planned_apart`), left out unsaid here (the planner says so once)."""
    keep, skipped = [], []
    for degrees in factorizations(cluster.gpus, offered_degrees()):
        if not pipelines and layout.planned_apart(degrees) is not None:
            continue
        why = model_allows(cfg, degrees, cluster.gpus_per_node)
        if why is None:
            # A local batch every schedule takes (2 micro-batches a stage), so that only the layout is judged here.
            probe = Candidate(tuple(degrees.items()), "none", 2 * layout.world_size(degrees), 0, False)
            why = trainer_refuses(cfg, probe)
            why = why and f"the trainer refuses it ({why})"
        (skipped.append(f"{layout.words(degrees)}: {why}") if why else keep.append(degrees))
    return keep, skipped


@dataclasses.dataclass
class Space:
    """The search space: candidates, and 'what: why' for each kind the trainer refuses (counted)."""

    cands: list[Candidate]
    refused: dict[str, int]


def candidates(
    cfg: JobConfig,
    layouts_: list[dict[str, int]],
    global_seqs: int,
    ac_modes: tuple[str, ...],
    chunks: tuple[int, ...],
    optimizer_in_graph: tuple[bool, ...],
    offered: Mapping[str, tuple[Any, ...]] | None = None,
) -> Space:
    """Every layout x carved degrees (ep) x (local batch, accumulation) whose product with the data-parallel
    degree is the global batch x the parallelisms' options (FSDP's gradient sync when it accumulates, and the
    `offered` values of the options the user asks to try, e.g. `{"fsdp_prefetch": (True, False)}`) x AC mode x
    loss chunk x optimizer placement, each passed through `trainer_refuses` (once per distinct setting of the
    options it reads). AC budget candidates carry the config's `memory_budget` (the planner's: the device's memory)."""
    space = Space([], {})
    verdicts: dict[tuple, str | None] = {}
    model_args = resolve_model_args(cfg)
    for mesh_degrees in layouts_:
        dp = layout.data_parallel(mesh_degrees)
        if global_seqs % dp:
            continue
        per_rank = global_seqs // dp
        for carved, lb in itertools.product(layout.carved_choices(model_args, mesh_degrees), _divisors(per_rank)):
            acc = per_rank // lb
            degrees = layout.canonical({**mesh_degrees, **carved})
            for options in layout.option_choices(dict(degrees), acc, offered or {}):
                for mode, chunk, in_graph in itertools.product(ac_modes, chunks, optimizer_in_graph):
                    budget = cfg.activation_checkpoint.memory_budget if mode == "budget" else ""
                    cand = Candidate(degrees, mode, lb, chunk, in_graph, acc, tuple(options.items()), str(budget))
                    # The AC mode and accumulation are part of the verdict: the trainer refuses a size budget
                    # beside Inductor, and its parallelisms may refuse accumulation.
                    key = (degrees, acc > 1, cand.options, mode, in_graph)
                    if key not in verdicts:
                        verdicts[key] = trainer_refuses(cfg, cand)
                    if verdicts[key]:
                        what = f"{cand.layout()}{' with accumulation' if acc > 1 else ''}: {verdicts[key]}"
                        space.refused[what] = space.refused.get(what, 0) + 1
                        continue
                    space.cands.append(cand)
    return space


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def state_bytes(cfg: JobConfig, cand: Candidate) -> int:
    """Parameters, gradients and optimizer state on one rank: what no AC mode or batch lowers."""
    params = get_model_spec(cfg.model.name).num_params(resolve_model_args(cfg))
    return params * BYTES_PER_PARAM_STATE // layout.state_divisor(dict(cand.degrees))


@dataclasses.dataclass
class Screened:
    """A candidate's screen: predicted peak and step time, and later its exact plan."""

    cand: Candidate
    peak: int
    time: StepTime
    exact: StepPlan | None = None
    exact_time: StepTime | None = None


class Plans:
    """Depth-free plans of micro-steps, cached by shape: every AC mode of one trace at once, and every local batch
    of a shape from one grid of short traces (`block_plan.plan_batches`).

    A shape is (degrees, loss chunk, optimizer placement, the micro-step's options): the screen's references and
    the exact plans share it, so an exact plan of a reference's shape costs nothing more.

    Nothing is dropped unsaid: each candidate whose plan fails is listed in `failed`, and each shape planned by
    tracing the whole depth in `full` (the first such fallback is said at once through `say`, default a warning).
    `progress` hears of each shape the screen plans (`plan.progress.Progress`).
    """

    def __init__(
        self,
        cfg: JobConfig,
        device: torch.device,
        *,
        say: Callable[[str], None] | None = None,
        progress: Callable[[str, int, int, str], None] = silent,
    ):
        self.cfg, self.device, self.say, self.progress = cfg, device, say, progress
        self._plans: dict[tuple, dict[int, dict[str, StepPlan | UserError]]] = {}
        self._extrapolated: set[tuple] = set()  # (shape, local batch): extended below its grid, for the screen only
        # (shape, local batch, bytes accumulation holds beside the micro-step) -> the AC budget's plan solved alone
        self._budgets_solved: dict[tuple, StepPlan | UserError] = {}
        # {"candidate", "stage" (screen or exact), "error"} for each candidate whose plan failed (a UserError)
        self.failed: list[dict[str, str]] = []
        self.depth_free = 0  # depth-free plans made (each a grid of short traces, for every mode and batch at once)
        self.full: list[dict[str, str]] = []  # {"shape", "why"} for each plan that traced the whole depth

    @property
    def calls(self) -> int:
        """Plans made: depth-free and whole-depth together."""
        return self.depth_free + len(self.full)

    @staticmethod
    def _shape(micro: Candidate) -> tuple:
        return (micro.degrees, micro.loss_chunk_size, micro.trace_optimizer, micro.options)

    def plan(self, cands: Iterable[Candidate], modes: Iterable[str], *, screen: bool = False) -> None:
        """Plan the micro-steps of `cands` for `modes` that are not planned yet: each shape once, at all its local
        batches together. `screen`: local batch 1 may be extrapolated (`block_plan.plan_batches`)."""
        modes = sorted(set(modes))
        wanted: dict[tuple, tuple[Candidate, set[int]]] = {}
        for cand in cands:
            micro = cand.micro()
            key = (self._shape(micro), micro.local_batch)
            have = self._plans.get(key[0], {}).get(micro.local_batch, {})
            if not set(modes) <= set(have) or (key in self._extrapolated and not screen):
                wanted.setdefault(key[0], (micro, set()))[1].add(micro.local_batch)
        for i, (shape, (micro, batches)) in enumerate(wanted.items(), 1):
            words = f"{_shape_words(micro)}, local batch {', '.join(map(str, sorted(batches)))}"
            if screen:
                self.progress("screen: shape", i, len(wanted), words)
            cfg = micro.apply(self.cfg)
            fallbacks: list[str] = []
            with planning_mesh(ParallelDims.from_config(cfg.parallelism), self.device) as mesh:
                planned = plan_batches(cfg, mesh, modes, batches, extrapolate=screen, on_fallback=fallbacks.append)
            self._count(words, fallbacks)
            for batch, by_mode in planned.items():
                self._plans.setdefault(shape, {}).setdefault(batch, {}).update(by_mode)
                if any(
                    isinstance(p, StepPlan) and p.approximate for m, p in by_mode.items() if m not in APPROXIMATE_MODES
                ):
                    self._extrapolated.add((shape, batch))
                else:
                    self._extrapolated.discard((shape, batch))
        if "budget" in modes and not screen:
            self._solve_budgets(cands)

    def _solve_budgets(self, cands: Iterable[Candidate]) -> None:
        """Plan the AC budget of each micro-step of `cands` at its own local batch alone, where the budget's choice
        is solved (`block_plan.plan_batches` with one batch): a grid of several batches only reads the budget off
        the none and full plans, an upper bound the ranking leaves out. With accumulation and a size, the micro-step
        is solved to the size less what accumulation holds beside it (`_beside`), as the trainer solves its
        micro-step graph (`passes/budget.py`, `Accumulation`). Once a micro-step and size: a solve that still
        comes out approximate (short traces that do not extend) stays so, and is said as the plan says it."""
        for cand in (c for c in cands if c.ac_mode == "budget"):
            micro = cand.micro()
            shape, batch = self._shape(micro), micro.local_batch
            beside = self._beside(cand)
            if (shape, batch, beside) in self._budgets_solved:
                continue
            cfg = micro.apply(self.cfg)
            if beside:
                size = parse_memory_budget(cand.memory_budget).peak_bytes
                cfg.activation_checkpoint.memory_budget = f"{size - beside}B"
            fallbacks: list[str] = []
            with planning_mesh(ParallelDims.from_config(cfg.parallelism), self.device) as mesh:
                planned = plan_batches(cfg, mesh, ["budget"], [batch], on_fallback=fallbacks.append)
            self._count(f"{_shape_words(micro)}, local batch {batch}, AC budget solved", fallbacks)
            self._budgets_solved[shape, batch, beside] = planned[batch]["budget"]

    def _beside(self, cand: Candidate) -> int:
        """Bytes `cand`'s accumulation holds beside each micro-step (`accumulate.accumulated`, read on a plan of
        its micro-step, any mode: they are the other micro-batches, the losses and the gradient accumulator), when
        its AC budget is a size; 0 otherwise (one micro-batch a step, or a fraction of the micro-step's own)."""
        if cand.accumulation == 1 or parse_memory_budget(cand.memory_budget).peak_bytes is None:
            return 0
        micro = cand.micro()
        planned = self._plans.get(self._shape(micro), {}).get(micro.local_batch, {}).values()
        base = next((p for p in planned if isinstance(p, StepPlan)), None)
        if base is None:  # nothing of this micro-step could be planned: its budget fails as they did
            return 0
        d, options = dict(cand.degrees), dict(cand.options)
        return accumulated(base, cand.accumulation, options, d, self.device.type).peak_bytes - base.peak_bytes

    def _count(self, words: str, fallbacks: list[str]) -> None:
        """Count one plan as depth-free or whole-depth; the first whole-depth fallback is said (`block_plan.fall_back`
        wrote its line), the rest are counted."""
        depth = resolve_model_args(self.cfg).n_layers
        if fallbacks:
            if not any(f["why"] != _SHALLOW for f in self.full):
                (self.say or logger.warning)(fallbacks[0])
            self.full.append({"shape": words, "why": fallbacks[0]})
        elif depth <= short_depths(self.cfg)[-1]:
            self.full.append({"shape": words, "why": _SHALLOW})
        else:
            self.depth_free += 1

    def fail(self, cand: Candidate, stage: str, error: UserError) -> None:
        """Record that `cand`'s plan failed at `stage` (screen or exact)."""
        self.failed.append({"candidate": cand.label(), "stage": stage, "error": str(error)})

    def get(self, cand: Candidate, modes: Iterable[str], *, screen: bool = False) -> dict[str, StepPlan | UserError]:
        """`cand`'s micro-step plans for `modes` (cand's own AC mode is ignored); exact unless `screen`."""
        self.plan([cand], modes, screen=screen)
        micro = cand.micro()
        plans = self._plans[self._shape(micro)][micro.local_batch]
        if screen or cand.ac_mode != "budget":
            return plans
        solved = self._budgets_solved.get((self._shape(micro), micro.local_batch, self._beside(cand)))
        return plans if solved is None else {**plans, "budget": solved}


SHARDED = ("parameter", "optimizer_state", "gradient")  # the categories FSDP divides by dp_shard


def screen(cfg: JobConfig, cluster: Cluster, cands: list[Candidate], efficiency: float, plans: Plans) -> list[Screened]:
    """Predict each candidate's peak and step time from a reference plan at its own degrees, loss chunk,
    optimizer placement, micro-step options and local batch, except those the parallelisms screen otherwise
    (`layout.reference`: replication left out, FSDP on the smallest dp_shard searched with the rest). The
    references of one shape are planned at all their local batches at once (`Plans.plan`), exactly; a candidate
    at the reference's dp_shard is its own reference, and on another dp_shard the sharded state at the peak scales
    with 1 / dp_shard. Accumulation then adds what `accumulate.accumulated` adds."""
    modes = sorted({c.ac_mode for c in cands})
    if "budget" in modes:  # the modes a budget row is read between (`_budget_read_beside`); planned with it anyway
        modes = sorted({*modes, "none", "full"})
    refs: dict[tuple, Candidate] = {}
    for c in sorted(cands, key=lambda c: layout.sharded_degree(dict(c.degrees))):
        key, ref = _reference(c)
        refs.setdefault(key, ref)

    def ref_of(c: Candidate) -> Candidate:
        return dataclasses.replace(refs[_reference(c)[0]], local_batch=_reference_batch(cfg, c))

    plans.plan([ref_of(c) for c in cands], modes, screen=True)
    out = []
    for cand in cands:
        ref = ref_of(cand)
        by_mode = plans.get(ref, modes, screen=True)
        if isinstance(plan := by_mode[cand.ac_mode], UserError):
            plans.fail(cand, "screen", plan)
            continue
        out.append(_screened(cluster, cand, ref, by_mode, efficiency, plans.device.type, sequence_bytes(cfg)))
    return out


def sequence_bytes(cfg: JobConfig) -> int:
    """One sequence's activation between two pipeline stages: seq_len x dim in the compute dtype (`compute_dtype`:
    FSDP's bf16 parameters or autocast's)."""
    t = cfg.training
    dtype = compute_dtype(t.dtype, torch.device("cpu"), t.mixed_precision_param)
    return t.seq_len * resolve_model_args(cfg).dim * dtype.itemsize


def _reference_batch(cfg: JobConfig, c: Candidate) -> int:
    """The local batch `c`'s reference plan is made at: one micro-batch under a pipeline schedule, else c's."""
    model = layout.schedule_model(dict(c.degrees), dict(c.options), c.local_batch, sequence_bytes(cfg))
    return c.local_batch if model is None else model.micro_batch


_SHALLOW = "no deeper than the short traces: traced whole"


def _shape_words(micro: Candidate) -> str:
    """A plan's shape in words (`Plans._shape`)."""
    where = "in graph" if micro.trace_optimizer else "eager"
    words = layout.describe_options(dict(micro.options))[0]
    return f"{micro.layout()}, loss chunk {micro.loss_chunk_size}, optimizer {where}{words}"


def _reference(c: Candidate) -> tuple[tuple, Candidate]:
    """(key, reference) of `c` for the screen: the layout's (`layout.reference`) with the shape's other parts."""
    key, degrees = layout.reference(dict(c.degrees))
    micro = c.micro()
    options = tuple(layout.options_at(degrees, dict(micro.options)).items())
    ref = Candidate(
        layout.canonical(degrees), c.ac_mode, c.local_batch, c.loss_chunk_size, c.trace_optimizer, options=options
    )
    return (key, c.loss_chunk_size, c.trace_optimizer, options), ref


def _screened(
    cluster,
    cand: Candidate,
    ref: Candidate,
    by_mode: Mapping[str, StepPlan | UserError],
    efficiency,
    device_type: str,
    seq_bytes: int,
) -> Screened:
    d, r = dict(cand.degrees), dict(ref.degrees)
    scale = layout.sharded_degree(r) / layout.sharded_degree(d)
    p = by_mode[cand.ac_mode]
    micro = _at_scale(p, scale)
    options = dict(cand.options)
    if cand.ac_mode == "budget":
        at_scale = {m: _at_scale(q, scale) for m, q in by_mode.items() if isinstance(q, StepPlan)}
        micro = _budget_read_beside(micro, cand, at_scale, device_type)
    plan = accumulated(micro, cand.accumulation, options, d, device_type)
    plan, idle = scheduled(plan, layout.schedule_model(d, options, cand.local_batch, seq_bytes))
    comm = {**plan.comm_bytes, **layout.reference_comm(d, p.num_params * 4 // layout.state_divisor(d))}
    t = step_time(cluster, plan.flops, comm, d, efficiency, options, idle=idle)
    return Screened(cand, plan.peak_bytes, t)


def _at_scale(p: StepPlan, scale: float) -> StepPlan:
    """`p` with its sharded state at the peak scaled by `scale` (the reference's dp_shard over the candidate's)."""
    sharded = sum(p.peak_by_category.get(k, 0) for k in SHARDED)
    cats = {**p.peak_by_category, **{k: int(p.peak_by_category[k] * scale) for k in SHARDED if k in p.peak_by_category}}
    return dataclasses.replace(p, peak_bytes=p.peak_bytes + int(sharded * scale) - sharded, peak_by_category=cats)


def _budget_read_beside(
    budget: StepPlan, cand: Candidate, by_mode: Mapping[str, StepPlan], device_type: str
) -> StepPlan:
    """The screen's unsolved budget plan of `cand`'s micro-step, read again where an accumulating `cand` solves it:
    at the size less what accumulation holds beside each micro-step (`Plans._beside`), between the modes planned
    beside it as `block_plan` reads it (`budget_bracket`). Read at the size itself, it would be over the size by
    those bytes once accumulated, and the screen would never send it to the exact plan. `budget` itself otherwise
    (one micro-batch a step, a fraction, a solved plan, or none and full not planned)."""
    size = parse_memory_budget(cand.memory_budget).peak_bytes
    if cand.accumulation == 1 or size is None or not budget.approximate or not {"none", "full"} <= set(by_mode):
        return budget
    options, degrees = dict(cand.options), dict(cand.degrees)
    accumulated_peak = accumulated(budget, cand.accumulation, options, degrees, device_type).peak_bytes
    peak = int(min(size - (accumulated_peak - budget.peak_bytes), by_mode["none"].peak_bytes))
    above, below, w = budget_bracket(
        peak, {m: by_mode[m].peak_bytes for m in ("none", "selective", "full") if m in by_mode}
    )
    a, b = by_mode[above], by_mode[below]

    def mix(x: int, y: int) -> int:
        return int(round(x + w * (y - x)))

    activation = budget.peak_by_category.get("activation", 0) - (budget.peak_bytes - peak)
    return dataclasses.replace(
        budget,
        peak_bytes=peak,
        peak_by_category={**budget.peak_by_category, "activation": activation},
        flops=mix(a.flops, b.flops),
        saved_bytes=mix(a.saved_bytes, b.saved_bytes),
        comm_bytes={k: mix(a.comm_bytes.get(k, 0), b.comm_bytes.get(k, 0)) for k in {*a.comm_bytes, *b.comm_bytes}},
    )


STATE = ("parameter", "optimizer_state", "gradient")  # what a pipeline rank holds a share of (its stages')


def scheduled(plan: StepPlan, model: ScheduleModel | None) -> tuple[StepPlan, float]:
    """(a rank's step, its idle share of compute) under a pipeline schedule `model`, from one process's plan of one
    micro-batch (`Parallelism.schedule_model`): an estimate (`approximate`; an exact row plans every stage).
    `plan` itself and no idle time without a schedule."""
    if model is None:
        return plan, 0.0
    cats = plan.peak_by_category
    state = sum(cats.get(k, 0) for k in STATE)
    # The rank's gradients, summed over its micro-batches, are whole from the first backward on (one process's
    # peak, in its only backward, holds few of them).
    summed = cats.get("parameter", 0) * model.state
    activations = (plan.peak_bytes - state) * max(model.in_flight, 1.0)
    peak = int(state * model.state + summed + activations) + model.held_bytes
    comm = {k: int(v * model.work) for k, v in plan.comm_bytes.items()}
    comm[model.p2p_key] = comm.get(model.p2p_key, 0) + model.p2p_bytes
    out = dataclasses.replace(
        plan,
        peak_bytes=peak,
        peak_by_category={k: int(v * model.state) if k in STATE else v for k, v in cats.items()},
        flops=int(plan.flops * model.work),
        comm_bytes=comm,
        step_graph=None,
        approximate=True,
    )
    return out, model.idle


def plan_exactly(cfg: JobConfig, cluster: Cluster, rows: list[Screened], efficiency: float, plans: Plans) -> None:
    """Fill in each row's exact plan: its micro-step's depth-free plan (cached, every AC mode of a shape at once)
    accumulated over its micro-steps (`accumulate.accumulated`); under a pipeline schedule, the schedule model's
    FLOPs and bytes (`scheduled`) with the peak of its worst stage position, every one planned (`plan_positions`)."""
    seq_bytes = sequence_bytes(cfg)
    models = [layout.schedule_model(dict(r.cand.degrees), dict(r.cand.options), r.cand.local_batch, seq_bytes)
              for r in rows]  # fmt: skip
    micros = [r.cand if m is None else _one_process(r.cand, m.micro_batch) for r, m in zip(rows, models, strict=True)]
    plans.plan(micros, {r.cand.ac_mode for r in rows})  # a shape's local batches in one depth-free plan
    for row, model, micro in zip(rows, models, micros, strict=True):
        c = row.cand
        d, options = dict(c.degrees), dict(c.options)
        plan = plans.get(micro, {c.ac_mode})[c.ac_mode]
        if isinstance(plan, UserError):
            plans.fail(c, "exact", plan)
            continue
        plan, idle = scheduled(accumulated(plan, c.accumulation, options, d, plans.device.type), model)
        if model is not None:  # the peak is the worst stage's, each planned on fake tensors under the schedule
            try:
                plan = _stages_peak(plan, plan_positions(c.apply(cfg), plans.device, plans.say))
            except UserError as e:
                plans.fail(c, "exact", e)
                continue
        row.exact = plan
        row.exact_time = step_time(cluster, plan.flops, plan.comm_bytes, d, efficiency, options, idle=idle)


def _one_process(c: Candidate, micro_batch: int) -> Candidate:
    """`c` without its pipeline (`layout.unstaged`), at one micro-batch: the plan its schedule model reads."""
    degrees = layout.unstaged(dict(c.degrees))
    options = tuple(layout.options_at(degrees, dict(c.options)).items())
    return dataclasses.replace(c, degrees=layout.canonical(degrees), local_batch=micro_batch, options=options)


def _stages_peak(plan: StepPlan, stages: Iterable[StagePlan]) -> StepPlan:
    """`plan` with the peak of its worst pipeline position (`plan.stage_plan`: every rank's step run on fake
    tensors under torch's schedule, exact on CPU), and where that is."""
    worst = max(stages, key=lambda s: s.peak_bytes)
    return dataclasses.replace(
        plan,
        peak_bytes=worst.peak_bytes,
        peak_by_category={},
        peak_where=f"pp rank {worst.rank}: {worst.at}",
        peak_location=(None, f"pp rank {worst.rank}", worst.at),
        approximate=False,
    )


def plan_best(
    cfg: JobConfig, cluster: Cluster, fitting: list[Screened], count: int, efficiency: float, plans: Plans
) -> list[Screened]:
    """Plan the screen's fitting candidates exactly, fastest first, until `count` of them have an exact plan that
    fits (at most 4 x `count` planned): the rows planned, in screen order. A plan that is only an upper bound
    (`fsdp_grad_sync = "step"`, or accumulation without FSDP: `accumulate.accumulated`) does not count."""
    planned: list[Screened] = []
    tried = fitting[: 4 * count]
    for i, row in enumerate(tried, 1):
        plans.progress("exact plan", i, len(tried), row.cand.label())
        plan_exactly(cfg, cluster, [row], efficiency, plans)
        planned.append(row)
        if sum(is_exact_fit(r, cluster) for r in planned) >= count:
            break
    return planned


def is_exact_fit(row: Screened, cluster: Cluster) -> bool:
    """Whether the row's exact plan exists, is exact (not an upper bound) and fits the memory."""
    return row.exact is not None and not row.exact.approximate and row.exact.peak_bytes <= cluster.memory_bytes


def repeats_of_none(rows: list[Screened]) -> list[Screened]:
    """The AC budget rows of `rows` whose exact plan is the no-AC row's of the same candidate, also in `rows`: where
    no AC fits, the budget recomputes nothing, and its row would repeat that one."""
    by_cand = {r.cand: r for r in rows if r.exact is not None}
    return [
        r
        for r in rows
        if r.cand.ac_mode == "budget"
        and r.exact is not None
        and (none := by_cand.get(dataclasses.replace(r.cand, ac_mode="none", memory_budget=""))) is not None
        and (r.exact.peak_bytes, r.exact.flops) == (none.exact.peak_bytes, none.exact.flops)
    ]


def screen_errors(rows: list[Screened]) -> list[tuple[Screened, float, float]]:
    """(row, peak error, step-time error) of the screen against the exact plan, for each row planned both ways."""
    return [
        (r, r.peak / r.exact.peak_bytes - 1, r.time.total_s / r.exact_time.total_s - 1)
        for r in rows
        if r.exact is not None
    ]


__all__ = [
    "Candidate",
    "Plans",
    "Screened",
    "Space",
    "candidates",
    "factorizations",
    "layouts",
    "model_allows",
    "offered_degrees",
    "is_exact_fit",
    "plan_best",
    "plan_exactly",
    "repeats_of_none",
    "screen",
    "screen_errors",
    "state_bytes",
    "trainer_refuses",
]
