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
from collections.abc import Iterator

import torch

from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.errors import UserError
from graph_trainer.job_config.load import resolve_model_args
from graph_trainer.job_config.model_args import get_model_spec
from graph_trainer.job_config.schema import JobConfig, ParallelismConfig
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
    # Micro-steps per step: 1 until gradient accumulation lands (issue 22); then `candidates` splits the local
    # batch into local_batch x accumulation and plans both gradient-sync choices (DECISIONS.md).
    accumulation: int = 1

    def overrides(self) -> list[str]:
        """The trainer options that ask for this candidate."""
        out = [f"--parallelism.{name} {n}" for name, n in self.degrees if n > 1]
        if dict(self.degrees).get("dp_shard", 1) > 1:
            out.append("--parallelism.fsdp_prefetch true")  # the overlap the cost model counts
        out += [
            f"--activation_checkpoint.mode {self.ac_mode}",
            f"--training.local_batch_size {self.local_batch}",
            f"--training.loss_chunk_size {self.loss_chunk_size}",
            f"--compile.trace_optimizer {str(self.trace_optimizer).lower()}",
        ]
        return out

    def layout(self) -> str:
        return " x ".join(f"{name} {n}" for name, n in self.degrees if n > 1) or "one process"

    def apply(self, cfg: JobConfig) -> JobConfig:
        """`cfg` with this candidate's settings (a copy)."""
        out = copy.deepcopy(cfg)
        for name, n in self.degrees:
            setattr(out.parallelism, name, n)
        if dict(self.degrees).get("dp_shard", 1) > 1:
            out.parallelism.fsdp_prefetch = True
            if out.training.dtype == "bfloat16":  # the bf16 plan: FSDP gathers bf16 parameters, as on a GPU
                out.training.mixed_precision_param = "bfloat16"
        out.activation_checkpoint.mode = self.ac_mode
        out.training.local_batch_size = self.local_batch
        out.training.loss_chunk_size = self.loss_chunk_size
        out.compile.trace_optimizer = self.trace_optimizer
        return out


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
    """Why the model refuses these degrees (None: it allows them): tp must divide the heads and KV heads and
    stay within a node."""
    tp = degrees.get("tp", 1)
    if tp == 1:
        return None
    args = resolve_model_args(cfg)
    kv = getattr(args, "n_kv_heads", None) or args.n_heads
    if args.n_heads % tp or kv % tp:
        return f"tp {tp} does not divide {args.n_heads} heads and {kv} KV heads"
    if tp > gpus_per_node:
        return f"tp {tp} spans nodes"
    return None


def layouts(cfg: JobConfig, cluster: Cluster) -> tuple[list[dict[str, int]], list[str]]:
    """(the layouts to search, 'layout: why' for each one skipped)."""
    names = offered_degrees()
    keep, skipped = [], []
    for degrees in factorizations(cluster.gpus, names):
        why = model_allows(cfg, degrees, cluster.gpus_per_node)
        if why is None:
            trial = copy.deepcopy(cfg.parallelism)
            for name, n in degrees.items():
                setattr(trial, name, n)
            try:
                ParallelDims.from_config(trial)
            except UserError as e:
                why = f"the trainer refuses it ({str(e).split(';')[0]})"
        label = " x ".join(f"{k} {v}" for k, v in degrees.items() if v > 1) or "one process"
        (skipped.append(f"{label}: {why}") if why else keep.append(degrees))
    return keep, skipped


def candidates(
    cfg: JobConfig,
    layouts_: list[dict[str, int]],
    global_seqs: int,
    ac_modes: tuple[str, ...],
    chunks: tuple[int, ...],
    optimizer_in_graph: tuple[bool, ...],
) -> list[Candidate]:
    """The search space: each layout's local batch is the global batch over its data-parallel ranks."""
    out = []
    for degrees in layouts_:
        dp = degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1)
        if global_seqs % dp:
            continue
        for mode, chunk, in_graph in itertools.product(ac_modes, chunks, optimizer_in_graph):
            out.append(Candidate(tuple(degrees.items()), mode, global_seqs // dp, chunk, in_graph))
    return out


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


def screen(
    cfg: JobConfig, cluster: Cluster, cands: list[Candidate], efficiency: float, device: torch.device
) -> list[Screened]:
    """Predict each candidate's peak and step time from one exact plan per AC mode at local batch 1, one rank."""
    refs = _reference_plans(cfg, {c.ac_mode for c in cands}, cands, device)
    out = []
    for cand in cands:
        ref, one = refs[(cand.ac_mode, cand.loss_chunk_size, cand.trace_optimizer)]
        act = ref.peak_bytes - one  # activations (and the step's transients) at local batch 1
        d = dict(cand.degrees)
        # Sequence parallelism splits the activations over the tp ranks (but for the gathered norm outputs the
        # column-parallel matmuls keep whole for their backward: the exact plan is the judge).
        peak = state_bytes(cfg, cand) + cand.local_batch * act // d.get("tp", 1)
        flops = ref.flops * cand.local_batch // d.get("tp", 1)
        comm = _screened_comm(cfg, cand, ref.num_params)
        t = step_time(cluster, flops, comm, d, efficiency, prefetch=d.get("dp_shard", 1) > 1)
        out.append(Screened(cand, peak, t))
    return out


# Sequence-parallel traffic per block, in whole [local batch, seq, dim] activations, by AC mode: the forward
# gathers the inputs of the attention and the feed-forward and reduce-scatters their outputs (2 + 2), the
# backward does the reverse (2 + 2); full AC's recompute gathers both inputs again and reduce-scatters the
# attention's output again (its block output is not needed), and selective AC recomputes the gathers (it saves
# matmul outputs, not collectives). Counted from the exact plans of Llama-3 70B and 405B at tp 8 (docs/planner.md).
TP_GATHERS_PER_BLOCK = {"none": 4, "selective": 6, "full": 6}
TP_SCATTERS_PER_BLOCK = {"none": 4, "selective": 4, "full": 5}


def _screened_comm(cfg: JobConfig, cand: Candidate, params: int) -> dict[str, int]:
    """The bytes per '<parallelism> <collective>' a candidate moves per step, predicted from its shape."""
    d = dict(cand.degrees)
    tp, shard = d.get("tp", 1), d.get("dp_shard", 1)
    bf16 = cfg.training.dtype == "bfloat16"
    comm = {}
    if shard > 1:  # gathered in the forward and again in the backward; gradients reduced once
        gathered = 2 if bf16 else 4  # the bf16 plan gathers bf16 parameters (Candidate.apply)
        comm = {"fsdp all_gather": 2 * params * gathered // tp, "fsdp reduce_scatter": params * 4 // tp}
    if d.get("dp_replicate", 1) > 1:
        comm["dp_replicate all_reduce"] = params * 4 // (shard * tp)
    if tp > 1 and cand.ac_mode in TP_GATHERS_PER_BLOCK:
        args = resolve_model_args(cfg)
        activation = cand.local_batch * cfg.training.seq_len * args.dim * (2 if bf16 else 4)
        comm["tp all_gather"] = args.n_layers * TP_GATHERS_PER_BLOCK[cand.ac_mode] * activation
        comm["tp reduce_scatter"] = args.n_layers * TP_SCATTERS_PER_BLOCK[cand.ac_mode] * activation
    return comm


def _reference_plans(cfg, modes, cands, device) -> dict:
    """(plan at local batch 1 on one process, its state bytes) per (AC mode, loss chunk, optimizer placement)."""
    refs = {}
    for chunk, in_graph in {(c.loss_chunk_size, c.trace_optimizer) for c in cands}:
        one = Candidate((("dp_replicate", 1),), "none", 1, chunk, in_graph)
        ref_cfg = one.apply(cfg)
        with planning_mesh(ParallelDims(), device) as mesh:
            plans = plan_modes(ref_cfg, mesh, sorted(modes))
        for mode, plan in plans.items():
            if isinstance(plan, UserError):
                continue
            refs[(mode, chunk, in_graph)] = (plan, state_bytes(cfg, one))
    return refs


def plan_exactly(cfg: JobConfig, cluster: Cluster, rows: list[Screened], efficiency: float, device) -> None:
    """Fill in each row's exact plan (one depth-free plan per layout and batch, every AC mode of it at once)."""
    groups: dict[tuple, list[Screened]] = {}
    for row in rows:
        c = row.cand
        groups.setdefault((c.degrees, c.local_batch, c.loss_chunk_size, c.trace_optimizer), []).append(row)
    for group in groups.values():
        cand_cfg = group[0].cand.apply(cfg)
        dims = ParallelDims.from_config(cand_cfg.parallelism)
        with planning_mesh(dims, device) as mesh:
            plans = plan_modes(cand_cfg, mesh, sorted({r.cand.ac_mode for r in group}))
        for row in group:
            plan = plans[row.cand.ac_mode]
            if isinstance(plan, UserError):
                continue
            row.exact = plan
            d = dict(row.cand.degrees)
            row.exact_time = step_time(cluster, plan.flops, plan.comm_bytes, d, efficiency, d.get("dp_shard", 1) > 1)


__all__ = [
    "Candidate",
    "Screened",
    "candidates",
    "factorizations",
    "layouts",
    "model_allows",
    "offered_degrees",
    "plan_exactly",
    "screen",
    "state_bytes",
]
