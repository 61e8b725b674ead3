"""Optimizer, learning-rate schedule and gradient clipping.

Eager mode uses `torch.optim.AdamW` as is. With `compile.trace_optimizer` the
same update is traced into the step graph by `GraphAdamW`, which keeps its
state inside the live `torch.optim.AdamW` (so checkpoints and the LR scheduler
do not care which mode ran) and reproduces its single-tensor update bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from graph_trainer.errors import ConfigError
from graph_trainer.observability.memory import allocated_bytes

# How torch.optim.AdamW runs its update when it runs outside the graph (eager mode, or the
# traced step without compile.trace_optimizer). Each allocates different scratch on top of
# params, grads and state, which `eager_step_scratch_bytes` models exactly:
#   single_tensor  a Python loop over parameters (torch's choice on CPU; GraphAdamW mirrors it)
#   foreach        torch's default on CUDA: one multi-tensor kernel per op, with a temporary the
#                  size of *all* parameters (`_foreach_sqrt`); this is what OOMed the 8B run
#   fused          one kernel per step, in place, no scratch
ADAMW_IMPLEMENTATIONS = ("single_tensor", "foreach", "fused")


def choose_adamw_implementation(requested: str, device: torch.device, *, trace_optimizer: bool) -> str:
    """The AdamW implementation for a job: `requested` ("auto" or one of ADAMW_IMPLEMENTATIONS).

    "auto" is `fused` on CUDA (no scratch memory and the fastest update) and
    `single_tensor` on CPU (torch's own choice there, bitwise equal to the update
    traced into the graph). With `trace_optimizer` the update runs in the graph as
    the single-tensor algorithm; the torch optimizer only holds the state.

    Raises:
        ConfigError: an implementation other than single_tensor with trace_optimizer.
    """
    if trace_optimizer:
        if requested not in ("auto", "single_tensor"):
            raise ConfigError(
                f"optimizer.implementation = {requested!r} cannot run inside the graph: "
                "compile.trace_optimizer traces the single-tensor AdamW update; set "
                "optimizer.implementation = 'auto' or compile.trace_optimizer = false"
            )
        return "single_tensor"
    if requested == "auto":
        return "fused" if device.type == "cuda" else "single_tensor"
    if requested not in ADAMW_IMPLEMENTATIONS:
        raise ConfigError(f"optimizer.implementation must be auto|{'|'.join(ADAMW_IMPLEMENTATIONS)}, got {requested!r}")
    return requested


def _implementation_flags(implementation: str) -> dict[str, bool]:
    return {
        "single_tensor": {"foreach": False, "fused": False},
        "foreach": {"foreach": True, "fused": False},
        "fused": {"foreach": False, "fused": True},
    }[implementation]


def build_optimizer(
    model: nn.Module,
    *,
    name: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    implementation: str = "single_tensor",
) -> torch.optim.AdamW:
    """AdamW over every trainable parameter (one group, decoupled weight decay).

    `implementation` (see ADAMW_IMPLEMENTATIONS) is passed to torch explicitly, so
    the update that runs is the one whose memory the planner models.
    """
    if name.lower() != "adamw":
        raise ConfigError(f"optimizer.name: only 'AdamW' is supported, got {name!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **_implementation_flags(implementation)
    )


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the base LR for optimizer step `step` (0-based): linear warmup, then decay."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay_type == "none":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ConfigError(f"lr_scheduler.decay_type: expected linear|cosine|none, got {decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_factor: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `lr_factor`; step it once after every optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step, warmup_steps=warmup_steps, total_steps=total_steps, decay_type=decay_type, min_lr_factor=min_lr_factor
        ),
    )


def resync_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set each group's lr from this run's schedule at the scheduler's position.

    Needed after loading a checkpoint: the saved lr came from the saved run's
    schedule, and a resumed run may have a different `training.steps` horizon.
    """
    for group, base_lr, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def init_adamw_state(optimizer: torch.optim.AdamW, p: torch.Tensor) -> dict:
    """`p`'s AdamW state, created as torch.optim.AdamW would lazily create it on its first step.

    Creating it up front keeps the first step's memory like every later one, so the
    preflight's prediction (which counts optimizer state) holds from step 1. As in
    torch, the step counter lives on the CPU, except for fused/capturable groups,
    whose kernels read it on the parameter's device (in float32).
    """
    state = optimizer.state[p]
    if not state:
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        if group.get("fused") or group.get("capturable"):
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        else:
            step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state["step"] = torch.tensor(0.0, dtype=step_dtype)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def adamw_implementation(group: dict) -> str:
    """Which update `optimizer.step()` runs for `group`: fused, foreach or single_tensor.

    Reads the group's flags; an unset `foreach` (None) is resolved as torch does
    (foreach when every parameter is a plain CUDA tensor).
    """
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:
        from torch.optim.optimizer import _default_to_fused_or_foreach  # private: what step() itself calls

        _, foreach = _default_to_fused_or_foreach(list(group["params"]), differentiable=False, use_fused=False)
    return "foreach" if foreach else "single_tensor"


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

    Measured against `LiveTensorTracker` on CPU for all three (tests/test_optimizer.py);
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
            sizes = [allocated_bytes(p.numel() * p.element_size(), device_type) for p in params]
            peak = max(peak, max((prev + 2 * cur for prev, cur in zip([0, *sizes], sizes)), default=0))
            continue
        buckets: dict[tuple, int] = {}  # insertion order = the order torch groups them in
        for p in params:
            key = (p.device, p.dtype)
            buckets[key] = buckets.get(key, 0) + allocated_bytes(p.numel() * p.element_size(), device_type)
        sizes = list(buckets.values())
        peak = max(peak, max((prev + cur for prev, cur in zip([0, *sizes], sizes)), default=0))
    return peak


def clip_grads_(
    grads: list[torch.Tensor], max_norm: float, norm_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """Scale `grads` in place so their global L2 norm is at most `max_norm`; returns the norm before clipping.

    With sharded gradients, `norm_reduce` maps this rank's squared norm to the
    global one (the sum over ranks), so every rank clips by the same factor.

    The eager step and the traced step both call this very function, so the two
    run the same ops in the same order (torch's `clip_grad_norm_` would pick a
    foreach kernel for real tensors but not for fake ones).
    """
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    total_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    if norm_reduce is not None:
        total_norm = torch.sqrt(norm_reduce(total_norm * total_norm))
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
    return total_norm


class GraphAdamW:
    """The update of a live `torch.optim.AdamW`, in a form that traces into the step graph.

    Graph inputs per parameter: (step, exp_avg, exp_avg_sq), mutated in place.
    Per-step host scalars (learning-rate and bias-correction terms, which torch
    computes in Python doubles from the step count) enter as 0-d float64 tensors,
    so one trace serves every step. The op sequence mirrors torch's
    single-tensor AdamW; `addcdiv_(value=...)` is written as mul/div/add_
    because its scalar cannot be a tensor, which rounds identically in fp32.
    """

    def __init__(self, optimizer: torch.optim.AdamW):
        if not isinstance(optimizer, torch.optim.AdamW):
            raise ConfigError(
                "compile.trace_optimizer supports torch.optim.AdamW only; set compile.trace_optimizer = false"
            )
        for group in optimizer.param_groups:
            for key in ("amsgrad", "maximize", "capturable", "differentiable", "fused"):
                if group.get(key):
                    raise ConfigError(
                        f"compile.trace_optimizer cannot trace AdamW({key}=True); set compile.trace_optimizer = false"
                    )
            if isinstance(group["lr"], torch.Tensor):
                raise ConfigError("compile.trace_optimizer needs a float learning rate, got a tensor")
        self.optimizer = optimizer
        # Graph-input order: the optimizer's own parameter order, which the tracer checks
        # against the model's.
        self.params = [p for group in optimizer.param_groups for p in group["params"]]

    @property
    def _groups(self) -> list[dict]:
        # Read afresh: Optimizer.load_state_dict (a resume) replaces the group dicts, and the
        # scheduler then sets the lr in the new ones; kept references would read a stale lr.
        return [group for group in self.optimizer.param_groups for _ in group["params"]]

    def _state(self, p: torch.Tensor) -> dict:
        return init_adamw_state(self.optimizer, p)

    def state_tensors(self) -> list[torch.Tensor]:
        """Flat optimizer state, (step, exp_avg, exp_avg_sq) per parameter (created on first use).

        Gathered afresh each step: loading a checkpoint replaces these tensors.
        """
        out = []
        for p in self.params:
            s = self._state(p)
            out += [s["step"], s["exp_avg"], s["exp_avg_sq"]]
        return out

    def host_scalars(self) -> list[torch.Tensor]:
        """0-d float64 tensors for the coming step: per parameter (decay factor, sqrt of bias correction 2,
        -step size)."""
        out = []
        for p, group in zip(self.params, self._groups):
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            step = self._state(p)["step"].item() + 1
            bias_correction1 = 1 - beta1**step
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            values = (1 - lr * wd, bias_correction2_sqrt, -(lr / bias_correction1))
            # torch.full, not torch.tensor: it dispatches, so the CPU memory tracker sees it.
            out += [torch.full((), v, dtype=torch.float64) for v in values]
        return out

    def update_(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        state: list[torch.Tensor],
        scalars: list[torch.Tensor],
    ) -> None:
        """The traced AdamW update, in place; constants (betas, eps) are baked into the graph."""
        for i, (p, g, group) in enumerate(zip(params, grads, self._groups)):
            beta1, beta2 = group["betas"]
            step_t, exp_avg, exp_avg_sq = state[3 * i : 3 * i + 3]
            decay, bias_correction2_sqrt, neg_step_size = scalars[3 * i : 3 * i + 3]
            step_t.add_(1)
            if group["weight_decay"] != 0:
                p.mul_(decay)
            exp_avg.lerp_(g, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
            p.add_(exp_avg.mul(neg_step_size).div(denom))

    def after_step(self) -> None:
        """Tell the LR scheduler an update happened (it watches `optimizer.step`, which the graph bypasses)."""
        self.optimizer._opt_called = True  # the flag torch's LRScheduler reads


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


def whole_step_peak(estimate: Any, update: EagerUpdate | None) -> tuple[int, dict[str, int], bool]:
    """(peak bytes, bytes by category at the peak, whether the peak is in the eager update) of a step.

    `estimate` is the graph's `MemoryEstimate` (`graph_trainer.passes.memory_estimate`);
    with `update` None the update is in the graph. Otherwise the optimizer state
    is alive throughout, and the update runs after the graph on what the graph
    leaves alive (params, batch, grads) plus its scratch.
    """
    if update is None:
        return estimate.peak_bytes, dict(estimate.peak_bytes_by_category), False
    after_graph = sum(estimate.final_bytes_by_category.values()) + update.scratch_bytes
    in_update = after_graph > estimate.peak_bytes
    if in_update:
        by_category = {**estimate.final_bytes_by_category, "optimizer_scratch": update.scratch_bytes}
    else:
        by_category = dict(estimate.peak_bytes_by_category)
    by_category["optimizer_state"] = by_category.get("optimizer_state", 0) + update.state_bytes
    return max(estimate.peak_bytes, after_graph) + update.state_bytes, by_category, in_update
