"""What the AdamW update costs in memory when it runs eagerly after the graph: its state and its scratch.

The traced update's memory is in the graph's own estimate; this is the rest of the step's peak for
`compile.trace_optimizer = false` (and eager mode), modelled exactly for each torch implementation. Also what an
accumulated step holds beside its micro-step graph (`Accumulation`), and its two graphs' estimate together.
"""

from __future__ import annotations

import dataclasses
from itertools import pairwise
from typing import Any

import torch

from graph_trainer.observability.memory import ALLOC, FREE, MemoryEvent, allocated_bytes
from graph_trainer.optimizer.adamw import adamw_implementation


def adamw_state_bytes(optimizer: torch.optim.AdamW, device: torch.device) -> int:
    """Bytes of `optimizer`'s state held in `device`'s memory (as its allocator counts them).

    exp_avg and exp_avg_sq always; the 0-d step counters only where they live on
    that device: on a CPU run, or for fused/capturable groups (elsewhere torch
    keeps them on the host).
    """
    total = 0
    for state in optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and (device.type == "cpu" or t.device.type != "cpu"):
                total += allocated_bytes(t.untyped_storage().nbytes(), device.type)
    return total


def eager_step_scratch_bytes(optimizer: torch.optim.AdamW, device: torch.device | None = None) -> int:
    """Most bytes `torch.optim.AdamW.step()` holds beyond params, grads and state (its temporaries).

    Per parameter group (the temporaries die when torch's update function returns), by the
    update torch runs (torch 2.13's `torch/optim/adam.py`):

    - single_tensor: for parameter i it builds `denom = (exp_avg_sq.sqrt() / c).add_(eps)`, two
      temporaries of p_i's size, while the previous parameter's `denom` is still bound to
      the loop variable; every other op is in place: max_i(size(p_{i-1}) + 2 * size(p_i)).
    - foreach: per (device, dtype) bucket, `_foreach_sqrt(exp_avg_sqs)` makes one temporary
      per parameter, all alive at once, while the previous bucket's list is still bound:
      max_b(size(bucket_{b-1}) + size(bucket_b)); with one bucket, the size of all parameters.
    - fused: every op is in place: 0.

    Measured against `LiveTensorTracker` on CPU for all three (tests/optimizer/test_optimizer.py);
    the CUDA kernels allocate the same tensors. `device` (default: the parameters')
    decides how each temporary is rounded by the allocator (`allocated_bytes`).

    Raises:
        ValueError: for capturable or differentiable groups, whose extra temporaries are not modelled.
    """
    peak = 0
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("differentiable"):
            raise ValueError("eager_step_scratch_bytes does not model capturable or differentiable AdamW")
        params = list(group["params"])
        implementation = adamw_implementation(group)
        if implementation == "fused" or not params:
            continue
        device_type = (device or params[0].device).type
        if implementation == "single_tensor":
            sizes = [allocated_bytes(_nbytes(p), device_type) for p in params]
            peak = max(peak, max((prev + 2 * cur for prev, cur in pairwise([0, *sizes])), default=0))
            continue
        sizes = [sum(allocated_bytes(_nbytes(p), device_type) for p in bucket) for bucket in _foreach_buckets(params)]
        peak = max(peak, max((prev + cur for prev, cur in pairwise([0, *sizes])), default=0))
    return peak


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _foreach_buckets(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters of one group in the (device, dtype) buckets torch's foreach update walks, in its order."""
    buckets: dict[tuple, list[torch.Tensor]] = {}  # insertion order = the order torch groups them in
    for p in params:
        buckets.setdefault((p.device, p.dtype), []).append(p)
    return list(buckets.values())


def adamw_update_events(
    optimizer: torch.optim.AdamW, implementation: str, device: torch.device
) -> tuple[list[MemoryEvent], list[MemoryEvent]]:
    """(the state's allocations, the update's scratch allocations and frees), in the order `optimizer.step()`
    makes them, as `eager_step_scratch_bytes` describes the temporaries: single_tensor keeps parameter i-1's
    denom until parameter i's is built (sqrt, then the division, then the sqrt freed); foreach keeps a bucket's
    sqrt list until the next bucket's is built; fused allocates nothing. The state is what
    `adamw_state_bytes` counts (its storages, as requested; the allocator rounds them).
    """
    state = [
        (ALLOC, ("adamw_state", i), t.untyped_storage().nbytes())
        for i, t in enumerate(
            t
            for entry in optimizer.state.values()
            for t in entry.values()
            if isinstance(t, torch.Tensor) and (device.type == "cpu" or t.device.type != "cpu")
        )
    ]
    scratch: list[MemoryEvent] = []
    for g, group in enumerate(optimizer.param_groups):
        params = list(group["params"])
        if implementation == "single_tensor":
            for i, p in enumerate(params):
                sqrt, denom = ("adamw_sqrt", g, i), ("adamw_denom", g, i)
                scratch += [(ALLOC, sqrt, _nbytes(p)), (ALLOC, denom, _nbytes(p)), (FREE, sqrt, 0)]
                scratch += [(FREE, ("adamw_denom", g, i - 1), 0)] if i else []
            scratch += [(FREE, ("adamw_denom", g, len(params) - 1), 0)] if params else []
        elif implementation == "foreach":
            buckets = _foreach_buckets(params)
            for b, bucket in enumerate(buckets):
                scratch += [(ALLOC, ("adamw_sqrt", g, b, i), _nbytes(p)) for i, p in enumerate(bucket)]
                scratch += [(FREE, ("adamw_sqrt", g, b - 1, i), 0) for i in range(len(buckets[b - 1]))] if b else []
            scratch += (
                [(FREE, ("adamw_sqrt", g, len(buckets) - 1, i), 0) for i in range(len(buckets[-1]))] if buckets else []
            )
    return state, scratch


@dataclasses.dataclass(frozen=True)
class EagerUpdate:
    """`torch.optim.AdamW.step()` run after the graph: its implementation, the state it keeps
    alive through the whole step, and the scratch its update allocates."""

    implementation: str
    state_bytes: int
    scratch_bytes: int

    @classmethod
    def of(cls, optimizer: torch.optim.AdamW, implementation: str, device: torch.device) -> EagerUpdate:
        """The update `optimizer.step()` runs on `device` (its state must exist: `init_adamw_state`)."""
        return cls(implementation, adamw_state_bytes(optimizer, device), eager_step_scratch_bytes(optimizer, device))


def accumulated_estimate(micro: Any, update: Any, *, micro_extra: int, update_extra: int) -> Any:
    """The estimate of an accumulated step (a `MemoryEstimate`): of its micro graph, run once per micro-batch, and
    its update graph, the one whose peak is higher once widened to the bytes alive around it but not among its
    inputs (`micro_extra`, `update_extra`: counted as "other_inputs"). The accumulators are inputs of both.
    The number of micro-batches changes neither graph, so neither changes this estimate but through the batch.
    """
    chosen, extra = max((micro, micro_extra), (update, update_extra), key=lambda e: e[0].peak_bytes + e[1])
    by_category = {**chosen.peak_bytes_by_category, "other_inputs": extra}
    final = {**update.final_bytes_by_category, "other_inputs": update_extra}
    return dataclasses.replace(
        chosen,
        peak_bytes=chosen.peak_bytes + extra,
        peak_bytes_by_category=by_category,
        final_bytes_by_category=final,
        saved_bytes=micro.saved_bytes,
    )


def whole_step_peak(estimate: Any, update: EagerUpdate | None) -> tuple[int, dict[str, int], bool]:
    """(peak bytes, bytes by category at the peak, whether the peak is in the eager update) of a step.

    `estimate` is the graph's `MemoryEstimate` (`graph_trainer.tracer.memory_estimate`);
    with `update` None the update is in the graph. Otherwise the optimizer state
    is alive throughout, and the update runs after the graph on what the graph
    leaves alive (params, batch, grads) plus its scratch.
    """
    if update is None:
        return estimate.peak_bytes, dict(estimate.peak_bytes_by_category), False
    peak, in_update = peak_with_update(estimate.peak_bytes, sum(estimate.final_bytes_by_category.values()), update)
    if in_update:
        by_category = {**estimate.final_bytes_by_category, "optimizer_scratch": update.scratch_bytes}
    else:
        by_category = dict(estimate.peak_bytes_by_category)
    by_category["optimizer_state"] = by_category.get("optimizer_state", 0) + update.state_bytes
    return peak, by_category, in_update


def peak_with_update(step_peak: int, step_end: int, update: EagerUpdate) -> tuple[int, bool]:
    """(peak bytes, whether the peak is in the update) of a step (graph or eager) whose peak without the optimizer
    state is `step_peak` and which leaves `step_end` bytes alive (params, batch, grads), followed by `update`.

    The optimizer state is alive throughout; the update runs on what the step leaves alive plus its scratch.
    """
    after_step = step_end + update.scratch_bytes
    return max(step_peak, after_step) + update.state_bytes, after_step > step_peak


LOSS_BYTES = 4  # one micro-step's loss, a float32 scalar


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """A step of `steps` micro-batches (`training.global_batch_size`): the micro-step graph runs once per
    micro-batch, and beside it, none of its inputs, are alive the other micro-batches of the step's batch, the
    losses of the micro-steps already run (one float32 scalar each, kept for the step's sum) and, with the update
    traced (`traced_state_bytes`), the optimizer state its update graph reads once after them
    (`tracer.executor.GraphStep.step_estimate` counts the same)."""

    steps: int
    traced_state_bytes: int = 0

    def held(self, gm: Any, input_categories: list[str]) -> int:
        """Bytes alive beside one micro-step of graph `gm` (its inputs in `input_categories`)."""
        inputs = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
        # A micro-batch's tensors are views of the step's batch; the token count (0-d) is one tensor for all.
        batch = [t for t, c in zip(inputs, input_categories, strict=True) if c == "batch" and t.dim() > 0]
        device = batch[0].device.type if batch else "cpu"
        others = (self.steps - 1) * sum(t.numel() * t.element_size() for t in batch)
        return others + (self.steps - 1) * allocated_bytes(LOSS_BYTES, device) + self.traced_state_bytes
