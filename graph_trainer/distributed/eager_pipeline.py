"""Pipeline parallelism run eagerly (`compile.mode eager` with `parallelism.pp`): the baseline the traced stages
are measured against.

Each stage is the model's own modules, run by plain autograd under torch's `PipelineStage` and the same schedule
the traced step uses: the first stage runs the embedding and its blocks, a middle stage its blocks on the
activation it receives, the last stage its blocks, the final norm and the loss. A stage is a view of the model
(`stage_view`): a shallow copy whose `layers` hold only the stage's blocks, whose embedding returns the activation
received, and whose final norm is an identity before the last stage. So the view's `hidden_states` and the job's
loss, which call the family's own code, run exactly the stage's part of it. What this asks of a model family: its
`hidden_states(tokens, document_ids)` runs `tok_embeddings`, then each module of `layers` in order, then `norm`
(both families do), and its parameters live in those modules or in `output`.

The step around the schedule (the gradient reduction, the model's step update, the clip by the norm over every
stage in the whole model's order, the update, the loss on every rank) is the traced pipeline's
(`PipelinedStep._finish`), so traced pp and eager pp differ only in how a stage runs: bitwise equal under GPipe
and 1F1B (tests/distributed/test_pipeline.py).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from graph_trainer.distributed.mesh import Mesh
from graph_trainer.distributed.pipeline import PipelinedStep, build_schedule, keep_only, local_stages, stage_blocks
from graph_trainer.errors import UserError
from graph_trainer.loss import model_inputs
from graph_trainer.observability.memory import process_cublas_workspace_bytes
from graph_trainer.step import StepOutput, StepReport, micro_batches
from graph_trainer.tracer.capture import LossFn

EMBEDDING, FINAL_NORM, OUTPUT = "tok_embeddings", "norm", "output"  # the root modules a stage view replaces


class _Received(nn.Module):
    """Stands in for the embedding on a stage that receives its input: returns the activation received."""

    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.value is not None, "a stage ran before it received its activation"
        return self.value


def stage_view(model: nn.Module, layers: str, blocks: range, first: bool, last: bool) -> nn.Module:
    """`model` seen as one stage: the same modules and parameters, with `layers` holding only `blocks`, the
    embedding replaced by the received activation unless `first`, and the final norm by an identity unless `last`
    (the stage then ends on its last block's output, the residual stream the next stage receives)."""
    view = copy.copy(model)  # a shallow copy: the attribute dicts are shared until replaced below
    view.__dict__["_modules"] = dict(model._modules)
    view._modules[layers] = nn.ModuleList([model.get_submodule(layers)[i] for i in blocks])
    if not first:
        view._modules[EMBEDDING] = _Received()
    if not last:
        view._modules[FINAL_NORM] = nn.Identity()
    return view


class EagerStage(nn.Module):
    """The `nn.Module` torch's `PipelineStage` runs for one eager stage: `forward(*received, micro=index)` runs the
    stage's view of the model (`stage_view`) on micro-batch `micro` of the step (`begin_step` gives them): the
    hidden states it sends, or on the last stage the micro-batch's loss (its share of the step's mean)."""

    def __init__(self, view: nn.Module, index: int, num_stages: int, loss_fn: LossFn):
        super().__init__()
        self.view, self.index, self.num_stages, self.loss_fn = view, index, num_stages, loss_fn
        # What it receives and sends, as meta examples (`build_schedule` gives torch their shapes); set at the build.
        self.received: list[torch.Tensor] = []
        self.sent: list[torch.Tensor] = []
        self.dw_builder = None  # torch splits an eager stage's backward itself under a zero-bubble schedule
        self.micro_batches: list[dict[str, Any]] = []
        # Not measured: autograd runs an eager stage's backward with no hook at its end, so the bubble metric
        # (`pp_bubble_pct`) is the traced stages' only.
        self.busy_s: float | None = None
        self.torch_stage: Any = None  # torch's `PipelineStage` around this one
        # Called with (stage index, pass, micro-batch) as each pass starts (the per-stage plan notes its peak).
        self.on_pass: Callable[[int, str, int], None] | None = None
        self.run_graph: Any = None  # the traced stages' hook; an eager stage has no graph

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def begin_step(self, micro_batches: list[dict[str, Any]]) -> None:
        self.micro_batches = micro_batches

    def forward(self, *received: torch.Tensor, micro: torch.Tensor) -> torch.Tensor:
        index = micro.storage_offset()  # torch's chunk of the step's arange(M): its offset is the micro-batch
        batch = self.micro_batches[index]
        if self.on_pass is not None:
            self.on_pass(self.index, "forward", index)
        if received:
            self.view.get_submodule(EMBEDDING).value = received[0]
        try:
            out = self.loss_fn(self.view, batch) if self.is_last else self.view.hidden_states(*model_inputs(batch))
        finally:
            if received:
                self.view.get_submodule(EMBEDDING).value = None
        if self.on_pass is not None and out.requires_grad:
            on_pass = self.on_pass
            out.register_hook(lambda grad: on_pass(self.index, "backward", index))
        return out


def _holder(name: str, layers: str, block_stage: dict[int, int], last: int) -> int:
    """The stage holding parameter `name` of the whole model."""
    if name.startswith(layers + "."):
        return block_stage[int(name[len(layers) + 1 :].split(".")[0])]
    root = name.partition(".")[0]
    if root == EMBEDDING:
        return 0
    if root in (FINAL_NORM, OUTPUT):
        return last
    raise UserError(
        f"parameter {name} is outside the embedding, the blocks, the final norm and the output, so an eager "
        "pipeline stage cannot hold it; pass --compile.mode trace (the traced stages place it by the graph)"
    )


class EagerPipelinedStep(PipelinedStep):
    """The training step of one pipeline stage run eagerly (the step protocol): `eager_step` (an `EagerStep`)
    gives the loss and the hooks of the job's parallelisms; the stages are built at the first step, from the
    shapes a run of `whole` (the whole model on the meta device) gives at the stage boundaries."""

    def __init__(self, eager_step: Any, mesh: Mesh, model: nn.Module, whole: nn.Module, layers: str, **kwargs: Any):
        super().__init__(eager_step, mesh, model, **kwargs)
        self.whole, self.layers = whole, layers
        self.names = [n for n, p in whole.named_parameters() if p.requires_grad]  # the whole model's gradient order

    def prepare(self, micro: dict[str, Any], traced: Any = None) -> None:
        """Build this rank's stages for micro-batches like `micro` (nothing to trace)."""
        if not self.stages:
            self._build(micro)

    def _build(self, micro: dict[str, Any]) -> None:
        n_stages = self.pp * self.per_rank
        blocks = stage_blocks(self.n_layers, n_stages)
        block_stage = {b: s for s, bs in enumerate(blocks) for b in bs}
        placed = [local_stages(self.pp, self.per_rank, r, self.schedule_name) for r in range(self.pp)]
        holder_of = functools.partial(_holder, layers=self.layers, block_stage=block_stage, last=n_stages - 1)
        holder = {n: holder_of(n) for n in self.names}
        first_name: dict[int, str] = {}
        for name, param in self.whole.named_parameters(remove_duplicate=False):
            seen = first_name.setdefault(id(param), name)
            if holder_of(seen) != holder_of(name):  # its gradient would be made on two ranks, one keeping it
                raise UserError(
                    f"cannot run eager pipeline stages: parameter {seen} is also {name}, in another stage (tied "
                    "embeddings?); untie them (model.tie_embeddings = false) or run without pipeline parallelism"
                )
        self.rank_parameters = [[n for n in self.names if holder[n] in stages] for stages in placed]
        self.mine = set(self.rank_parameters[self.mesh.coordinate("pp")])
        removed = keep_only(self.model, self.mine, self.optimizer)
        if self.parallel is not None and removed:
            self.parallel.release(removed)
        loss_fn = self.graph_step.loss_fn
        self.stages = [
            EagerStage(stage_view(self.model, self.layers, blocks[s], s == 0, s == n_stages - 1), s, n_stages, loss_fn)
            for s in self.local
        ]
        sent = self._boundaries(micro, blocks, loss_fn)
        for stage in self.stages:  # a stage receives what the one before sends
            stage.received = [sent[stage.index - 1]] if stage.index else []
            stage.sent = [sent[stage.index]]
        group = self.mesh.group("pp")
        self.schedule = build_schedule(self.stages, self.schedule_name, self.n_micro, group, self.mesh.device)

    def _boundaries(self, micro: dict[str, Any], blocks: Sequence[range], loss_fn: LossFn) -> list[torch.Tensor]:
        """What each stage sends (meta tensors): the output of its last block, and the last stage's loss, from one
        run of the whole model on the meta device."""
        outputs: dict[int, torch.Tensor] = {}
        container = self.whole.get_submodule(self.layers)
        hooks = [
            container[bs[-1]].register_forward_hook(lambda m, a, out, s=s: outputs.__setitem__(s, out))
            for s, bs in enumerate(blocks[:-1])
        ]
        try:
            with torch.no_grad():
                loss = loss_fn(self.whole, {k: v.to("meta") if torch.is_tensor(v) else v for k, v in micro.items()})
        finally:
            for hook in hooks:
                hook.remove()
        return [outputs[s] for s in range(len(blocks) - 1)] + [loss]

    def workspace_bytes(self) -> int:
        """cuBLAS's workspace on CUDA, made by the process's first matmul and held from then on (0 on CPU)."""
        return process_cublas_workspace_bytes(self.mesh.device) if self.mesh.device.type == "cuda" else 0

    def __call__(self, batch: Any) -> StepOutput:
        return self.run(None, micro_batches(batch, self.n_micro, self.graph_step.count_reduce))

    def run(self, traced: Any, micro: list[dict[str, Any]], *, update: bool = True) -> StepOutput:
        """The step on its `micro`-batches (`traced` is not read), the update left out when `update` is False."""
        self.prepare(micro[0])
        params = dict(self.model.named_parameters())
        for name in self.mine:
            params[name].grad = None
        losses = self._run_schedule(micro)
        accums = [params[n].grad if n in self.mine else None for n in self.names]
        with torch.no_grad():
            return self._finish(self.names, accums, losses, update=update)

    def report(self) -> StepReport:
        """Nothing traced; the preflight plans the rank's eager stages (`plan.stage_plan`)."""
        return StepReport(updates_inside=False)


__all__ = ["EagerPipelinedStep", "EagerStage", "stage_view"]
