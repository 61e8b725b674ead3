"""The eager step's exact memory, from a run on fake tensors: the baseline a graph plan is compared with."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from graph_trainer.builder import Job, build_job
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.job_config.batching import accumulation_steps
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.memory import ALLOC, FREE, AllocationRecorder, LiveTensorTracker, MemoryEvent
from graph_trainer.optimizer.update_memory import EagerUpdate, adamw_update_events, peak_with_update
from graph_trainer.plan.step_plan import batch_names


@dataclasses.dataclass
class EagerStepPeak:
    """The eager step's memory (forward, loss, backward, clipping; no update), from a run on fake tensors."""

    peak_bytes: int  # the step's peak: parameters, batch, gradients made so far and activations
    end_bytes: int  # alive when the step returns: parameters, batch and gradients
    activation_bytes: int  # at the peak: everything but parameters, buffers, batch and gradients
    events: list[MemoryEvent] | None = None  # when recorded: every allocation and free, in order
    step_events_from: int = 0  # events[:this] are the tensors alive before the step (and the optimizer state)


def materialize_fake(model: nn.Module, device: torch.device) -> None:
    """Give a meta model fake tensors on `device` in place; a tensor shared by modules (tied weights) stays shared."""
    fakes: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for slots, as_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in slots.items():
                if t is None:
                    continue
                if id(t) not in fakes:
                    fake = torch.empty(t.shape, dtype=t.dtype, device=device)
                    fakes[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if as_param else fake
                slots[name] = fakes[id(t)]


class _WaitReturnsItsInput(TorchDispatchMode):
    """`_c10d_functional.wait_tensor` as the real kernel runs it: its output is its input. Its fake kernel returns
    a new tensor instead, which the tracker would count a second time while a collective's result is alive."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]
        return func(*args, **(kwargs or {}))


def eager_step_peak(cfg: JobConfig, device: torch.device) -> EagerStepPeak:
    """Run cfg's eager step (`compile.mode eager`, with its torch.utils.checkpoint policy) on fake tensors.

    The live-tensor tracker counts the fake tensors as the memory they stand for, so this is the eager step's
    exact CPU peak (checked against a real run in tests/plan/test_planner.py) at the cost of a trace, with nothing
    allocated. The AdamW update is left out (torch's update cannot run on fake tensors); its state and scratch
    are the same in both modes (`eager_whole_step_peak` adds them). With `parallelism`, it is rank 0's step on
    the planning mesh (`planning_mesh`, torch's fake process group), as `plan_config` plans it.
    """
    with _planned_job(cfg, device) as job:
        return _fake_step_peak(cfg, job, device)


@dataclasses.dataclass
class EagerWholeStep:
    """The eager step followed by its eager AdamW update: what an eager trainer's step holds at most."""

    step: EagerStepPeak  # forward, loss, backward, clipping (`eager_step_peak`)
    update: EagerUpdate  # the AdamW implementation the eager step runs, its state and scratch
    peak_bytes: int  # the step's peak with the optimizer state alive throughout, or the update's if higher
    peak_in_update: bool
    # With `record_events`: two steps' allocations and frees in order, for `caching_allocator.replay`.
    events: list[MemoryEvent] | None = None


def eager_whole_step_peak(cfg: JobConfig, device: torch.device, record_events: bool = False) -> EagerWholeStep:
    """`eager_step_peak` of cfg's eager step plus its AdamW update, added as a graph plan adds an eager update
    (`optimizer.update_memory.whole_step_peak`): the state alive throughout, the update's scratch on what the step
    leaves alive. The update is the one `compile.mode eager` runs (`builder.Job.eager_update`), so with
    `compile.trace_optimizer = false` it is the graph plan's own, and the two peaks count the same optimizer.

    With `record_events`, `events` is two such steps as an allocator sees them, in order (`repeated_steps`).
    """
    eager_cfg = copy.deepcopy(cfg)
    eager_cfg.compile.mode = "eager"  # the update runs eagerly after the step, whatever the graph would do
    with _planned_job(eager_cfg, device) as job:
        update = job.eager_update()  # before the fake run, which swaps the model's parameters for fakes
        state, scratch = (
            adamw_update_events(job.optimizer, update.implementation, job.device) if record_events else ([], [])
        )
        step = _fake_step_peak(eager_cfg, job, device, state if record_events else None)
    peak, in_update = peak_with_update(step.peak_bytes, step.end_bytes, update)
    events = repeated_steps(step.events, step.step_events_from, scratch) if record_events else None
    return EagerWholeStep(step=step, update=update, peak_bytes=peak, peak_in_update=in_update, events=events)


def repeated_steps(
    recorded: list[MemoryEvent], step_from: int, scratch: list[MemoryEvent], steps: int = 2
) -> list[MemoryEvent]:
    """`steps` training steps as the allocator sees them, from one recorded step.

    `recorded`: the tensors alive before the step (parameters, buffers, batch, the optimizer state), then from
    index `step_from` the step's own events. Each step is followed by the update's `scratch`; then what the step
    left alive (the gradients) is freed, as `zero_grad(set_to_none=True)` does, and the same step runs again on
    the same parameters, state and batch, with the cache the previous step left (the first step of a real run
    differs: torch allocates the optimizer state in its first update).
    """
    step = recorded[step_from:]
    born = {key for kind, key, _ in step if kind == ALLOC}
    left = [key for key in _alive_after(step) if key in born]
    events = list(recorded[:step_from])
    for n in range(steps):
        rename = (lambda key: key) if n == 0 else (lambda key, n=n: (f"step {n + 1}", key) if key in born else key)
        events += [(kind, rename(key), nbytes) for kind, key, nbytes in step]
        events += scratch
        events += [(FREE, rename(key), 0) for key in left] if n < steps - 1 else []
    return events


def _alive_after(events: list[MemoryEvent]) -> list:
    """Keys allocated by `events` and not freed by their end, in allocation order."""
    alive: dict = {}
    for kind, key, _ in events:
        if kind == ALLOC:
            alive[key] = None
        else:
            alive.pop(key, None)
    return list(alive)


@contextlib.contextmanager
def _planned_job(cfg: JobConfig, device: torch.device) -> Iterator[Job]:
    """cfg's job on the meta device for rank 0 of the planning mesh (torch's fake process group), as the dry run
    plans it: the FSDP gathers and the expert all-to-alls are functional collectives, which run on fake tensors."""
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), device) as mesh:
        yield build_job(cfg, mesh, materialize=False)


def _fake_step_peak(
    cfg: JobConfig, job: Any, device: torch.device, state_events: list[MemoryEvent] | None = None
) -> EagerStepPeak:
    """Run `job`'s eager step on fake tensors under the live-tensor tracker. With `state_events` (the optimizer
    state's allocations), also record its events: the tracked tensors', then `state_events`, then the step's."""
    # One step's batch: with gradient accumulation, every micro-batch of it (the step cuts it).
    b, s = cfg.training.local_batch_size * accumulation_steps(cfg), cfg.training.seq_len
    with FakeTensorMode():
        materialize_fake(job.model, device)
        step = job.eager_step(optimizer_update=False)
        batch = {name: torch.zeros(b, s, dtype=torch.long, device=device) for name in batch_names(cfg)}
        model = job.model
        tracker = LiveTensorTracker(count_fake=True) if state_events is None else AllocationRecorder(count_fake=True)
        tracker.track_existing([list(model.parameters()), list(model.buffers()), batch])
        if state_events is not None:
            tracker.events += state_events
        step_from = len(tracker.events) if state_events is not None else 0
        try:
            with tracker, _WaitReturnsItsInput():
                step(batch)
            held = tracker.bytes_at_peak(
                [list(model.parameters()), list(model.buffers()), batch, [p.grad for p in model.parameters()]]
            )
            return EagerStepPeak(
                peak_bytes=tracker.peak_bytes,
                end_bytes=tracker.current_bytes,
                activation_bytes=tracker.peak_bytes - held,
                events=None if state_events is None else tracker.events,
                step_events_from=step_from,
            )
        finally:
            tracker.forget()


__all__ = [
    "EagerStepPeak",
    "EagerWholeStep",
    "eager_step_peak",
    "eager_whole_step_peak",
    "materialize_fake",
    "repeated_steps",
]
