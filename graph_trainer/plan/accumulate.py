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
to the byte (tests/plan/test_plan_search.py: debug model, AC none and full, 3 micro-steps, dp_shard 2
and tp 2 x dp_shard 2; 2 micro-steps as well when written). The bytes are the same, their categories
differ: the plan calls the accumulator's share of a new gradient an activation.
With "step" the micro-step's graph lacks FSDP's reduce-scatters, so the sharded gradients they would have made
before the peak are not there: the plan is an upper bound by at most the rank's parameter bytes, marked
approximate (measured +0% and +4.5% on the debug model, AC none and full). Without FSDP the same buffers
are added and the plan is marked approximate: the gradient reduction and update graph can hold the peak
(dp_replicate 2, debug model, 16 micro-steps: planned 39,253,088 bytes, the run's measured peak 37,415,064).

Per step, FLOPs and every collective run k times, except the gradient norm's all-reduce, replication's all-reduce of the
accumulated gradients (once a step) and, with
`"step"`, FSDP's one reduce-scatter per unit.
"""

from __future__ import annotations

import dataclasses

from graph_trainer.observability.memory import allocated_bytes
from graph_trainer.plan.step_plan import StepPlan

SCALAR_BYTES = 4  # a float32 scalar: the step's valid-token count, or one micro-step's loss
ONCE_PER_STEP = ("fsdp all_reduce", "dp_replicate all_reduce")  # the norm; replication averages accumulated grads


def accumulated(plan: StepPlan, steps: int, grad_sync: str, dp_shard: int, device_type: str = "cpu") -> StepPlan:
    """The plan of a step of `steps` micro-batches whose one micro-batch's plan (no accumulation) is `plan`, on a
    device of `device_type` (CUDA's allocator rounds each scalar up to a block)."""
    if steps == 1:
        return plan
    cats = plan.peak_by_category
    scalar = allocated_bytes(SCALAR_BYTES, device_type)
    extra = {
        "other_inputs": (steps - 1) * cats.get("batch", 0),
        "batch": scalar,
        "output": (steps - 1) * scalar,
        "gradient": cats.get("parameter", 0),
    }
    if grad_sync == "step" and dp_shard > 1:
        extra["buffer"] = dp_shard * cats.get("parameter", 0)
    by_category = {k: cats.get(k, 0) + extra.get(k, 0) for k in {*cats, *extra}}
    return dataclasses.replace(
        plan,
        peak_bytes=plan.peak_bytes + sum(extra.values()),
        peak_by_category={k: v for k, v in by_category.items() if v},
        flops=plan.flops * steps,
        comm_bytes=per_step_comm(plan.comm_bytes, steps, grad_sync),
        step_graph=None,
        # Exact only where tested so: FSDP reducing every micro-batch. Without FSDP the update graph (whole
        # gradients, replication's all-reduce) can hold the peak: measured +4.9% over the run's peak, dp_replicate 2.
        approximate=plan.approximate or grad_sync == "step" or dp_shard == 1,
    )


def per_step_comm(comm: dict[str, int], steps: int, grad_sync: str) -> dict[str, int]:
    """The bytes per '<parallelism> <collective>' of a step of `steps` micro-batches, from one micro-batch's."""
    once = ONCE_PER_STEP + (("fsdp reduce_scatter",) if grad_sync == "step" else ())
    return {k: v if k in once else v * steps for k, v in comm.items()}


__all__ = ["accumulated", "per_step_comm"]
