"""`--dry-run`: the plan of one rank's step for every activation-checkpointing mode, printed."""

from __future__ import annotations

from collections.abc import Callable

import torch

from graph_trainer.builder import adamw_implementation_for, build_job, optimizer_in_graph
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.errors import UserError
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.units import to_gib
from graph_trainer.plan.preflight import available_bytes
from graph_trainer.plan.step_plan import AC_MODES, plan_step, with_ac_mode
from graph_trainer.runtime.device import compute_dtype, resolve_device


def dry_run(cfg: JobConfig, *, device: torch.device | None = None, print_fn: Callable[[str], None] = print) -> None:
    """Print, for each AC mode, the predicted peak, saved activations, parameters and FLOPs per step, and with
    parallelisms the bytes each kind of collective moves per step per rank (`StepPlan.comm_bytes`).

    With parallelisms the plan is one rank's, traced on torch's fake process group: `parallelism.dp_shard` = N
    plans one rank of N without launching N processes.
    """
    device = device or resolve_device(cfg.training.device)
    dims = ParallelDims.from_config(cfg.parallelism)
    with planning_mesh(dims, device) as mesh:
        job = build_job(cfg, mesh, materialize=False)
        update = "in the graph" if optimizer_in_graph(cfg) else "eager, " + adamw_implementation_for(cfg, device)
        t = cfg.training
        dtype = str(compute_dtype(t.dtype, device, t.mixed_precision_param)).removeprefix("torch.")
        per_rank = f", one rank of {mesh.world_size} ({job.parallel.describe()}, {' x '.join(dims.used())})"
        print_fn(
            f"dry run: {cfg.model.name}/{cfg.model.flavor}, batch {t.local_batch_size} x "
            f"seq {t.seq_len}, device {device.type}{per_rank if mesh.world_size > 1 else ''}, compute dtype "
            f"{dtype}, fake tensors only (clipping and the AdamW update included: {update})"
        )
        print_fn(
            f"{'ac mode':10} {'peak GiB':>9} {'saved GiB':>10} {'params':>15} {'TFLOP/step':>11} {'plan s':>7}  peak at"
        )
        for mode in AC_MODES:
            try:
                plan = plan_step(job.with_config(with_ac_mode(cfg, mode)))
            except UserError as e:
                print_fn(f"{mode:10} not plannable: {e}")
                continue
            print_fn(
                f"{mode:10} {to_gib(plan.peak_bytes):9.2f} {to_gib(plan.saved_bytes):10.2f} "
                f"{plan.num_params:15,} {plan.flops / 1e12:11.2f} {plan.trace_time_s:7.1f}  {plan.peak_where}"
            )
            if plan.comm_bytes:
                traffic = ", ".join(f"{kind} {to_gib(n):.3g}" for kind, n in plan.comm_bytes.items())
                print_fn(f"{'':10} communicated GiB per step per rank: {traffic}")
    print_fn(f"available on {device.type}: {to_gib(available_bytes(device)):.2f} GiB")


__all__ = ["dry_run"]
