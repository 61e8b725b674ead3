"""Predicting a step's memory and FLOPs before anything is allocated: the preflight and `--dry-run`.

The model is built on the meta device and the whole step (forward, loss,
backward, clipping and, with `compile.trace_optimizer`, the AdamW update) is
traced on fake tensors for the target device, then run through the same pass
pipeline the trainer uses; the static estimate of the final graph is the
prediction. When the update runs outside the graph (the default), the plan adds
what it costs: the optimizer state alive throughout, and after the graph the
scratch of the AdamW implementation the run will use (`EagerUpdate`). Nothing the
size of a parameter is ever allocated, so an 8B plan fits in a laptop's memory.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from graph_trainer.builder import (
    adamw_implementation_for,
    autocast_loss,
    build_job_optimizer,
    build_model,
    optimizer_in_graph,
    shard_model,
)
from graph_trainer.distributed.fsdp import FSDP, ShardGroup, check_gathered
from graph_trainer.eager.checkpointing import apply_eager_checkpointing
from graph_trainer.eager.step import EagerStep
from graph_trainer.errors import UserError
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.log import quiet
from graph_trainer.observability.memory import LiveTensorTracker
from graph_trainer.observability.units import KIB, to_gib
from graph_trainer.optimizer.adamw import EagerUpdate, GraphAdamW, whole_step_peak
from graph_trainer.passes import build_pipeline
from graph_trainer.passes.graph_utils import node_flops
from graph_trainer.runtime.device import compute_dtype, resolve_device, resolve_dtype
from graph_trainer.tracer.capture import trace_step
from models.llama3.model import num_params

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
    # The planned step's final graph (`graph_trainer.tracer.Transformed`), for the trainer's first step to reuse.
    step_graph: Any = dataclasses.field(default=None, repr=False, compare=False)


def meta_model(cfg: JobConfig) -> nn.Module:
    """The configured model on the meta device: shapes only, no memory."""
    return build_model(cfg, None)


def plan_step(
    cfg: JobConfig,
    model: nn.Module,
    device: torch.device,
    *,
    loss_fn: Callable | None = None,
    log_passes: bool = False,
    fsdp: FSDP | None = None,
) -> StepPlan:
    """Trace `model` (meta) for `device` with cfg's AC mode, apply the pipeline, and read the estimate.

    With `fsdp` (the model sharded by `fully_shard_model`) the plan is one rank's.

    `log_passes`: log the pipeline's pass timings and estimate (the preflight of the step that runs).
    """
    b, s = cfg.training.local_batch_size, cfg.training.seq_len
    batch = {
        "input": torch.empty(b, s, dtype=torch.long, device="meta"),
        "labels": torch.empty(b, s, dtype=torch.long, device="meta"),
    }
    in_graph = optimizer_in_graph(cfg)
    implementation = adamw_implementation_for(cfg, device)
    torch_optimizer = build_job_optimizer(cfg, model, device)  # the trainer's, state included
    if loss_fn is None:  # the trainer's loss: chunked as configured, under autocast when training.dtype asks
        t = cfg.training
        loss_fn = autocast_loss(resolve_dtype(t.dtype, device, t.mixed_precision_param), device, t.loss_chunk_size)
    if fsdp is not None:
        loss_fn = fsdp.wrap_loss(loss_fn)
    pipeline = build_pipeline(cfg, dump_dir=None)  # validates the passes before the (long) trace
    start = time.perf_counter()
    traced = trace_step(
        model,
        batch,
        max_norm=cfg.training.max_norm,
        loss_fn=loss_fn,
        optimizer=GraphAdamW(torch_optimizer) if in_graph else None,
        device=device,
        norm_reduce=fsdp.norm_reduce if fsdp is not None else None,
    )
    if fsdp is not None:
        traced = check_gathered(traced)
    # The trace is of a batch on the meta device; the step's batches live on `device`.
    traced.signature = tuple((path, shape, dtype, device.type) for path, shape, dtype, _ in traced.signature)
    with contextlib.nullcontext() if log_passes else quiet():  # other modes' plans would only add noise
        result = pipeline(traced)
    elapsed = time.perf_counter() - start
    est = result.memory_estimate
    if cfg.compile.backend == "inductor":  # the compiled step's bound (tracer.compiled.InductorStage)
        from graph_trainer.compiler.inductor import functional_gather_bytes

        est = dataclasses.replace(est, peak_bytes=est.peak_bytes + functional_gather_bytes(result.traced.gm))
    update = None if in_graph else EagerUpdate.of(torch_optimizer, implementation, device)
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
        flops=sum(node_flops(n) for n in result.traced.gm.graph.nodes),
        num_params=fsdp.num_params() if fsdp is not None else num_params(model),
        trace_time_s=elapsed,
        optimizer="in graph" if in_graph else implementation,
        step_graph=result,
    )


@dataclasses.dataclass
class EagerStepPeak:
    """The eager step's memory (forward, loss, backward, clipping; no update), from a run on fake tensors."""

    peak_bytes: int  # the step's peak: parameters, batch, gradients made so far and activations
    end_bytes: int  # alive when the step returns: parameters, batch and gradients
    activation_bytes: int  # at the peak: everything but parameters, buffers, batch and gradients


def _materialize_fake(model: nn.Module, device: torch.device) -> None:
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


def eager_step_peak(cfg: JobConfig, device: torch.device) -> EagerStepPeak:
    """Run cfg's eager step (`compile.mode eager`, with its torch.utils.checkpoint policy) on fake tensors.

    The baseline a graph plan is compared with: the live-tensor tracker counts the
    fake tensors as the memory they stand for, so this is the eager step's exact
    CPU peak (checked against a real run in tests/test_planner.py) at the cost of
    a trace, with nothing allocated. The AdamW update is left out (torch's update
    cannot run on fake tensors); its state and scratch are the same in both modes.
    It is one process's step: `parallelism` (FSDP's gathers) is not modelled.
    """
    b, s = cfg.training.local_batch_size, cfg.training.seq_len
    loss_fn = autocast_loss(resolve_dtype(cfg.training.dtype, device), device, cfg.training.loss_chunk_size)
    model = meta_model(cfg)
    with FakeTensorMode():
        _materialize_fake(model, device)
        apply_eager_checkpointing(model, cfg.activation_checkpoint)
        batch = {
            "input": torch.zeros(b, s, dtype=torch.long, device=device),
            "labels": torch.zeros(b, s, dtype=torch.long, device=device),
        }
        step = EagerStep(model, loss_fn=loss_fn, max_norm=cfg.training.max_norm)
        tracker = LiveTensorTracker(count_fake=True)
        tracker.track_existing([list(model.parameters()), list(model.buffers()), batch])
        try:
            with tracker:
                step(batch)
            held = tracker.bytes_at_peak(
                [list(model.parameters()), list(model.buffers()), batch, [p.grad for p in model.parameters()]]
            )
            return EagerStepPeak(
                peak_bytes=tracker.peak_bytes,
                end_bytes=tracker.current_bytes,
                activation_bytes=tracker.peak_bytes - held,
            )
        finally:
            tracker.forget()


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


def _with_mode(cfg: JobConfig, mode: str) -> JobConfig:
    other = copy.deepcopy(cfg)
    other.activation_checkpoint.mode = mode
    return other


def preflight(
    cfg: JobConfig, device: torch.device, *, loss_fn: Callable | None = None, shard_group: ShardGroup | None = None
) -> StepPlan:
    """Refuse (UserError, exit 2) a job whose predicted step peak exceeds the device's free memory.

    With `shard_group` (FSDP) the plan is this rank's.

    The message gives predicted vs available, the biggest contributors at the
    peak, and what would fit: a smaller batch (activations scale with it) or
    another activation-checkpointing mode.
    """
    model = meta_model(cfg)
    fsdp = shard_model(cfg, model, shard_group)
    plan = plan_step(cfg, model, device, loss_fn=loss_fn, log_passes=True, fsdp=fsdp)
    available = available_bytes(device)
    if plan.peak_bytes <= available:
        return plan
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
                other = plan_step(_with_mode(cfg, mode), model, device, loss_fn=loss_fn, fsdp=fsdp)
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
    raise UserError(
        f"the step needs about {to_gib(plan.peak_bytes):.2f} GiB but {device.type} has "
        f"{to_gib(available):.2f} GiB available (at the peak, GiB: {parts}){fix}; "
        "--dry-run prints the full plan"
    )


def dry_run(cfg: JobConfig, *, device: torch.device | None = None, print_fn: Callable[[str], None] = print) -> None:
    """Print, for each AC mode, the predicted peak, saved activations, parameters and FLOPs per step.

    With `parallelism.dp_shard` = N the plan is one rank's of N (FSDP), traced on a fake process group.
    """
    from graph_trainer.distributed.launch import planning_shard_group

    device = device or resolve_device(cfg.training.device)
    with planning_shard_group(cfg) as group:
        model = meta_model(cfg)
        fsdp = shard_model(cfg, model, group)
        in_graph = optimizer_in_graph(cfg)
        update = "in the graph" if in_graph else "eager, " + adamw_implementation_for(cfg, device)
        t = cfg.training
        dtype = str(compute_dtype(t.dtype, device, t.mixed_precision_param)).removeprefix("torch.")
        per_rank = f", one rank of {group.world_size} (FSDP, dp_shard)" if group is not None else ""
        print_fn(
            f"dry run: {cfg.model.name}/{cfg.model.flavor}, batch {t.local_batch_size} x "
            f"seq {t.seq_len}, device {device.type}{per_rank}, compute dtype {dtype}, fake tensors only "
            f"(clipping and the AdamW update included: {update})"
        )
        print_fn(
            f"{'ac mode':10} {'peak GiB':>9} {'saved GiB':>10} {'params':>15} {'TFLOP/step':>11} {'plan s':>7}  peak at"
        )
        for mode in AC_MODES:
            try:
                plan = plan_step(_with_mode(cfg, mode), model, device, fsdp=fsdp)
            except UserError as e:
                print_fn(f"{mode:10} not plannable: {e}")
                continue
            print_fn(
                f"{mode:10} {to_gib(plan.peak_bytes):9.2f} {to_gib(plan.saved_bytes):10.2f} "
                f"{plan.num_params:15,} {plan.flops / 1e12:11.2f} {plan.trace_time_s:7.1f}  {plan.peak_where}"
            )
    print_fn(f"available on {device.type}: {to_gib(available_bytes(device)):.2f} GiB")
