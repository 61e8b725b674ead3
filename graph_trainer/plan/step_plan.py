"""Predicting one step's memory and FLOPs before anything is allocated.

The job is built on the meta device (`build_job(..., materialize=False)`), and its step (forward, loss,
backward, clipping and, with `compile.trace_optimizer`, the AdamW update) is traced on fake tensors for the
target device and run through the same pass pipeline the trainer uses: the static estimate of the final
graph is the prediction. When the update runs outside the graph (the default), the plan adds what it costs:
the optimizer state alive throughout, and after the graph the scratch of the AdamW implementation the run
will use (`EagerUpdate`). Nothing the size of a parameter is ever allocated, so an 8B plan fits in a laptop's
memory. With parallelisms, the plan is one rank's (`graph_trainer.distributed.mesh.planning_mesh`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from graph_trainer.builder import Job, build_job
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.job_config.batching import accumulation_steps
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.loss import DOCUMENT_IDS
from graph_trainer.observability.log import quiet
from graph_trainer.optimizer.update_memory import EagerUpdate, whole_step_peak
from graph_trainer.passes.communication import communication_bytes
from graph_trainer.runtime.device import resolve_device
from graph_trainer.stages import TRANSFORM
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import TracedStep
from graph_trainer.tracer.executor import Transformed
from graph_trainer.tracer.graph_utils import node_flops
from graph_trainer.tracer.memory_estimate import MemoryEstimate, op_name

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
    # Bytes this rank's collectives move per step, by '<parallelism> <collective>' (passes/communication.py).
    comm_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # The planned step's final graph (`graph_trainer.tracer.Transformed`), for the trainer's first step to reuse.
    step_graph: Any = dataclasses.field(default=None, repr=False, compare=False)
    # Where the peak is: (layer, module FQN, op), the same for a full trace and a plan extended from short ones.
    peak_location: tuple[int | None, str, str] = (None, "", "")
    blocks_traced: int = 0  # transformer blocks the plan traced (a full trace: all of them)
    approximate: bool = False  # True where a depth-free plan cannot promise the full trace's numbers (budget)
    # The budget's choice solved on the short traces (`passes.budget_depth.BlockChoice`), for the step to apply.
    budget_choice: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def peak_at(self) -> str:
        """Where the peak is, in words from `peak_location` (no node name): e.g. 'mm.default in
        layers.31.feed_forward.w2 (layer 31)'."""
        layer, module, op = self.peak_location
        if op.startswith("eager AdamW update"):
            return f"the {op}"
        return f"{op} in {module or 'the top level'}" + ("" if layer is None else f" (layer {layer})")


def with_ac_mode(cfg: JobConfig, mode: str) -> JobConfig:
    """`cfg` with another `activation_checkpoint.mode` (a copy)."""
    other = copy.deepcopy(cfg)
    other.activation_checkpoint.mode = mode
    return other


def plan_step(job: Job, *, log_passes: bool = False) -> StepPlan:
    """Trace `job`'s step (its model on the meta device) for its device with its AC mode, apply the pipeline,
    and read the estimate. `log_passes`: log the pipeline's pass timings (the preflight of the step that runs).
    """
    step = job.graph_step(until=TRANSFORM)  # also validates the passes before the (long) trace
    start = time.perf_counter()
    with contextlib.nullcontext() if log_passes else quiet():  # other modes' plans would only add noise
        step.prepare(meta_batch(job.cfg))
    elapsed = time.perf_counter() - start
    # The plan reads the whole step's estimate; the graph the trainer reuses keeps its own (with accumulation the
    # micro graph's, which the trainer widens itself: handing it the widened one counted the other micro-batches twice).
    result = Transformed(step.traced, step.step_estimate())
    own = Transformed(step.traced, step.memory_estimate)
    return plan_of(job, result, elapsed, blocks_traced=job.model.args.n_layers, flops=_step_flops(step), graph=own)


def for_device(traced: TracedStep, device: torch.device) -> None:
    """A plan's trace, of a batch on the meta device, signed as a step's on `device` traces it: the step then
    reuses it (`GraphStep.reuse_trace`) instead of tracing again."""
    traced.signature = tuple((path, shape, dtype, device.type) for path, shape, dtype, _ in traced.signature)


def meta_batch(cfg: JobConfig) -> dict[str, torch.Tensor]:
    """One step's batch of the job's shape on the meta device (with accumulation, every micro-batch of it): what a
    plan traces."""
    b, s = cfg.training.local_batch_size * accumulation_steps(cfg), cfg.training.seq_len
    return {name: torch.empty(b, s, dtype=torch.long, device="meta") for name in batch_names(cfg)}


def batch_names(cfg: JobConfig) -> tuple[str, ...]:
    """The [B, S] int64 tensors of the job's batches: tokens and labels, and the rows' document ids when
    `data.document_masking` is on (so a plan holds the attention mask the step will build)."""
    return ("input", "labels", DOCUMENT_IDS) if cfg.data.document_masking else ("input", "labels")


def extra_compiled_bytes(cfg: JobConfig, gm: torch.fx.GraphModule) -> int:
    """What the compile stage adds to the planned graph's peak (`compiler.inductor.InductorStage`)."""
    if cfg.compile.backend != "inductor":
        return 0
    from graph_trainer.compiler.inductor import functional_gather_bytes

    return functional_gather_bytes(gm)


def peak_location(gm: torch.fx.GraphModule, index: int, layers: str | None) -> tuple[int | None, str, str]:
    """(layer, module, op) of the `index`-th node of `gm`: where a peak is, in words that do not depend on
    node names. The layer is the node's block (`node_blocks`), None outside the blocks."""
    layer = next((b for i, _, b in node_blocks(gm, layers) if i == index), None)
    node = list(gm.graph.nodes)[index]
    return layer, node_meta.module_fqn(node), op_name(node)


def op_nodes(gm: torch.fx.GraphModule) -> Iterator[tuple[int, torch.fx.Node]]:
    """(index, node) of the nodes that run (not the inputs, which are live throughout, nor the output)."""
    for i, node in enumerate(gm.graph.nodes):
        if node.op not in ("placeholder", "get_attr", "output"):
            yield i, node


def node_blocks(gm: torch.fx.GraphModule, layers: str | None) -> list[tuple[int, torch.fx.Node, int | None]]:
    """(index, node, block) of each running node (`op_nodes`): its layer tag, else the block its module is in
    (`layers`.N: FSDP's ops for a block's unit have the module but no tag). A backward node with neither
    (autograd's sum of two gradients of one tensor has no forward op, nor has the residual stream's at a
    block's start) belongs to the block the backward was in: that of the last node with a module before it."""
    pattern = _block_pattern(layers)

    def block(node: torch.fx.Node) -> Any:
        if node_meta.layer_id(node) is not None:
            return node_meta.layer_id(node)
        fqn = node_meta.module_fqn(node)
        match = pattern.search(fqn) if pattern and fqn else None
        return int(match.group(1)) if match else (None if fqn else _UNKNOWN)

    ops = list(op_nodes(gm))
    anchors = [block(n) for _, n in ops]
    out = []
    for (i, node), anchor, prev in zip(ops, anchors, _filled(anchors), strict=True):
        layer = anchor if anchor is not _UNKNOWN else None
        if anchor is _UNKNOWN and node_meta.is_backward(node) and isinstance(prev, int):
            layer = prev
        out.append((i, node, layer))
    return out


def _block_pattern(layers: str | None) -> re.Pattern | None:
    """What finds a block's index in a module FQN: `layers`.N."""
    return re.compile(rf"(?:^|\.){re.escape(layers)}\.(\d+)(?:\.|$)") if layers else None


def running_blocks(gm: torch.fx.GraphModule, layers: str | None) -> list[tuple[int, torch.fx.Node, int | None]]:
    """(index, node, block) as `node_blocks`, but the block each node runs in: a gather FSDP's prefetch moved up
    runs in the block of the unit whose gather it follows (`node_meta.prefetched_after`; None: the root unit), in
    the forward the block before its own, in the backward the one after. What is alive there is what that block's
    neighbours saved, which is how the depth-free plan must read it (`block_plan._keys`)."""
    pattern = _block_pattern(layers)
    out = []
    for i, node, block in node_blocks(gm, layers):
        unit = node_meta.prefetched_after(node)
        if unit is not None:
            match = pattern.search(unit) if pattern else None
            block = int(match.group(1)) if match else None
        out.append((i, node, block))
    return out


_UNKNOWN = object()


def _filled(values: list) -> list:
    """Each position's last known value so far (`_UNKNOWN` until one is known)."""
    out, last = [], _UNKNOWN
    for v in values:
        last = v if v is not _UNKNOWN else last
        out.append(last)
    return out


def finish_plan(
    job: Job,
    est: MemoryEstimate,
    update: EagerUpdate | None,
    location: tuple[int | None, str, str],
    *,
    num_params: int,
    flops: int,
    comm: dict[str, int],
    trace_time_s: float,
    blocks_traced: int,
    approximate: bool = False,
    step_graph: Any = None,
    where: str | None = None,
) -> StepPlan:
    """The StepPlan of an estimate (of a traced graph, or extended from short ones) and its eager update.
    `where` words the graph's peak (default: from `location`)."""
    cfg = job.cfg
    peak, by_category, in_update = whole_step_peak(est, update)
    if in_update:
        where = f"the eager AdamW update ({update.implementation})"
        location = (None, "", f"eager AdamW update ({update.implementation})")
    elif where is None:
        layer, module, op = location
        where = f"{op} in {module or 'the top level'}" + ("" if layer is None else f" (layer {layer})")
    return StepPlan(
        ac_mode=cfg.activation_checkpoint.mode,
        peak_bytes=peak,
        saved_bytes=est.saved_bytes,
        peak_by_category=by_category,
        peak_where=where,
        flops=flops,
        num_params=num_params,
        trace_time_s=trace_time_s,
        optimizer="in graph" if update is None else update.implementation,
        step_graph=step_graph,
        peak_location=location,
        comm_bytes=dict(comm),
        blocks_traced=blocks_traced,
        approximate=approximate,
    )


def plan_of(
    job: Job,
    result: Transformed,
    trace_time_s: float,
    *,
    blocks_traced: int,
    flops: int | None = None,
    graph: Transformed | None = None,
) -> StepPlan:
    """The plan of `job`'s step from its transformed trace (the final graph and its memory estimate). `flops`:
    the step's, when it is more than this graph's (gradient accumulation runs it once per micro-batch). `graph`:
    the graph with its own estimate for the trainer to reuse, when `result`'s estimate is the whole step's."""
    traced, est = result.traced, result.memory_estimate
    device = job.device
    for_device(traced, device)
    est = dataclasses.replace(est, peak_bytes=est.peak_bytes + extra_compiled_bytes(job.cfg, traced.gm))
    peak_index = next((i for i, n in enumerate(traced.gm.graph.nodes) if n.name == est.peak_node), None)
    module = f" in {est.peak_module_fqn}" if est.peak_module_fqn else ""
    if peak_index is None:  # with accumulation the peak can be the update graph's (`step_estimate`), not this one's
        location = (None, est.peak_module_fqn or "", f"{est.peak_op} (the gradient reduction and update graph)")
    else:
        location = peak_location(traced.gm, peak_index, job.spec.parallel_plan.layers)
    return finish_plan(
        job,
        est,
        job.eager_update(),
        location,
        num_params=job.num_params(),
        flops=sum(node_flops(n) for n in traced.gm.graph.nodes) if flops is None else flops,
        comm=communication_bytes(traced.gm),
        trace_time_s=trace_time_s,
        blocks_traced=blocks_traced,
        step_graph=graph or Transformed(traced, result.memory_estimate),
        where=f"{est.peak_node} ({est.peak_op}){module}",  # as before the depth-free plan (golden files hold it)
    )


def _step_flops(step: Any) -> int:
    """FLOPs of one step: the main graph's, times the micro-batches with accumulation, plus the update graph's."""
    flops = step.accumulation_steps * sum(node_flops(n) for n in step.traced.gm.graph.nodes)
    if step.update is not None:
        flops += sum(node_flops(n) for n in step.update.traced.gm.graph.nodes)
    return flops


def plan_config(cfg: JobConfig, device: torch.device | None = None) -> StepPlan:
    """Plan `cfg`'s step for one rank on `device` (default: the config's), building its job on the meta device."""
    device = device or resolve_device(cfg.training.device)
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), device) as mesh:
        return plan_step(build_job(cfg, mesh, materialize=False))


__all__ = [
    "AC_MODES",
    "StepPlan",
    "finish_plan",
    "for_device",
    "meta_batch",
    "node_blocks",
    "running_blocks",
    "op_nodes",
    "peak_location",
    "plan_config",
    "plan_of",
    "plan_step",
    "with_ac_mode",
]
