"""`--dry-run`: the plan of one rank's step for every activation-checkpointing mode, printed."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch

from graph_trainer.builder import Job, adamw_implementation_for, build_job, optimizer_in_graph
from graph_trainer.distributed.layout import planned_apart
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.errors import UserError
from graph_trainer.job_config.batching import accumulation_steps
from graph_trainer.job_config.load import resolve_model_args
from graph_trainer.job_config.pretrained import model_name
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.units import to_gib
from graph_trainer.plan import budget_frontier
from graph_trainer.plan.attention_memory import attention_memory
from graph_trainer.plan.block_plan import plan_modes, short_depths
from graph_trainer.plan.budget_frontier import (
    HEADER,
    POINTS,
    depth_free,
    frontier_row,
    plan_frontier,
    write_frontier,
)
from graph_trainer.plan.preflight import available_bytes
from graph_trainer.plan.stage_plan import print_stage_plans
from graph_trainer.plan.step_plan import AC_MODES, StepPlan
from graph_trainer.runtime.device import compute_dtype, resolve_device
from graph_trainer.runtime.gc_pause import gc_paused


def _accumulation(cfg: JobConfig) -> str:
    steps = accumulation_steps(cfg)
    return f" x {steps} accumulated micro-batches (global batch {cfg.training.global_batch_size})" if steps > 1 else ""


@gc_paused()  # the plan's objects live until it is done: see runtime/gc_pause.py
def dry_run(cfg: JobConfig, *, device: torch.device | None = None, print_fn: Callable[[str], None] = print) -> None:
    """Print, for each AC mode, the predicted peak, saved activations, parameters and FLOPs per step, and with
    parallelisms the bytes each kind of collective moves per step per rank (`StepPlan.comm_bytes`).

    With parallelisms the plan is one rank's, traced on torch's fake process group: `parallelism.dp_shard` = N
    plans one rank of N without launching N processes.
    """
    device = device or resolve_device(cfg.training.device)
    dims = ParallelDims.from_config(cfg.parallelism)
    if planned_apart(dims.degrees()) is not None:  # every stage's plan differs (`plan.stage_plan`)
        print_stage_plans(cfg, device, print_fn)
        print_fn(f"available on {device.type}: {to_gib(available_bytes(device)):.2f} GiB")
        return
    with planning_mesh(dims, device) as mesh:
        depth = resolve_model_args(cfg).n_layers
        short = copy.deepcopy(cfg)  # only for the header: what the parallelisms are (no deep model is built)
        short.model.n_layers = min(depth, short_depths(cfg)[0])
        job = build_job(short, mesh, materialize=False)
        update = "in the graph" if optimizer_in_graph(cfg) else "eager, " + adamw_implementation_for(cfg, device)
        t = cfg.training
        dtype = str(compute_dtype(t.dtype, device, t.mixed_precision_param)).removeprefix("torch.")
        per_rank = f", one rank of {mesh.world_size} ({job.parallel.describe()}, {' x '.join(dims.used())})"
        print_fn(
            f"dry run: {model_name(cfg)}, batch {t.local_batch_size} x "
            f"seq {t.seq_len}{_accumulation(cfg)}, device {device.type}"
            f"{per_rank if mesh.world_size > 1 else ''}, compute dtype "
            f"{dtype}, fake tensors only (clipping and the AdamW update included: {update})"
        )
        print_fn(
            f"{'ac mode':10} {'peak GiB':>9} {'saved GiB':>10} {'params':>15} {'TFLOP/step':>11} {'plan s':>7}  peak at"
        )
        plans = plan_modes(cfg, mesh, AC_MODES, on_fallback=print_fn)  # a whole-depth fallback: one line, here
        for mode, plan in plans.items():
            if isinstance(plan, UserError):
                print_fn(f"{mode:10} not plannable: {plan}")
                continue
            where = "approximate (see docs/planner.md)" if plan.approximate else plan.peak_at
            print_fn(
                f"{mode:10} {to_gib(plan.peak_bytes):9.2f} {to_gib(plan.saved_bytes):10.2f} "
                f"{plan.num_params:15,} {plan.flops / 1e12:11.2f} {plan.trace_time_s:7.1f}  {where}"
            )
            if plan.comm_bytes:  # each mode's own: remat's re-gathers differ between modes
                traffic = ", ".join(f"{kind} {to_gib(n):.3g}" for kind, n in plan.comm_bytes.items())
                print_fn(f"{'':10} communicated GiB per step per rank: {traffic}")
        traced = max((p.blocks_traced for p in plans.values() if isinstance(p, StepPlan)), default=0)
        if traced == depth:
            print_fn(f"blocks traced: all {depth}, once for all modes")
        else:
            short = " + ".join(map(str, short_depths(cfg)))
            print_fn(
                f"blocks traced: {short} for a model of {depth}, once for all modes; extended exactly (docs/planner.md)"
            )
        print_fn(_attention_line(job, cfg))
        if cfg.activation_checkpoint.mode == "budget":
            _print_frontier(cfg, mesh, print_fn)
    print_fn(f"available on {device.type}: {to_gib(available_bytes(device)):.2f} GiB")


def _print_frontier(cfg: JobConfig, mesh, print_fn: Callable[[str], None]) -> None:
    """The budget policy's frontier (`plan.budget_frontier`): a row per budget as it is solved, then the files."""
    depth = resolve_model_args(cfg).n_layers
    short = " + ".join(map(str, short_depths(cfg)))
    solve = f"one solve of at most {budget_frontier.SOLVE_S:g} s a point"  # the limit plan_frontier reads
    solved_on = (
        f"one choice per block class, solved on the {short}-block traces extended to {depth} blocks ({solve})"
        if depth_free(cfg)
        else f"solved on all {depth} blocks (one trace, {solve})"
    )
    print_fn(
        f"budget frontier: the budget policy's plan at {POINTS} budgets from the lowest peak found to no AC, "
        f"{solved_on}; fraction is the "
        "--activation_checkpoint.memory_budget that asks for the row; proof: optimal (HiGHS proved it), gap=x% "
        "(stopped at its limit), unproven (the solver found nothing cheaper than a smaller budget's choice)"
    )
    print_fn(HEADER)
    found = plan_frontier(cfg, mesh, on_point=lambda p: print_fn(frontier_row(p)))
    if reserve := found[0].reserve_bytes:
        print_fn(
            f"budget frontier: with FSDP's prefetch each budget keeps {to_gib(reserve):.4f} GiB for the gathers the "
            "prefetch moves up, and each peak is the step's before they move (at most that much more after)"
        )
    title = f"{model_name(cfg)}, batch {cfg.training.local_batch_size} x seq {cfg.training.seq_len}, {depth} blocks"
    for line in write_frontier(Path(cfg.job.dump_folder), found, title=title):
        print_fn(line)


def _attention_line(job: Job, cfg: JobConfig) -> str:
    """One line: the attention's bytes per layer at half, once and twice the sequence length (within the model's
    max_seq_len), and the document mask's, which every layer shares (graph_trainer.plan.attention_memory)."""
    s, longest = cfg.training.seq_len, job.model.args.max_seq_len
    found = attention_memory(job, sorted({max(1, s // 2), s, min(2 * s, longest)}))
    if not found:
        return "attention memory per layer: no attention op the planner knows"
    per_layer = ", ".join(f"seq {a.seq_len}: {a.per_layer_bytes / 2**20:.3g}" for a in found)
    line = f"attention MiB per layer (q, k, v, output, log-sum-exp kept for backward): {per_layer}"
    if cfg.data.document_masking:
        masks = ", ".join(f"seq {a.seq_len}: {a.mask_bytes / 2**20:.3g}" for a in found)
        line += f"; document mask, once for all layers: {masks}"
    return line


__all__ = ["dry_run"]
