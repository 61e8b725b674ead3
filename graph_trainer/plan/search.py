"""The layout search: candidates, pruning, the analytic screen, and the exact plans of the best screened ones.

Candidates are every factorization of the GPU count over the mesh degrees the config schema offers
(`parallelism.dp_replicate`, `dp_shard`, and `tp` once the schema has it), crossed with the AC mode, the
local batch that gives the global batch, `loss_chunk_size` and the optimizer in or out of the graph. A layout
the trainer refuses (`ParallelDims.from_config`, e.g. HSDP today) is skipped and listed. Pruning drops what
cannot fit even without activations; the screen predicts the rest from one exact depth-free plan per AC mode
at local batch 1 on one rank (activations scale with the local batch, state divides by the shard degree);
the top `exact` candidates are then planned exactly (`block_plan.plan_modes`), and only those are ranked.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterable, Iterator

import torch

from graph_trainer.distributed.expert_parallel import check_expert_degrees
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.errors import UserError
from graph_trainer.job_config.load import resolve_model_args, validate
from graph_trainer.job_config.model_args import get_model_spec
from graph_trainer.job_config.schema import JobConfig, ParallelismConfig
from graph_trainer.plan.accumulate import accumulated
from graph_trainer.plan.block_plan import plan_modes
from graph_trainer.plan.cluster import Cluster
from graph_trainer.plan.cost_model import StepTime, step_time
from graph_trainer.plan.step_plan import StepPlan

MESH_DEGREES = ("dp_replicate", "dp_shard", "tp")  # outermost first; those the schema lacks are left out
BYTES_PER_PARAM_STATE = 16  # fp32 parameter + fp32 gradient + AdamW's two fp32 moments


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search space."""

    degrees: tuple[tuple[str, int], ...]
    ac_mode: str
    local_batch: int
    loss_chunk_size: int
    trace_optimizer: bool
    accumulation: int = 1  # micro-steps per step: the global batch is local batch x dp degree x accumulation
    grad_sync: str = "micro_batch"  # parallelism.fsdp_grad_sync: both are planned when FSDP accumulates
    ep: int = 1  # parallelism.ep, carved out of dp_shard (not a factor of the world)
    prefetch: bool = False  # parallelism.fsdp_prefetch (see PREFETCH in docs/planner.md)

    @property
    def dp(self) -> int:
        d = dict(self.degrees)
        return d.get("dp_replicate", 1) * d.get("dp_shard", 1)

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.dp * self.accumulation

    def overrides(self) -> list[str]:
        """The trainer options that ask for this candidate."""
        out = [f"--parallelism.{name} {n}" for name, n in self.degrees if n > 1]
        if self.ep > 1:
            out.append(f"--parallelism.ep {self.ep}")
        if self.prefetch and dict(self.degrees).get("dp_shard", 1) > 1:
            out.append("--parallelism.fsdp_prefetch true")  # the overlap the cost model counts
        out += [
            f"--activation_checkpoint.mode {self.ac_mode}",
            f"--training.local_batch_size {self.local_batch}",
            f"--training.loss_chunk_size {self.loss_chunk_size}",
            f"--compile.trace_optimizer {str(self.trace_optimizer).lower()}",
        ]
        if self.accumulation > 1:
            out.append(f"--training.global_batch_size {self.global_batch}")
            if self.grad_sync != "micro_batch":
                out.append(f"--parallelism.fsdp_grad_sync {self.grad_sync}")
        return out

    def layout(self) -> str:
        text = " x ".join(f"{name} {n}" for name, n in self.degrees if n > 1) or "one process"
        return text + (f" (ep {self.ep})" if self.ep > 1 else "")

    def batch(self) -> str:
        """'local batch x accumulation', with the deferred gradient sync marked."""
        return f"{self.local_batch} x {self.accumulation}" + ("s" if self.grad_sync == "step" else "")

    def apply(self, cfg: JobConfig) -> JobConfig:
        """`cfg` with this candidate's settings (a copy)."""
        out = copy.deepcopy(cfg)
        for name, n in self.degrees:
            setattr(out.parallelism, name, n)
        out.parallelism.ep = self.ep
        if dict(self.degrees).get("dp_shard", 1) > 1:
            out.parallelism.fsdp_prefetch = self.prefetch
            if out.training.dtype == "bfloat16":  # the bf16 plan: FSDP gathers bf16 parameters, as on a GPU
                out.training.mixed_precision_param = "bfloat16"
                out.training.dtype = "auto"  # the trainer refuses both (bf16 parameters set the compute dtype)
        out.activation_checkpoint.mode = self.ac_mode
        out.training.local_batch_size = self.local_batch
        out.training.loss_chunk_size = self.loss_chunk_size
        out.compile.trace_optimizer = self.trace_optimizer
        out.training.global_batch_size = self.global_batch if self.accumulation > 1 else -1
        out.parallelism.fsdp_grad_sync = self.grad_sync
        return out

    def micro(self) -> Candidate:
        """This candidate's micro-step: the same but one micro-batch a step (what is planned, then accumulated)."""
        return dataclasses.replace(self, accumulation=1, grad_sync="micro_batch")


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
    """Why the model refuses these degrees (None: it allows them): tp needs the family's tensor-parallel plan,
    must divide the heads and KV heads and stay within a node."""
    tp = degrees.get("tp", 1)
    if tp == 1:
        return None
    if get_model_spec(cfg.model.name).parallel_plan.tensor_parallel is None:
        return f"model {cfg.model.name} declares no tensor-parallel plan"
    args = resolve_model_args(cfg)
    kv = getattr(args, "n_kv_heads", None) or args.n_heads
    if args.n_heads % tp or kv % tp:
        return f"tp {tp} does not divide {args.n_heads} heads and {kv} KV heads"
    if tp > gpus_per_node:
        return f"tp {tp} spans nodes"
    return None


def trainer_refuses(cfg: JobConfig, cand: Candidate) -> str | None:
    """Why the trainer refuses `cand` (None: it accepts it): the one gate every candidate passes, so the search
    proposes a combination (tp with accumulation, ep below dp_shard, HSDP) as soon as the trainer takes it.

    It runs the trainer's own checks: the config validation (`job_config.load.validate`), the mesh's
    (`ParallelDims.from_config`) and expert parallelism's degrees (`check_expert_degrees`, which the trainer runs
    when it builds the model).
    """
    trial = cand.apply(cfg)
    try:
        validate(trial)
        ParallelDims.from_config(trial.parallelism)
        experts = getattr(resolve_model_args(trial), "n_routed_experts", 0) or 0
        if cand.ep > 1 and experts:
            check_expert_degrees(experts, cand.ep, trial.parallelism.dp_shard)
    except UserError as e:
        return str(e).split(";")[0].split(":")[0]
    return None


def layouts(cfg: JobConfig, cluster: Cluster) -> tuple[list[dict[str, int]], list[str]]:
    """(the layouts to search, 'layout: why' for each one skipped)."""
    keep, skipped = [], []
    for degrees in factorizations(cluster.gpus, offered_degrees()):
        why = model_allows(cfg, degrees, cluster.gpus_per_node)
        if why is None:
            why = trainer_refuses(cfg, Candidate(tuple(degrees.items()), "none", 1, 0, False))
            why = why and f"the trainer refuses it ({why})"
        label = " x ".join(f"{k} {v}" for k, v in degrees.items() if v > 1) or "one process"
        (skipped.append(f"{label}: {why}") if why else keep.append(degrees))
    return keep, skipped


def expert_degrees(cfg: JobConfig, dp_shard: int) -> list[int]:
    """The ep values to search at `dp_shard`: 1, and for a model with routed experts every divisor of dp_shard
    that divides the expert count."""
    experts = getattr(resolve_model_args(cfg), "n_routed_experts", 0) or 0
    return [1] + [e for e in range(2, dp_shard + 1) if dp_shard % e == 0 and experts and experts % e == 0]


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
    prefetch: tuple[bool, ...] = (False,),
) -> Space:
    """Every layout x ep x (local batch, accumulation) whose product with the data-parallel degree is the global
    batch x gradient sync (both with FSDP accumulation) x AC mode x loss chunk x optimizer placement x prefetch,
    each passed through `trainer_refuses` (once per distinct setting of the options it reads)."""
    space = Space([], {})
    verdicts: dict[tuple, str | None] = {}
    for degrees in layouts_:
        dp = degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1)
        if global_seqs % dp:
            continue
        per_rank = global_seqs // dp
        shard = degrees.get("dp_shard", 1)
        for ep, lb in itertools.product(expert_degrees(cfg, shard), _divisors(per_rank)):
            acc = per_rank // lb
            syncs = ("micro_batch", "step") if acc > 1 and shard > 1 else ("micro_batch",)
            for sync, pf in itertools.product(syncs, prefetch if shard > 1 else (False,)):
                base = Candidate(tuple(degrees.items()), ac_modes[0], lb, chunks[0], optimizer_in_graph[0],
                                 acc, sync, ep, pf)  # fmt: skip
                key = (base.degrees, ep, acc > 1, sync, pf)
                if key not in verdicts:
                    verdicts[key] = trainer_refuses(cfg, base)
                if verdicts[key]:
                    what = f"{base.layout()}{' with accumulation' if acc > 1 else ''}: {verdicts[key]}"
                    space.refused[what] = space.refused.get(what, 0) + 1
                    continue
                for mode, chunk, in_graph in itertools.product(ac_modes, chunks, optimizer_in_graph):
                    space.cands.append(dataclasses.replace(base, ac_mode=mode, loss_chunk_size=chunk,
                                                           trace_optimizer=in_graph))  # fmt: skip
    return space


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def state_bytes(cfg: JobConfig, cand: Candidate) -> int:
    """Parameters, gradients and optimizer state on one rank: what no AC mode or batch lowers."""
    params = get_model_spec(cfg.model.name).num_params(resolve_model_args(cfg))
    d = dict(cand.degrees)
    return params * BYTES_PER_PARAM_STATE // (d.get("dp_shard", 1) * d.get("tp", 1))


@dataclasses.dataclass
class Screened:
    """A candidate's screen: predicted peak and step time, and later its exact plan."""

    cand: Candidate
    peak: int
    time: StepTime
    exact: StepPlan | None = None
    exact_time: StepTime | None = None


class Plans:
    """Depth-free plans of micro-steps, cached by what their trace depends on, every AC mode of one trace at once.

    A key is (degrees, ep, local batch, loss chunk, optimizer placement, prefetch): the screen's references and
    the exact plans share it, so an exact plan at a reference's shape costs nothing more.
    """

    def __init__(self, cfg: JobConfig, device: torch.device, *, exact_prefetch: bool = True):
        self.cfg, self.device = cfg, device
        # False: plan a prefetching candidate's memory without prefetch (the depth-free plan falls back to a
        # whole-depth trace with it) and mark the plan approximate; its step time still counts the overlap.
        self.exact_prefetch = exact_prefetch
        self._plans: dict[tuple, dict[str, StepPlan | UserError]] = {}
        self.calls = 0  # depth-free plans made (each traces 3 + 4 blocks once, for every mode asked together)

    def planned_as(self, cand: Candidate) -> Candidate:
        """The micro-step candidate whose plan stands for `cand`'s."""
        fsdp = dict(cand.degrees).get("dp_shard", 1) > 1
        return cand.micro() if not cand.prefetch else dataclasses.replace(
            cand.micro(), prefetch=fsdp and self.exact_prefetch
        )  # fmt: skip

    def get(self, cand: Candidate, modes: Iterable[str]) -> dict[str, StepPlan | UserError]:
        """`cand`'s micro-step plans for `modes` (cand's own AC mode is ignored)."""
        micro = self.planned_as(cand)
        key = (micro.degrees, micro.ep, micro.local_batch, micro.loss_chunk_size, micro.trace_optimizer,
               micro.prefetch)  # fmt: skip
        have = self._plans.setdefault(key, {})
        missing = sorted(set(modes) - set(have))
        if missing:
            cand_cfg = micro.apply(self.cfg)
            with planning_mesh(ParallelDims.from_config(cand_cfg.parallelism), self.device) as mesh:
                have.update(plan_modes(cand_cfg, mesh, missing))
            self.calls += 1
        return have


def _between(lo: tuple[int, int], hi: tuple[int, int], lb: int) -> int:
    """The value at local batch `lb` on the chord through (lb_lo, value) `lo` and (lb_hi, value) `hi`."""
    if hi[0] == lo[0]:
        return lo[1]
    return lo[1] + (lb - lo[0]) * (hi[1] - lo[1]) // (hi[0] - lo[0])


SHARDED = ("parameter", "optimizer_state", "gradient")  # the categories FSDP divides by dp_shard


def screen(cfg: JobConfig, cluster: Cluster, cands: list[Candidate], efficiency: float, plans: Plans) -> list[Screened]:
    """Predict each candidate's peak and step time from reference plans at its own tp (and ep, FSDP or not, loss
    chunk, optimizer placement), on the smallest dp_shard searched with them, at the smallest and the largest
    local batch searched with them. Between the two, a candidate's peak, FLOPs and traffic are read off the
    chord: every tensor's bytes are affine in the local batch, so the peak (their largest sum) is convex in it
    and the chord bounds it from above. The sharded state scales with 1 / dp_shard, and accumulation adds what
    `accumulate.accumulated` adds. Prefetch is left out of the references (docs/planner.md)."""
    modes = sorted({c.ac_mode for c in cands})
    refs: dict[tuple, tuple[Candidate, int, int]] = {}
    for c in sorted(cands, key=lambda c: dict(c.degrees).get("dp_shard", 1)):
        ref, lo, hi = refs.get(_ref_key(c), (_ref(c), c.local_batch, c.local_batch))
        refs[_ref_key(c)] = (ref, min(lo, c.local_batch), max(hi, c.local_batch))
    out = []
    for cand in cands:
        ref, lo, hi = refs[_ref_key(cand)]
        ends = [plans.get(dataclasses.replace(ref, local_batch=lb), modes)[cand.ac_mode] for lb in (lo, hi)]
        if any(isinstance(p, UserError) for p in ends):
            continue
        out.append(_screened(cluster, cand, ref, (lo, ends[0]), (hi, ends[1]), efficiency))
    return out


def _ref_key(c: Candidate) -> tuple:
    d = dict(c.degrees)
    return (d.get("tp", 1), d.get("dp_shard", 1) > 1, c.ep, c.loss_chunk_size, c.trace_optimizer)


def _ref(c: Candidate) -> Candidate:
    d = dict(c.degrees)
    degrees = (("dp_replicate", 1), ("dp_shard", d.get("dp_shard", 1)), ("tp", d.get("tp", 1)))
    return Candidate(degrees, c.ac_mode, 1, c.loss_chunk_size, c.trace_optimizer, ep=c.ep)


def _screened(cluster, cand: Candidate, ref: Candidate, lo: tuple, hi: tuple, efficiency) -> Screened:
    d, r = dict(cand.degrees), dict(ref.degrees)
    scale = r.get("dp_shard", 1) / d.get("dp_shard", 1)
    lb, (lb_lo, p_lo), (lb_hi, p_hi) = cand.local_batch, lo, hi

    def at(value) -> int:
        return _between((lb_lo, value(p_lo)), (lb_hi, value(p_hi)), lb)

    sharded = sum(p_lo.peak_by_category.get(k, 0) for k in SHARDED)
    cats = {
        "parameter": int(p_lo.peak_by_category.get("parameter", 0) * scale),
        "batch": lb * p_lo.peak_by_category.get("batch", 0) // lb_lo,
    }
    micro = dataclasses.replace(
        p_lo,
        peak_bytes=at(lambda p: p.peak_bytes) + int(sharded * scale) - sharded,
        peak_by_category=cats,
        flops=at(lambda p: p.flops),
        comm_bytes={k: at(lambda p, k=k: p.comm_bytes.get(k, 0)) for k in {*p_lo.comm_bytes, *p_hi.comm_bytes}},
    )
    plan = accumulated(micro, cand.accumulation, cand.grad_sync, d.get("dp_shard", 1))
    comm = dict(plan.comm_bytes)
    if d.get("dp_replicate", 1) > 1:  # the references replicate nothing: the gradients' all-reduce, once a step
        comm["dp_replicate all_reduce"] = p_lo.num_params * 4 // (d.get("dp_shard", 1) * d.get("tp", 1))
    t = step_time(cluster, plan.flops, comm, {**d, "ep": cand.ep}, efficiency, prefetch=cand.prefetch)
    return Screened(cand, plan.peak_bytes, t)


def plan_exactly(cfg: JobConfig, cluster: Cluster, rows: list[Screened], efficiency: float, plans: Plans) -> None:
    """Fill in each row's exact plan: its micro-step's depth-free plan (cached, every AC mode of a shape at once)
    accumulated over its micro-steps (`accumulate.accumulated`)."""
    for row in rows:
        c = row.cand
        same = {r.cand.ac_mode for r in rows if plans.planned_as(r.cand) == plans.planned_as(c)}
        plan = plans.get(c, sorted(same | {c.ac_mode}))
        plan = plan[c.ac_mode]
        if isinstance(plan, UserError):
            continue
        d = dict(c.degrees)
        if plans.planned_as(c).prefetch != (c.prefetch and d.get("dp_shard", 1) > 1):
            plan = dataclasses.replace(plan, approximate=True)  # planned without the prefetch it runs with
        row.exact = accumulated(plan, c.accumulation, c.grad_sync, d.get("dp_shard", 1))
        row.exact_time = step_time(
            cluster, row.exact.flops, row.exact.comm_bytes, {**d, "ep": c.ep}, efficiency, c.prefetch
        )


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
    "expert_degrees",
    "factorizations",
    "layouts",
    "model_allows",
    "offered_degrees",
    "plan_exactly",
    "screen",
    "screen_errors",
    "state_bytes",
    "trainer_refuses",
]
