"""Predicting one step's memory and FLOPs before anything is allocated.

The job is built on the meta device (`build_job(..., materialize=False)`), and its step (forward, loss,
backward, clipping and, with `compile.trace_optimizer`, the AdamW update) is traced on fake tensors for the
target device and run through the same pass pipeline the trainer uses: the static estimate of the final
graph is the prediction. When the update runs outside the graph (the default), the plan adds what it costs:
the optimizer state alive throughout, and after the graph the scratch of the AdamW implementation the run
will use (`EagerUpdate`). Nothing the size of a parameter is ever allocated, so an 8B plan fits in a laptop's
memory. With parallelisms, the plan is one rank's (`graph_trainer.distributed.mesh.planning_mesh`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from typing import Any

import torch

from graph_trainer.builder import Job, adamw_implementation_for, build_job, optimizer_in_graph
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.log import quiet
from graph_trainer.optimizer.update_memory import EagerUpdate, whole_step_peak
from graph_trainer.passes.communication import communication_bytes
from graph_trainer.passes.graph_utils import node_flops
from graph_trainer.runtime.device import resolve_device
from graph_trainer.tracer.executor import Transformed

AC_MODES = ("none", "selective", "full", "budget")


@dataclasses.dataclass
class StepPlan:
    """The predicted cost of one training step under one activation-checkpointing mode."""

    ac_mode: str
    peak_bytes: int
    saved_bytes: int
    peak_by_category: dict[str, int]
    peak_where: str
    flops: int
    num_params: int
    trace_time_s: float
    optimizer: str = "in graph"  # where the AdamW update runs: "in graph" or its eager implementation
    # Bytes this rank's collectives move per step, by '<parallelism> <collective>' (passes/communication.py).
    comm_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # The planned step's final graph (`graph_trainer.tracer.Transformed`), for the trainer's first step to reuse.
    step_graph: Any = dataclasses.field(default=None, repr=False, compare=False)


def with_ac_mode(cfg: JobConfig, mode: str) -> JobConfig:
    """`cfg` with another `activation_checkpoint.mode` (a copy)."""
    other = copy.deepcopy(cfg)
    other.activation_checkpoint.mode = mode
    return other


def _meta_batch(cfg: JobConfig) -> dict[str, torch.Tensor]:
    b, s = cfg.training.local_batch_size, cfg.training.seq_len
    return {name: torch.empty(b, s, dtype=torch.long, device="meta") for name in ("input", "labels")}


def plan_step(job: Job, *, log_passes: bool = False) -> StepPlan:
    """Trace `job`'s step (its model on the meta device) for its device with its AC mode, apply the pipeline,
    and read the estimate. `log_passes`: log the pipeline's pass timings (the preflight of the step that runs).
    """
    cfg, device = job.cfg, job.device
    in_graph = optimizer_in_graph(cfg)
    step = job.graph_step(compile_stage=False)  # also validates the passes before the (long) trace
    start = time.perf_counter()
    with contextlib.nullcontext() if log_passes else quiet():  # other modes' plans would only add noise
        step.ensure_traced(_meta_batch(cfg))
    elapsed = time.perf_counter() - start
    traced, est = step.traced, step.memory_estimate
    # The trace is of a batch on the meta device; the step's batches live on `device`.
    traced.signature = tuple((path, shape, dtype, device.type) for path, shape, dtype, _ in traced.signature)
    if cfg.compile.backend == "inductor":  # the compiled step's bound (compiler.inductor.InductorStage)
        from graph_trainer.compiler.inductor import functional_gather_bytes

        est = dataclasses.replace(est, peak_bytes=est.peak_bytes + functional_gather_bytes(traced.gm))
    implementation = adamw_implementation_for(cfg, device)
    update = None if in_graph else EagerUpdate.of(job.optimizer, implementation, device)
    peak, by_category, in_update = whole_step_peak(est, update)
    if in_update:
        where = f"the eager AdamW update ({implementation})"
    else:
        where = f"{est.peak_node} ({est.peak_op})" + (f" in {est.peak_module_fqn}" if est.peak_module_fqn else "")
    return StepPlan(
        ac_mode=cfg.activation_checkpoint.mode,
        peak_bytes=peak,
        saved_bytes=est.saved_bytes,
        peak_by_category=by_category,
        peak_where=where,
        flops=sum(node_flops(n) for n in traced.gm.graph.nodes),
        num_params=job.num_params(),
        trace_time_s=elapsed,
        optimizer="in graph" if in_graph else implementation,
        comm_bytes=communication_bytes(traced.gm),
        step_graph=Transformed(traced, step.memory_estimate),
    )


def plan_config(cfg: JobConfig, device: torch.device | None = None) -> StepPlan:
    """Plan `cfg`'s step for one rank on `device` (default: the config's), building its job on the meta device."""
    device = device or resolve_device(cfg.training.device)
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), device) as mesh:
        return plan_step(build_job(cfg, mesh, materialize=False))


__all__ = ["AC_MODES", "StepPlan", "plan_config", "plan_step", "with_ac_mode"]
