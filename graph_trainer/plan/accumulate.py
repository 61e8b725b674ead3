"""The accumulating step's plan from its micro-step's plan, so the planner's cost does not grow with the
number of micro-steps (DECISIONS.md) nor fall back to a whole-depth trace (the depth-free plan reads one
whole-step graph; an accumulating step is a micro-step graph run k times, then the update).

A step of k micro-batches of `local_batch` sequences runs the graph of one micro-batch k times. What it holds on
top of that graph's own peak is alive from before the first micro-step to after the last, so it adds to every
point of the graph and leaves the peak where it was:
- the other k-1 micro-batches of the step's batch (the loader hands the step its whole batch);
- the step's valid-token count, one float32 scalar every micro-step's loss divides by;
- the losses of the micro-steps already run, one float32 scalar each, kept for the step's sum (`step.sum_losses`):
  k-1 of them during the last micro-step, where the peak therefore is;
- the gradient accumulator: the sharded gradients, one per parameter shard (the bytes of the parameters the
  rank holds: gradients take the parameters' dtype);
- with `parallelism.fsdp_grad_sync = "step"`, each FSDP unit's whole gradient sum as well (dp_shard times the
  shards, `distributed.fsdp.FSDP.defer_grad_sync`).
With "micro_batch" the micro-step's graph is the planned one, and the peak equals the whole accumulating plan's
to the byte (tests/layouts/test_search.py: debug model, AC none and full, 3 micro-steps, dp_shard 2
and tp 2 x dp_shard 2; 2 micro-steps as well when written). The bytes are the same, their categories
differ: the plan calls the accumulator's share of a new gradient an activation.
With "step" the micro-step's graph lacks FSDP's reduce-scatters, so the sharded gradients they would have made
before the peak are not there: the plan is an upper bound by at most the rank's parameter bytes, marked
approximate (measured +0% and +4.5% on the debug model, AC none and full). Without FSDP the same buffers
are added and the plan is marked approximate: the gradient reduction and update graph can hold the peak
(dp_replicate 2, debug model, 16 micro-steps: planned 39,253,088 bytes, the run's measured peak 37,415,064).

Per step, FLOPs run k times and so does every collective, except those a parallelism runs once a step (its
`Parallelism.across_micro_steps`: the gradient norm's all-reduce, replication's all-reduce of the accumulated
gradients and, with `"step"`, FSDP's one reduce-scatter per unit); what each parallelism holds across the
micro-steps, and whether the result is exact, come from the same place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from graph_trainer.distributed.parallelize import PARALLELISMS
from graph_trainer.observability.memory import allocated_bytes
from graph_trainer.plan.step_plan import StepPlan

SCALAR_BYTES = 4  # a float32 scalar: the step's valid-token count, or one micro-step's loss


def accumulated(
    plan: StepPlan, steps: int, options: Mapping[str, Any], degrees: Mapping[str, int], device_type: str = "cpu"
) -> StepPlan:
    """The plan of a step of `steps` micro-batches whose one micro-batch's plan (no accumulation) is `plan`, in a
    layout of `degrees` (the mesh's, and carved ones) with the [parallelism] `options` the step sets (e.g.
    `{"fsdp_grad_sync": "step"}`; those left out at their defaults), on a device of `device_type` (CUDA's
    allocator rounds each scalar up to a block)."""
    if steps == 1:
        return plan
    cats = plan.peak_by_category
    parts = [p.across_micro_steps(degrees, options, cats.get("parameter", 0)) for p in PARALLELISMS]
    scalar = allocated_bytes(SCALAR_BYTES, device_type)
    extra = {
        "other_inputs": (steps - 1) * cats.get("batch", 0),
        "batch": scalar,
        "output": (steps - 1) * scalar,
        "gradient": cats.get("parameter", 0),
        "buffer": sum(part.held for part in parts),
    }
    by_category = {k: cats.get(k, 0) + extra.get(k, 0) for k in {*cats, *extra}}
    once = {name for part in parts for name in part.once_per_step}
    return dataclasses.replace(
        plan,
        peak_bytes=plan.peak_bytes + sum(extra.values()),
        peak_by_category={k: v for k, v in by_category.items() if v},
        flops=plan.flops * steps,
        comm_bytes={k: v if k in once else v * steps for k, v in plan.comm_bytes.items()},
        step_graph=None,
        # Exact only where tested so (FSDP reducing every micro-batch). Without sharded gradients the update graph
        # (whole gradients, replication's all-reduce) can hold the peak: measured +4.9% over the run's peak,
        # dp_replicate 2.
        approximate=plan.approximate
        or not any(part.exact for part in parts)
        or any(part.exact is False for part in parts),
    )


__all__ = ["accumulated"]
