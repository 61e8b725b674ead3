"""The traced step's allocations and frees in order, as a caching allocator sees them (`caching_allocator.replay`).

The eager step's stream comes from a run on fake tensors (`eager_baseline.eager_whole_step_peak` with
`record_events`); the traced step's comes from its graph (`tracer.memory_estimate.allocation_events`), which
needs the whole graph: a full-depth trace, not the depth-free plan (which extends counts, not sequences).
"""

from __future__ import annotations

import torch

from graph_trainer.builder import build_job
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.memory import MemoryEvent
from graph_trainer.optimizer.update_memory import adamw_update_events
from graph_trainer.plan.eager_baseline import repeated_steps
from graph_trainer.plan.step_plan import StepPlan, plan_step
from graph_trainer.tracer.memory_estimate import allocation_events


def graph_step_stream(cfg: JobConfig, device: torch.device, steps: int = 2) -> tuple[StepPlan, list[MemoryEvent]]:
    """(the full-depth plan of cfg's traced step for rank 0 of the planning mesh, `steps` such steps' events).

    The graph's inputs (parameters, buffers, batch) come first, then the optimizer state when the update runs
    eagerly after the graph (alive throughout, as `whole_step_peak` counts it), then the graph's own events and
    the update's scratch, repeated as `eager_baseline.repeated_steps` repeats the eager step.
    """
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), device) as mesh:
        job = build_job(cfg, mesh, materialize=False)
        plan = plan_step(job)
        update = job.eager_update()
        state, scratch = adamw_update_events(job.optimizer, update.implementation, job.device) if update else ([], [])
    events, inputs = allocation_events(plan.step_graph.traced.gm)
    recorded = [*events[:inputs], *state, *events[inputs:]]
    return plan, repeated_steps(recorded, inputs + len(state), scratch, steps)


__all__ = ["graph_step_stream"]
