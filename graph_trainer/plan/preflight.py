"""The preflight: refuse, before anything is allocated, a job whose planned step does not fit the device."""

from __future__ import annotations

import torch

from graph_trainer.builder import build_job
from graph_trainer.distributed.layout import planned_apart
from graph_trainer.distributed.mesh import Mesh
from graph_trainer.errors import ConfigError, UserError
from graph_trainer.job_config.load import resolve_model_args
from graph_trainer.job_config.memory_budget import parse_memory_budget
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.log import get_logger
from graph_trainer.observability.units import GIB, KIB, to_gib
from graph_trainer.plan.block_plan import plan_modes, short_depths
from graph_trainer.plan.stage_plan import StagePlan, pipeline_budget_choice, plan_stage, stage_position
from graph_trainer.plan.step_plan import StepPlan, plan_step
from graph_trainer.runtime.gc_pause import gc_paused

logger = get_logger(__name__)


def available_bytes(device: torch.device) -> int:
    """Memory a step can use: free CUDA memory, or MemAvailable of the machine on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KIB
    raise UserError("cannot read available memory from /proc/meminfo")


@gc_paused()  # the plan's objects live until it is done: see runtime/gc_pause.py
def preflight(cfg: JobConfig, mesh: Mesh) -> StepPlan | StagePlan:
    """This rank's plan of `cfg`'s step; UserError (exit 2) when its predicted peak exceeds the free memory. A
    layout whose ranks plan apart (pipeline stages) gets this rank's own `StagePlan` (`plan.stage_plan`).

    The message gives predicted vs available, the biggest contributors at the peak, and what would fit: a
    smaller batch (activations scale with it) or another activation-checkpointing mode.
    """
    if planned_apart(mesh.dims.degrees()) is not None:
        return _preflight_stage(cfg, mesh)
    depth = resolve_model_args(cfg).n_layers
    if depth > short_depths(cfg)[-1]:  # deep: the depth-free plan (its graph is not kept)
        mode = cfg.activation_checkpoint.mode
        # A whole-depth fallback is said once, on rank 0 (every rank plans its own step; the others would repeat it).
        say = logger.warning if mesh.rank == 0 else logger.debug
        plan = plan_modes(cfg, mesh, [mode], log_passes=True, on_fallback=say)[mode]
        if isinstance(plan, UserError):
            raise plan
        if plan.blocks_traced != depth:  # a whole trace (blocks not proven identical) traced `depth`, and says why
            short = " + ".join(map(str, short_depths(cfg)))
            logger.info(f"preflight: depth-free plan, models of {short} blocks traced for a model of {depth}")
    else:  # shallow: the whole trace, which the first step reuses
        plan = plan_step(build_job(cfg, mesh, materialize=False), log_passes=True)
    check_budget_held(cfg, plan)
    available = available_bytes(mesh.device)
    if plan.peak_bytes <= available:
        return plan
    raise UserError(_does_not_fit(cfg, mesh, plan, available))


def check_budget_held(cfg: JobConfig, plan: StepPlan) -> None:
    """Refuse a whole-step size budget the planned step exceeds. The memory policy fits the graph it plans and what
    it knows is alive beside it; what runs outside that graph and no choice in it lowers (with gradient
    accumulation: the update graph after the micro-steps, and the eager update after that) is held here.

    Raises:
        ConfigError: the plan's peak is above `activation_checkpoint.memory_budget` (the message gives the peak's
            place and the smallest budget that fits).
    """
    ac = cfg.activation_checkpoint
    budget = parse_memory_budget(ac.memory_budget)
    if ac.mode != "budget" or budget.peak_bytes is None or plan.peak_bytes <= budget.peak_bytes:
        return
    smallest = budget.smallest(plan.peak_bytes, input_bytes=0, no_ac_peak=0)
    raise ConfigError(
        f"activation_checkpoint.memory_budget {ac.memory_budget} is infeasible: the step's plan peaks at "
        f"{plan.peak_bytes / GIB:.4f} GiB at {plan.peak_at}, above it; set "
        f"--activation_checkpoint.memory_budget {smallest} or more, or shard the state (--parallelism.dp_shard)"
    )


def _preflight_stage(cfg: JobConfig, mesh: Mesh) -> StagePlan:
    """This rank's stage plan, made inside the job on fake tensors (`plan_stage`: no peer takes part), said in one
    line; UserError when it does not fit."""
    # Solved by rank 0 for every rank: the same choice everywhere, even where the solver stops at its time limit.
    choice = None
    if cfg.activation_checkpoint.mode == "budget":
        choice = mesh.from_first_rank(lambda: pipeline_budget_choice(cfg, mesh))
    plan, _ = plan_stage(cfg, mesh, stage_position(mesh), choice=choice)
    blocks = f"blocks {plan.blocks[0]}-{plan.blocks[-1]}" if plan.blocks else "no blocks"
    logger.info(
        f"preflight: pipeline position {plan.rank} (stages {', '.join(map(str, plan.stages))}, {blocks}): "
        f"predicted step peak {to_gib(plan.peak_bytes):.3f} GiB at {plan.at}, {plan.in_flight} micro-batches in "
        f"flight (planned in {plan.plan_s:.1f} s)"
    )
    available = available_bytes(mesh.device)
    if plan.peak_bytes <= available:
        return plan
    raise UserError(
        f"pipeline position {plan.rank} ({blocks}) needs about {to_gib(plan.peak_bytes):.2f} GiB but "
        f"{mesh.device.type} has {to_gib(available):.2f} GiB available (at the peak {plan.in_flight} micro-batches "
        f"in flight, optimizer state {to_gib(plan.state_bytes):.2f} GiB); fewer micro-batches in flight "
        "(--parallelism.pp_schedule 1F1B rather than GPipe, or a smaller --training.local_batch_size), "
        "--activation_checkpoint.mode full, or a larger --parallelism.pp would need less; --dry-run prints every "
        "stage's plan"
    )


def _does_not_fit(cfg: JobConfig, mesh: Mesh, plan: StepPlan, available: int) -> str:
    device = mesh.device
    parts = ", ".join(
        f"{cat} {to_gib(n):.2f}" for cat, n in sorted(plan.peak_by_category.items(), key=lambda kv: -kv[1])[:4]
    )
    hints = []
    activations = plan.peak_by_category.get("activation", 0)
    fixed = plan.peak_bytes - activations  # parameters, optimizer state, batch (and gradients made by then)
    if fixed < available:
        if activations:
            batch = int(cfg.training.local_batch_size * (available - fixed) / activations)
            if batch >= 1:
                hints.append(f"--training.local_batch_size {batch}")
        others = [m for m in ("full", "budget") if m != cfg.activation_checkpoint.mode]
        # What-if plans for the hint: a fallback was said by the plan above already.
        for mode, other in plan_modes(cfg, mesh, others, on_fallback=logger.debug).items():
            if isinstance(other, UserError):  # e.g. the default budget is infeasible for this shape
                continue
            if other.peak_bytes <= available:
                about = ", approximate" if other.approximate else ""
                hints.append(
                    f"--activation_checkpoint.mode {mode} (predicted {to_gib(other.peak_bytes):.2f} GiB{about})"
                )
    if hints:
        fix = "; would fit: " + " or ".join(hints)
    else:
        fix = (
            f"; everything but the activations already needs {to_gib(fixed):.2f} GiB, so no batch "
            "size or activation_checkpoint mode fits: use a device with more memory or a smaller model"
        )
    return (
        f"the step needs about {to_gib(plan.peak_bytes):.2f} GiB but {device.type} has "
        f"{to_gib(available):.2f} GiB available (at the peak, GiB: {parts}){fix}; "
        "--dry-run prints the full plan"
    )


__all__ = ["available_bytes", "preflight"]
