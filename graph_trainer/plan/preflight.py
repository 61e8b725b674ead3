"""The preflight: refuse, before anything is allocated, a job whose planned step does not fit the device."""

from __future__ import annotations

import torch

from graph_trainer.builder import Job, build_job
from graph_trainer.distributed.mesh import Mesh
from graph_trainer.errors import UserError
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.units import KIB, to_gib
from graph_trainer.plan.step_plan import StepPlan, plan_step, with_ac_mode


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


def preflight(cfg: JobConfig, mesh: Mesh) -> StepPlan:
    """This rank's plan of `cfg`'s step; UserError (exit 2) when its predicted peak exceeds the free memory.

    The message gives predicted vs available, the biggest contributors at the peak, and what would fit: a
    smaller batch (activations scale with it) or another activation-checkpointing mode.
    """
    job = build_job(cfg, mesh, materialize=False)
    plan = plan_step(job, log_passes=True)
    available = available_bytes(mesh.device)
    if plan.peak_bytes <= available:
        return plan
    raise UserError(_does_not_fit(job, plan, available))


def _does_not_fit(job: Job, plan: StepPlan, available: int) -> str:
    cfg, device = job.cfg, job.device
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
        for mode in ("full", "budget"):
            if mode == cfg.activation_checkpoint.mode:
                continue
            try:
                other = plan_step(job.with_config(with_ac_mode(cfg, mode)))
            except UserError:  # e.g. the default budget is infeasible for this shape
                continue
            if other.peak_bytes <= available:
                hints.append(f"--activation_checkpoint.mode {mode} (predicted {to_gib(other.peak_bytes):.2f} GiB)")
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
