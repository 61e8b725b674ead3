"""AdamW: building `torch.optim.AdamW` for a job, its state made up front, and its update traced into the graph.

Eager mode uses `torch.optim.AdamW` as is. With `compile.trace_optimizer` the
same update is traced into the step graph by `GraphAdamW`, which keeps its
state inside the live `torch.optim.AdamW` (so checkpoints and the LR scheduler
do not care which mode ran) and reproduces its single-tensor update bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from graph_trainer.errors import ConfigError

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
        for p, group in zip(self.params, self._groups, strict=True):
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
        for i, (p, g, group) in enumerate(zip(params, grads, self._groups, strict=True)):
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
