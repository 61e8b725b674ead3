"""Optimizer, learning-rate schedule and gradient clipping.

Eager mode uses `torch.optim.AdamW` as is. With `compile.trace_optimizer` the
same update is traced into the step graph by `GraphAdamW`, which keeps its
state inside the live `torch.optim.AdamW` (so checkpoints and the LR scheduler
do not care which mode ran) and reproduces its single-tensor update bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from graph_trainer.errors import ConfigError


def build_optimizer(model: nn.Module, *, name: str, lr: float, betas: tuple[float, float],
                    eps: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over every trainable parameter (one group, decoupled weight decay)."""
    if name.lower() != "adamw":
        raise ConfigError(f"optimizer.name: only 'AdamW' is supported, got {name!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay_type: str,
              min_lr_factor: float) -> float:
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


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                       decay_type: str, min_lr_factor: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `lr_factor`; step it once after every optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps,
                               decay_type=decay_type, min_lr_factor=min_lr_factor),
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
    preflight's prediction (which counts optimizer state) holds from step 1.
    """
    state = optimizer.state[p]
    if not state:
        step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        state["step"] = torch.tensor(0.0, dtype=step_dtype)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def eager_step_scratch_bytes(optimizer: torch.optim.AdamW) -> int:
    """Most bytes `torch.optim.AdamW.step()` (single-tensor path, as on CPU) holds beyond its inputs.

    For parameter i it builds `denom = (exp_avg_sq.sqrt() / c).add_(eps)`: two
    temporaries of p_i's size, while the previous parameter's `denom` is still
    bound to the loop variable; every other update is in place. So the scratch
    peaks at max_i(size(p_{i-1}) + 2 * size(p_i)).
    """
    sizes = [p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"]]
    return max((prev + 2 * cur for prev, cur in zip([0, *sizes], sizes)), default=0)


def clip_grads_(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale `grads` in place so their global L2 norm is at most `max_norm`; returns the norm before clipping.

    The eager step and the traced step both call this very function, so the two
    run the same ops in the same order (torch's `clip_grad_norm_` would pick a
    foreach kernel for real tensors but not for fake ones).
    """
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    total_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
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
            raise ConfigError("compile.trace_optimizer supports torch.optim.AdamW only; "
                              "set compile.trace_optimizer = false")
        for group in optimizer.param_groups:
            for key in ("amsgrad", "maximize", "capturable", "differentiable", "fused"):
                if group.get(key):
                    raise ConfigError(f"compile.trace_optimizer cannot trace AdamW({key}=True); "
                                      "set compile.trace_optimizer = false")
            if isinstance(group["lr"], torch.Tensor):
                raise ConfigError("compile.trace_optimizer needs a float learning rate, got a tensor")
        self.optimizer = optimizer
        # Graph-input order: the optimizer's own parameter order, which the tracer checks
        # against the model's.
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self._groups = [group for group in optimizer.param_groups for _ in group["params"]]

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
        """0-d float64 tensors for the coming step: per parameter (decay factor, sqrt of bias correction 2, -step size)."""
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

    def update_(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                state: list[torch.Tensor], scalars: list[torch.Tensor]) -> None:
        """The traced AdamW update, in place; constants (betas, eps) are baked into the graph."""
        for i, (p, g, group) in enumerate(zip(params, grads, self._groups)):
            beta1, beta2 = group["betas"]
            step_t, exp_avg, exp_avg_sq = state[3 * i: 3 * i + 3]
            decay, bias_correction2_sqrt, neg_step_size = scalars[3 * i: 3 * i + 3]
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
