"""Pipeline parallelism: the traced micro-step cut into stages by block, run under torch's pipeline schedules.

The step is traced once, whole, as one micro-batch's graph (`trace_step`'s "micro" part: forward, loss, backward,
each gradient added into its accumulator), and the memory policy's passes run on it as for any step. Then
`cut_stages` cuts that graph into each stage's forward graph and backward graph, by the block every node is
tagged with: stage s runs blocks [s * L / pp, (s + 1) * L / pp); the embedding goes with the first stage, the
norm, output and loss with the last. What crosses a cut is found from the graph's edges, not assumed:

- stage s's forward sends the activation stage s + 1 reads (the residual stream), and its backward receives
  that activation's gradient from stage s + 1's backward;
- what stage s's backward reads of its own forward is what it saves (the memory policy's decision, since the
  policy ran on the whole graph before the cut: recomputed ops sit in the backward graph);
- an op outside the blocks that reads only the step's inputs (RoPE's table cut to the sequence) runs in every
  stage that reads it, rather than being sent; but a collective (FSDP's gather of a unit's shards, with FSDP inside
  the stages) runs once, in the first stage and pass that reads it;
- any other edge (a parameter read by two stages, as tied embeddings are; an activation skipping a stage) is
  refused, naming the op.

`GraphStage` is the `nn.Module` torch's `PipelineStage` drives: its forward runs the stage's forward graph inside
an autograd function whose backward runs the stage's backward graph, so torch's own schedules (`SCHEDULES`:
GPipe, 1F1B, Interleaved1F1B and the zero-bubble ones, for which `split_backward` cuts the backward into its input
and weight gradients) order the micro-batches and move activations and gradients between ranks by point-to-point
sends. The graphs run ops the whole graph runs, in the same order per stage, and each backward adds into the
accumulators in micro-batch order, so the gradients are bitwise those of one process accumulating the same
micro-batches (tests/distributed/test_pipeline.py).

`PipelineParallel` is the parallelism (`parallelism.pp`): a rank keeps only its stages' parameters, the step
traces a meta copy of the whole model (split by FSDP and TP as the rank's model is: `parallelism.parallelize`),
and `PipelinedStep` runs each training step around torch's schedule (micro-batches, clipping by the norm over every
stage, the update). docs/pipeline.md has the whole story.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from graph_trainer.distributed.mesh import Mesh
from graph_trainer.distributed.parallelism import Parallelism, ScheduleModel
from graph_trainer.errors import UserError
from graph_trainer.job_config.memory_budget import parse_memory_budget
from graph_trainer.optimizer.clip import grad_norms, scale_to_norm_
from graph_trainer.step import StepOutput, StepReport, micro_batches, sum_losses
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import InputLayout, TracedStep, batch_tensors
from graph_trainer.tracer.layers import transformer_layers
from graph_trainer.tracer.memory_estimate import workspace_bytes

# torchtitan's schedule names that run today, and the torch class that runs each.
SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
}
# Several stages per rank (`pp_stages_per_rank`): looped (r, r + pp, ...), or V-shaped for ZBVZeroBubble.
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
# Zero-bubble schedules run each stage's weight gradients apart from (later than) its input gradients.
DEFERS_WEIGHTS = ("InterleavedZeroBubble", "ZBVZeroBubble")
V_SHAPED = ("ZBVZeroBubble",)  # rank r runs stages r and 2 pp - 1 - r (two a rank)


def stages_per_rank(schedule: str, asked: int) -> int:
    """How many stages each rank runs: `asked` (`parallelism.pp_stages_per_rank`) under a multi-stage schedule,
    else 1.

    Raises:
        UserError: fewer than 2 under a multi-stage schedule.
    """
    if schedule not in MULTI_STAGE:
        return 1
    if schedule in V_SHAPED and asked != 2:
        raise UserError(
            f"parallelism.pp_schedule = {schedule} runs two stages on each rank (a V), and "
            f"parallelism.pp_stages_per_rank = {asked}; set it to 2"
        )
    if asked < 2:
        raise UserError(
            f"parallelism.pp_schedule = {schedule} runs several stages on each rank, and "
            f"parallelism.pp_stages_per_rank = {asked}; set it to 2 or more, or use 1F1B"
        )
    return asked


def local_stages(pp: int, per_rank: int, rank: int, schedule: str = "") -> list[int]:
    """The stages rank `rank` of `pp` runs: rank, rank + pp, ... (the looped order torch's interleaved schedules
    expect), or rank and 2 pp - 1 - rank under a V-shaped schedule."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(per_rank)]


def stage_blocks(n_layers: int, pp: int) -> list[range]:
    """The blocks each of `pp` stages runs, in order.

    When `pp` divides the layers, the same number each. Otherwise the embedding and the output (with the final norm
    and the loss) are counted as a block each, and the n_layers + 2 parts are dealt out as evenly as they go, the
    first stages taking one more when they do not divide: the first and last stages then run one block fewer than
    the stages between (as torchtitan balances an uneven split). Llama-3 405B's 126 blocks at pp 8: 15, 16 x 6, 15.

    Raises:
        UserError: more stages than layers, or a split that would leave a stage without a block.
    """
    if n_layers % pp == 0:
        per = n_layers // pp
        return [range(s * per, (s + 1) * per) for s in range(pp)]
    parts, extra = divmod(n_layers + 2, pp)
    sizes = [parts + (s < extra) for s in range(pp)]
    sizes[0] -= 1
    sizes[-1] -= 1
    if pp > n_layers or min(sizes) < 1:
        raise UserError(
            f"{pp} pipeline stages (parallelism.pp x pp_stages_per_rank) leave a stage without a block of "
            f"model.n_layers = {n_layers}: pick fewer stages"
        )
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def micro_batch_count(local_batch_size: int, microbatch_size: int, pp: int, schedule: str) -> int:
    """How many micro-batches a step's local batch makes (local_batch_size / pp_microbatch_size, as torchtitan
    cuts it).

    Raises:
        UserError: an unknown schedule, a micro-batch size that does not divide the local batch, one micro-batch,
            fewer micro-batches than stages (all but GPipe: one in flight per stage), or a count the interleaved
            schedules' rounds do not divide.
    """
    if schedule not in SCHEDULES:
        raise UserError(f"parallelism.pp_schedule = {schedule!r} is unknown: use one of {', '.join(SCHEDULES)}")
    if microbatch_size < 1 or local_batch_size % microbatch_size:
        raise UserError(
            f"parallelism.pp_microbatch_size = {microbatch_size} does not divide training.local_batch_size = "
            f"{local_batch_size}: the local batch is cut into equal micro-batches; pick a size that divides it"
        )
    count = local_batch_size // microbatch_size
    if count < 2:
        # One micro-batch runs the stages one after another with nothing to overlap (and the step would be traced
        # whole, not as the micro-step the stages are cut from).
        raise UserError(
            f"parallelism.pp_microbatch_size = {microbatch_size} makes one micro-batch of training.local_batch_size "
            f"= {local_batch_size}: a pipeline needs at least 2; lower pp_microbatch_size"
        )
    if schedule != "GPipe" and count < pp:
        raise UserError(
            f"parallelism.pp_schedule = {schedule} needs at least pp = {pp} micro-batches and gets {count} "
            f"(training.local_batch_size {local_batch_size} / parallelism.pp_microbatch_size {microbatch_size}); "
            "lower pp_microbatch_size or raise local_batch_size"
        )
    if schedule in MULTI_STAGE and count % (count // pp):
        raise UserError(
            f"parallelism.pp_schedule = {schedule} runs the micro-batches in rounds of pp = {pp}, and {count} is not "
            f"a multiple of its {count // pp} rounds; pick a micro-batch count that is a multiple of pp"
        )
    return count


def job_stage_blocks(cfg: Any, n_layers: int) -> list[range]:
    """The blocks each stage of `cfg`'s pipeline runs at depth `n_layers` (`stage_blocks` over its stage count)."""
    p = cfg.parallelism
    return stage_blocks(n_layers, p.pp * stages_per_rank(p.pp_schedule, p.pp_stages_per_rank))


def one_micro_batch(cfg: Any) -> Any:
    """`cfg` as one process running one of its pipeline's micro-batches (a copy): no pp, a local batch of
    `pp_microbatch_size` sequences and no accumulation; every other degree kept. The step whose memory budget
    choice the pipeline's micro-step applies (`plan.stage_plan.pipeline_budget_choice`)."""
    out = copy.deepcopy(cfg)
    out.training.local_batch_size = cfg.parallelism.pp_microbatch_size
    out.training.global_batch_size = -1
    out.parallelism.pp = 1
    return out


def without_stages(mesh: Mesh) -> Mesh:
    """`mesh` seen without its pp dimension: this rank's place in one pipeline position's data and tensor parallel
    groups, where a job built on it traces the step one process of that position would (nothing communicates while
    a step is traced)."""
    return dataclasses.replace(mesh, dims=dataclasses.replace(mesh.dims, pp=1))


def short_counts(cfg: Any) -> tuple[int, list[int]]:
    """(the job's micro-batch count, three smaller counts whose stage plans extend to it, or [] when it is not larger
    than them): from the first count past pp that the schedule takes, 1 apart (pp apart under a schedule of several
    stages a rank, whose counts are multiples of pp). Past its warm-up a schedule repeats (`plan.stage_plan`)."""
    p = cfg.parallelism
    count = micro_batch_count(cfg.training.local_batch_size, p.pp_microbatch_size, p.pp, p.pp_schedule)
    step = p.pp if stages_per_rank(p.pp_schedule, p.pp_stages_per_rank) > 1 else 1
    first = step * (p.pp // step + 1)
    counts = [first, first + step, first + 2 * step]
    return count, (counts if count > counts[-1] else [])


# Where a stage graph's input comes from: ("step", i) the whole graph's i-th input (a parameter, buffer, batch
# tensor or accumulator), ("recv", j) the j-th activation from the stage before, ("saved", k) the k-th tensor its
# own forward saved, ("grad", j) the gradient of its j-th sent activation, from the stage after.
Source = tuple[str, int]


@dataclasses.dataclass
class StageGraphs:
    """One stage cut from the micro-step graph: its forward graph (-> the activations it sends, or the loss on the
    last stage, then what its backward reads) and its backward graph (-> the gradients of what it received)."""

    index: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    forward_inputs: list[Source]
    backward_inputs: list[Source]
    sent: list[torch.Tensor]  # fake tensors shaped as what the forward sends (the loss on the last stage)
    received: list[torch.Tensor]  # ... as what it receives (none on the first stage)
    parameters: list[str]  # the parameters it reads (this stage's, no other stage reads them)
    # The backward split for zero-bubble schedules (`split_backward`): the input gradients (-> the gradients sent,
    # then what the weights' part reads of it) and the weight gradients (adds into the accumulators, no output).
    input_backward: fx.GraphModule | None = None
    input_backward_inputs: list[Source] = dataclasses.field(default_factory=list)
    weight_backward: fx.GraphModule | None = None
    weight_backward_inputs: list[Source] = dataclasses.field(default_factory=list)

    @property
    def n_sent(self) -> int:
        return len(self.sent)

    @property
    def n_received(self) -> int:
        return len(self.received)


def split_backward(graphs: StageGraphs) -> None:
    """Cut `graphs.backward` in two, as zero-bubble schedules run it: the ops the gradients sent to the stage before
    depend on (the input gradients, run at once so that stage can go on), and the rest (the weight gradients, each
    added into its accumulator, run later to fill the bubble). What the second reads of the first is passed on
    ("stash" inputs), and lives until the weights' part runs. The first stage sends nothing: all of its backward is
    the weights' part."""
    gm = graphs.backward
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    sends = list(output.args[0])
    needed: set[fx.Node] = set()
    stack = list(sends)
    while stack:
        n = stack.pop()
        if n not in needed and n.op != "placeholder":
            needed.add(n)
            stack.extend(n.all_input_nodes)
    inputs = {n: src for n, src in zip(gm.graph.find_nodes(op="placeholder"), graphs.backward_inputs, strict=True)}
    first = [n for n in nodes if n in needed]
    rest = [n for n in nodes if n.op not in ("placeholder", "output") and n not in needed]
    later = set(rest)
    stash = [n for n in first if any(u in later for u in n.users)]
    graphs.input_backward, graphs.input_backward_inputs = _subgraph(gm, first, inputs, {}, [*sends, *stash])
    stashed = {n: ("stash", k) for k, n in enumerate(stash)}
    graphs.weight_backward, graphs.weight_backward_inputs = _subgraph(gm, rest, inputs, stashed, [])


def _subgraph(
    gm: fx.GraphModule,
    ops: list[fx.Node],
    inputs: dict[fx.Node, Source],
    passed: dict[fx.Node, Source],
    outputs: list[fx.Node],
) -> tuple[fx.GraphModule, list[Source]]:
    """A graph of `ops` (in `gm`'s order) whose inputs are the placeholders of `gm` they read (`inputs` says where
    each comes from) and the values `passed` in from another graph, returning `outputs`."""
    graph, env, sources = fx.Graph(), {}, []
    for n in ops:
        for a in n.all_input_nodes:
            if a not in env and (a in inputs or a in passed):
                env[a] = graph.placeholder(a.name)
                sources.append(inputs.get(a) or passed[a])
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, graph), sources


def cut_stages(gm: fx.GraphModule, layout: InputLayout, n_layers: int, pp: int) -> list[StageGraphs]:
    """The micro-step graph `gm` (inputs laid out as `layout`, output [loss]) cut into `pp` stages of
    `stage_blocks(n_layers, pp)` (see the module's docstring for what goes where).

    Raises:
        UserError: an edge the cut cannot carry (a parameter read by two stages, an activation that skips a stage,
            more than one activation between two stages), said with the op that makes it.
    """
    stage_of = [s for s, blocks in enumerate(stage_blocks(n_layers, pp)) for _ in blocks]  # by block index
    nodes = list(gm.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    first_backward = next(i for i, n in enumerate(nodes) if node_meta.is_backward(n))
    # (stage, in the backward) of each op; None for an op free to run anywhere (reads only the step's inputs).
    where: dict[fx.Node, tuple[int, bool] | None] = {n: None for n in inputs}
    _place(nodes, where, stage_of, first_backward)
    # A collective that reads only the step's inputs (FSDP's gather of a unit's shards) is not free: copied into each
    # stage that reads it, it would run there again (in the backward too, whatever the gather policy decided). It
    # runs once, in the first stage and pass that reads it (through free ops too: the embedding reads its gather),
    # and the free ops after it are placed again from there.
    consumer: dict[fx.Node, tuple[int, bool]] = {}
    for n in reversed(nodes):
        if n.op in ("placeholder", "output") or where[n] is not None:
            continue
        reads = [where.get(u) or consumer.get(u) for u in n.users]
        if reads := [r for r in reads if r is not None]:
            consumer[n] = min(reads)
            if node_meta.collective(n) is not None:
                where[n] = consumer[n]
    _place(nodes, where, stage_of, first_backward)
    for n in nodes:
        if where.get(n, 0) is None and n.op != "placeholder" and (node_meta.is_random(n) or _writes_step_input(n)):
            raise UserError(f"cannot cut the step into pipeline stages: {n.name} ({n.target}) draws random numbers "
                            "or writes the step's input outside every block; keep such ops inside a block")  # fmt: skip
    loss = gm.graph.find_nodes(op="output")[0].args[0][0]
    if where.get(loss) != (pp - 1, False):
        raise UserError(f"cannot cut the step into pipeline stages: the loss ({loss.name}) is not made by the last "
                        "stage's forward")  # fmt: skip
    parts: dict[tuple[int, bool], list[fx.Node]] = {(s, b): [] for s in range(pp) for b in (False, True)}
    for n in nodes:
        if where.get(n) is not None:
            parts[where[n]].append(n)
    trainable = {i: name for i, name in enumerate(layout.param_names) if name in set(layout.grad_names)}
    return _Cutter(gm, inputs, where, parts, pp, loss, trainable).stages()


def _place(
    nodes: list[fx.Node], where: dict[fx.Node, tuple[int, bool] | None], stage_of: list[int], first_backward: int
) -> None:
    """Place each of `nodes` not placed yet (`where`: (stage, in the backward), None for a free op) from its block, or
    else from what it reads (`stage_of`: each block's stage; the backward starts at position `first_backward` of the
    graph)."""
    position = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    for n in nodes:
        if n.op in ("placeholder", "output") or where.get(n) is not None:
            continue
        backward, layer = position[n] >= first_backward, node_meta.layer_id(n)
        stages = {where[a][0] for a in n.all_input_nodes if where[a] is not None}
        if layer is not None:
            stage = stage_of[layer]
        elif stages:
            # Activations flow up the stages in the forward and gradients down them in the backward: an op outside
            # the blocks runs where the last of its inputs is made (the loss after the last block, a gradient sum
            # in the stage that makes its terms).
            stage = min(stages) if backward else max(stages)
        else:
            where[n] = None
            continue
        where[n] = (stage, backward)


def _writes_step_input(n: fx.Node) -> bool:
    """Whether `n` writes into one of the step's inputs (a copy of it in each stage would write it again)."""
    written = node_meta.written_input(n)
    return written is not None and written.op == "placeholder"


class _Cutter:
    """Builds each stage's two graphs from the ops `cut_stages` placed (see there)."""

    def __init__(self, gm, inputs, where, parts, pp, loss, trainable):
        self.gm, self.where, self.parts, self.pp, self.loss = gm, where, parts, pp, loss
        self.trainable = trainable  # the trained parameters' names by their input index
        self.input_index = {n: i for i, n in enumerate(inputs)}
        # The activations each cut carries forward, and the gradients it carries back (in graph order).
        self.sent: list[list[fx.Node]] = [[] for _ in range(pp)]
        self.grads_back: list[list[fx.Node]] = [[] for _ in range(pp)]
        self.saved: list[list[fx.Node]] = [[] for _ in range(pp)]
        self.reads: list[set[fx.Node]] = [set() for _ in range(pp)]  # the step inputs each stage reads
        self._find_crossings()

    def _find_crossings(self) -> None:
        for (stage, backward), ops in self.parts.items():
            for n in ops:
                for a in self._reads_of(n):
                    if a in self.input_index:
                        self.reads[stage].add(a)
                        continue
                    src_stage, src_backward = self.where[a]
                    if (src_stage, src_backward) == (stage, backward):
                        continue
                    if not src_backward and src_stage == stage - 1:  # an activation from the stage before
                        _add(self.sent[src_stage], a)
                        if backward:  # its backward reads it too: the forward that received it saves it
                            _add(self.saved[stage], a)
                    elif backward and not src_backward and src_stage == stage:
                        _add(self.saved[stage], a)
                    elif backward and src_backward and src_stage == stage + 1:
                        _add(self.grads_back[stage], a)
                    else:
                        raise UserError(
                            f"cannot cut the step into pipeline stages: {n.name} ({n.target}, stage {stage} "
                            f"{'backward' if backward else 'forward'}) reads {a.name} from stage {src_stage}'s "
                            f"{'backward' if src_backward else 'forward'}; only the next stage's activations and "
                            "the previous stage's gradients can cross"
                        )
        owners: dict[fx.Node, int] = {}
        for s, read in enumerate(self.reads):
            for a in read:
                name = self.trainable.get(self.input_index[a])
                if name is not None and a in owners:
                    raise UserError(
                        f"cannot cut the step into pipeline stages: parameter {name} is read by stages {owners[a]} "
                        f"and {s} (tied embeddings?); untie them (model.tie_embeddings = false) or run without "
                        "pipeline parallelism"
                    )
                owners[a] = s
        for s in range(self.pp - 1):
            if len(self.sent[s]) != 1 or len(self.grads_back[s]) != 1:
                raise UserError(
                    f"cannot cut the step into pipeline stages: the cut after stage {s} carries "
                    f"{len(self.sent[s])} activations forward and {len(self.grads_back[s])} gradients back, where "
                    "one of each (the residual stream) is expected"
                )

    def _reads_of(self, n: fx.Node) -> list[fx.Node]:
        """What `n` reads, with every free op it reads replaced by what that op reads (copied into the stage)."""
        out = []
        for a in n.all_input_nodes:
            out.extend([a] if self.where.get(a) is not None or a in self.input_index else self._reads_of(a))
        return out

    def stages(self) -> list[StageGraphs]:
        result = []
        for s in range(self.pp):
            received = [("recv", j, a) for j, a in enumerate(self.sent[s - 1])] if s else []
            fwd_out = [self.loss] if s == self.pp - 1 else self.sent[s]
            forward, fwd_sources = self._graph(self.parts[(s, False)], received, [*fwd_out, *self.saved[s]])
            saved = [("saved", k, a) for k, a in enumerate(self.saved[s])]
            grads = [("grad", 0, self.grads_back[s][0])] if s < self.pp - 1 else []
            back_out = self.grads_back[s - 1] if s else []
            backward, bwd_sources = self._graph(self.parts[(s, True)], [*saved, *grads], back_out)
            trained = sorted(self.input_index[a] for a in self.reads[s] if self.input_index[a] in self.trainable)
            result.append(
                StageGraphs(
                    s, forward, backward, fwd_sources, bwd_sources,
                    sent=[n.meta["val"] for n in fwd_out],
                    received=[a.meta["val"] for _, _, a in received],
                    parameters=[self.trainable[i] for i in trained],
                )
            )  # fmt: skip
        return result

    def _graph(
        self, ops: list[fx.Node], given: list[tuple[str, int, fx.Node]], outputs: Sequence[fx.Node]
    ) -> tuple[fx.GraphModule, list[Source]]:
        """A graph of `ops` (with the free ops they read copied in, in graph order) whose inputs are `given` and the
        step inputs they read, returning `outputs`."""
        graph, env, sources = fx.Graph(), {}, []
        for kind, j, a in given:
            env[a] = graph.placeholder(f"{kind}_{j}")
            sources.append((kind, j))
        wanted = set(ops) | {a for n in [*ops, *outputs] for a in self._free_closure(n)}
        for n in self.gm.graph.nodes:
            if n not in wanted or n in env:
                continue
            for a in n.all_input_nodes:
                if a in self.input_index and a not in env:
                    env[a] = graph.placeholder(a.name)
                    sources.append(("step", self.input_index[a]))
            env[n] = graph.node_copy(n, lambda a: env[a])
        graph.output(tuple(env[o] for o in outputs))
        return fx.GraphModule(self.gm, graph), sources

    def _free_closure(self, n: fx.Node) -> set[fx.Node]:
        out = set()
        for a in n.all_input_nodes:
            if a not in self.input_index and self.where.get(a) is None:
                out |= {a, *self._free_closure(a)}
        return out


def _add(values: list[fx.Node], node: fx.Node) -> None:
    if node not in values:
        values.append(node)


class _RunStage(torch.autograd.Function):
    """A stage's forward graph as an autograd op whose backward is the stage's backward graph."""

    @staticmethod
    def forward(ctx, stage: GraphStage, micro: int, anchor: torch.Tensor, *received: torch.Tensor):
        stage.count("forward", micro)
        out = stage.run(stage.graphs.forward, stage.graphs.forward_inputs, micro, received=received)
        ctx.stage, ctx.micro, ctx.saved = stage, micro, out[stage.graphs.n_sent :]
        # torch's sends take contiguous tensors; a stage may end on a view (TP's reduce-scatter along the sequence).
        sent = [t.contiguous() for t in out[: stage.graphs.n_sent]]
        return sent[0] if len(sent) == 1 else tuple(sent)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        stage, saved, micro, graphs = ctx.stage, ctx.saved, ctx.micro, ctx.stage.graphs
        stage.count("backward", micro)
        ctx.saved = None  # what the forward saved dies with this micro-batch's backward (or its weights' part)
        # The last stage's graph starts its backward from the loss itself (autograd's seed of 1 is not read).
        given = grads if not stage.is_last else ()
        if not stage.defer_weights:
            out = stage.run(graphs.backward, graphs.backward_inputs, micro, saved=saved, grads=given)
            return (None, None, None, *(t.contiguous() for t in out))
        out = stage.run(graphs.input_backward, graphs.input_backward_inputs, micro, saved=saved, grads=given)
        sent, stash = out[: graphs.n_received], out[graphs.n_received :]
        stage.defer(micro, saved, given, stash)
        return (None, None, None, *(t.contiguous() for t in sent))


class GraphStage(nn.Module):
    """The `nn.Module` torch's `PipelineStage` runs for one stage: `forward(*received, micro=index)` runs the stage's
    graphs on micro-batch `micro` of the step (`begin_step` gives them) and the step inputs `feed` returns by their
    index in the whole graph (parameters, buffers, the micro-batch's tensors, the gradient accumulators)."""

    def __init__(
        self,
        graphs: StageGraphs,
        num_stages: int,
        feed: Callable[[int, list[torch.Tensor]], torch.Tensor],
        *,
        defer_weights: bool = False,
    ):
        super().__init__()
        self.graphs, self.num_stages, self.feed = graphs, num_stages, feed
        # Zero-bubble schedules: the backward runs the input gradients, and leaves the weights' part to
        # `weight_pass` (torch's `dw_builder`), which the schedule runs later.
        self.defer_weights = defer_weights
        if defer_weights and graphs.weight_backward is None:
            split_backward(graphs)
        self._deferred: Callable[[], None] | None = None
        self.micro_batches: list[list[torch.Tensor]] = []  # each micro-batch's tensors (`begin_step`)
        self.busy_s = 0.0  # time inside this stage's graphs this step (the rest of the schedule's is the bubble)
        self.ran: list[tuple[str, int]] = []  # the passes run this step, in order (see `count`)
        self.torch_stage: Any = None  # torch's `PipelineStage` around this one (`build_schedule`)
        # Called with (stage index, pass, micro-batch) as each pass starts, and run in place of a graph's call (node
        # by node): the plan notes where its peak is.
        self.on_pass: Callable[[int, str, int], None] | None = None
        self.run_graph: Callable[[fx.GraphModule, list[torch.Tensor]], Sequence[torch.Tensor]] | None = None
        # Makes each stage's output need a gradient, so autograd runs its backward graph (the first stage reads no
        # activation that needs one).
        self.anchor = torch.zeros((), requires_grad=True)

    @property
    def index(self) -> int:
        return self.graphs.index

    @property
    def received(self) -> list[torch.Tensor]:
        """The activations it receives, as traced (their shapes and dtypes: `build_schedule`)."""
        return self.graphs.received

    @property
    def sent(self) -> list[torch.Tensor]:
        return self.graphs.sent

    @property
    def dw_builder(self) -> Callable[[], Callable[[], None]] | None:
        """torch's `dw_builder` under a zero-bubble schedule (`weight_pass`), else None."""
        return self.weight_pass if self.defer_weights else None

    @property
    def is_last(self) -> bool:
        return self.graphs.index == self.num_stages - 1

    def begin_step(self, micro_batches: list[dict[str, Any]]) -> None:
        self.micro_batches = [batch_tensors(m) for m in micro_batches]  # flattened once, read by every pass
        self.ran = []
        self.busy_s = 0.0

    def defer(self, micro: int, saved: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], stash: list) -> None:
        """Keep micro-batch `micro`'s weights' part for `weight_pass`, holding only what it reads."""
        graphs = self.graphs
        reads = {(kind, j) for kind, j in graphs.weight_backward_inputs}
        kept = {name: {j: v for j, v in enumerate(values) if (kind, j) in reads}
                for name, kind, values in (("saved", "saved", saved), ("grads", "grad", grads),
                                           ("stash", "stash", stash))}  # fmt: skip

        def weights() -> None:
            self.count("weights", micro)
            self.run(graphs.weight_backward, graphs.weight_backward_inputs, micro, **kept)

        self._deferred = weights

    def weight_pass(self) -> Callable[[], None]:
        """torch's `dw_builder`: the weights' part of the backward that just ran (run by the schedule, later)."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            raise RuntimeError(f"pipeline stage {self.graphs.index}: no backward left a weights' part to run")
        return deferred

    def count(self, what: str, micro: int) -> None:
        """Refuse a second forward or backward of one micro-batch in a step: the backward adds into the
        accumulators, so a pass run twice (torch's runtime shape inference runs one when a stage's shapes are not
        given) would double its gradients silently."""
        if (what, micro) in self.ran:
            raise RuntimeError(f"pipeline stage {self.graphs.index} ran the {what} of micro-batch {micro} twice")
        self.ran.append((what, micro))
        if self.on_pass is not None:
            self.on_pass(self.graphs.index, what, micro)

    def forward(self, *received: torch.Tensor, micro: torch.Tensor) -> Any:
        # `micro` is torch's chunk of the step's `arange(M)` index (`run_schedule`): a view whose offset into it is
        # the micro-batch's index. Read from the view, not the data, so that the plan's run on fake tensors
        # (`plan.stage_plan`) runs it as well.
        return _RunStage.apply(self, micro.storage_offset(), self.anchor, *received)

    def run(
        self,
        gm: fx.GraphModule,
        sources: list[Source],
        micro: int,
        *,
        received: Sequence[torch.Tensor] = (),
        saved: Sequence[torch.Tensor] | dict[int, torch.Tensor] = (),
        grads: Sequence[torch.Tensor] | dict[int, torch.Tensor] = (),
        stash: Sequence[torch.Tensor] | dict[int, torch.Tensor] = (),
    ) -> list[torch.Tensor]:
        given = {"recv": received, "saved": saved, "grad": grads, "stash": stash}
        batch = self.micro_batches[micro]
        args = [self.feed(j, batch) if kind == "step" else given[kind][j] for kind, j in sources]
        start = time.perf_counter()
        with torch.no_grad():
            out = list(gm(*args) if self.run_graph is None else self.run_graph(gm, args))
        self.busy_s += time.perf_counter() - start
        return out


def the_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
    """The schedule's loss function: the last stage's graph already ends in the loss (each micro-batch's share of
    the step's mean over its counted tokens), so the schedule's target is not read."""
    return output


def build_schedule(stages: list[Any], schedule: str, n_micro: int, group: Any, device: torch.device) -> Any:
    """torch's `PipelineStage` around each of this rank's `stages` (`GraphStage`s, or the eager pipeline's stages:
    each gives its `index`, `num_stages`, the tensors it `received` and `sent` as examples, and its `dw_builder`) on
    `group` (the pp ranks), under torch's `schedule` (`SCHEDULES`: one stage, or several under a `MULTI_STAGE` one)
    for `n_micro` micro-batches a step.

    Every shape is given (the activations each stage receives and sends), so torch runs no forward or backward of
    its own to infer them; gradients are not scaled by the micro-batch count, since each micro-batch's loss is
    already its share of the step's mean."""
    from torch.distributed.pipelining import PipelineStage, schedules

    def like(values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(v.shape, dtype=v.dtype, device=device, requires_grad=True) for v in values)

    torch_stages = [
        PipelineStage(
            stage, stage.index, stage.num_stages, device, input_args=like(stage.received),
            output_args=like(stage.sent), group=group, dw_builder=stage.dw_builder,
        )
        for stage in stages
    ]  # fmt: skip
    for stage, torch_stage in zip(stages, torch_stages, strict=True):
        stage.torch_stage = torch_stage
    run = torch_stages if schedule in MULTI_STAGE else torch_stages[0]
    return getattr(schedules, SCHEDULES[schedule])(run, n_micro, loss_fn=the_loss, scale_grads=False)


def run_schedule(schedule: Any, stages: list[GraphStage], micro_batches: list[dict[str, Any]]) -> list[torch.Tensor]:
    """One step's micro-batches through `schedule` (`build_schedule`) on this rank's `stages`; each stage's backward
    adds into the accumulators its `feed` returns. The micro-batches' losses, in order, on the rank of the last
    stage ([] elsewhere)."""
    for stage in stages:
        stage.begin_step(micro_batches)
    index = torch.arange(len(micro_batches))  # torch's schedule cuts it into one view per micro-batch
    losses: list[torch.Tensor] = []
    last = any(stage.is_last for stage in stages)
    schedule.step(micro=index, target=index if last else None, losses=losses, return_outputs=False)
    return [loss.detach() for loss in losses]


def make_buffers(schedule: Any, stages: list[Any], n_micro: int) -> bool:
    """torch's receive buffers on this rank's `stages` (`held_tensors`), made as `schedule`'s first step makes them
    (its stages' forward and backward set-up, shapes given: nothing runs), so that a plan of the step after the
    first need not run the first (`plan.stage_plan`). False, and nothing made, where this torch's schedule has no
    such set-up (the plan then runs a first step); an error inside the set-up is raised."""
    index = torch.arange(n_micro)[:1]  # the first micro-batch's chunk, as `run_schedule`'s step cuts it
    target = index if any(stage.is_last for stage in stages) else None
    set_up = getattr(schedule, "_initialize_stages", None) or getattr(schedule, "_initialize_stage", None)
    if set_up is None:  # pragma: no cover - another torch's runtime
        return False
    if "target" in inspect.signature(set_up).parameters:  # torch 2.13 sets up the loss's backward with the target
        set_up((), {"micro": index}, target)
    else:  # pragma: no cover - an older torch's set-up takes the inputs only
        set_up((), {"micro": index})
    return True


def step_inputs(
    layout: InputLayout, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], accums: list
) -> Callable[[int, list[torch.Tensor]], torch.Tensor]:
    """`GraphStage`'s feed: the whole micro-step graph's i-th input, from the live parameters and buffers (by name),
    the micro-batch's tensors (`batch_tensors` order), and the accumulators (`accums`, one per trainable parameter,
    a list the caller refills)."""
    n_params, n_buffers, n_batch = len(layout.param_names), len(layout.buffer_names), layout.num_batch

    def feed(i: int, batch: list[torch.Tensor]) -> torch.Tensor:
        if i < n_params:
            return params[layout.param_names[i]]
        i -= n_params
        if i < n_buffers:
            return buffers[layout.buffer_names[i]]
        i -= n_buffers
        if i < n_batch:
            return batch[i]
        return accums[i - n_batch - layout.num_opt_state - layout.num_scalars]

    return feed


class PipelinedStep:
    """The training step of one pipeline stage (the step protocol, `graph_trainer.step.TrainStep`).

    Each step cuts the local batch into micro-batches, runs them through torch's schedule on this rank's stage of the
    traced micro-step (`GraphStage`, cut from the graph `graph_step` traces; cut again when it retraces), clips by
    the norm over every stage's gradients, and updates this stage's parameters (`optimizer` skips the others: they
    get no gradient). The loss is the last stage's, summed over the pp ranks so that every rank returns it.

    The clip norm is the one process's to the bit: each stage's per-parameter norms are gathered and reduced in the
    whole model's order, as `clip_grads_` reduces them, so the clipped gradients and the update are bitwise those
    of one process accumulating the same micro-batches (tests/distributed/test_pipeline.py).
    """

    def __init__(
        self,
        graph_step: Any,
        mesh: Mesh,
        model: nn.Module,
        *,
        n_layers: int,
        schedule: str,
        n_micro: int,
        per_rank: int = 1,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        parallel: Any = None,
    ):
        self.graph_step, self.mesh, self.model, self.n_layers = graph_step, mesh, model, n_layers
        # The job's parallelisms (`ParallelModel`): told which parameters the cut removed, and every stage's norms.
        self.parallel = parallel
        self.schedule_name, self.n_micro = schedule, n_micro
        self.optimizer, self.max_norm = optimizer, max_norm
        self.pp, self.per_rank = mesh.size("pp"), per_rank
        self.local = local_stages(self.pp, per_rank, mesh.coordinate("pp"), schedule)
        self._traced: TracedStep | None = None
        # Refilled each step, read by the stages' feed: the accumulators, and the model's tensors by name (read
        # again each step, so a parameter replaced between steps is the one the graphs read).
        self._accums: list[torch.Tensor | None] = []
        self._params: dict[str, torch.Tensor] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self.stages: list[GraphStage] = []  # this rank's, made at the first trace's cut (`cut`)
        self.mine: set[str] = set()  # the trained parameters this rank holds
        self.rank_parameters: list[list[str]] = []  # every rank's, in the whole model's gradient order
        self.schedule_s: float | None = None  # the last step's time in torch's schedule

    def cut(self, traced: TracedStep) -> None:
        """This rank's stages of `traced`, torch's schedule around them, and each rank's parameter names (in the
        whole model's gradient order)."""
        n_stages = self.pp * self.per_rank
        stages = cut_stages(traced.gm, traced.layout, self.n_layers, n_stages)
        placed = [local_stages(self.pp, self.per_rank, r, self.schedule_name) for r in range(self.pp)]
        held = [{n for s in ranks for n in stages[s].parameters} for ranks in placed]
        self.rank_parameters = [[n for n in traced.layout.grad_names if n in names] for names in held]
        self.mine = set(self.rank_parameters[self.mesh.coordinate("pp")])
        removed = keep_only(self.model, self.mine, self.optimizer)
        if self.parallel is not None and removed:
            self.parallel.release(removed)
        feed = step_inputs(traced.layout, self._params, self._buffers, self._accums)
        defer = self.schedule_name in DEFERS_WEIGHTS
        self.stages = [GraphStage(stages[s], n_stages, feed, defer_weights=defer) for s in self.local]
        group = self.mesh.group("pp")
        self.schedule = build_schedule(self.stages, self.schedule_name, self.n_micro, group, self.mesh.device)
        self._traced = traced

    def prepare(self, micro: dict[str, Any], traced: TracedStep | None = None) -> TracedStep:
        """The micro-step graph (`traced`, or traced on `micro` when None), cut into this rank's stages."""
        if traced is None:
            traced = self.graph_step.ensure_traced(micro)
        self.cut(traced)
        return traced

    def reuse_trace(self, result: Any, source: str) -> None:
        """The micro-step graph the preflight traced and transformed on the meta model (`StagePlan.step_graph`): the
        first step cuts it rather than tracing again, when its signature fits (`GraphStep.reuse_trace`)."""
        self.graph_step.reuse_trace(result, source)

    def workspace_bytes(self) -> int:
        """cuBLAS's workspace on CUDA, made by the process's first matmul and held from then on (0 on CPU)."""
        graphs = [g for stage in self.stages for g in (stage.graphs.forward, stage.graphs.backward)]
        return max(workspace_bytes(g) for g in graphs)

    def __call__(self, batch: Any) -> StepOutput:
        step = self.graph_step
        micro = micro_batches(batch, self.n_micro, step.count_reduce)
        traced = step.ensure_traced(micro[0])
        return self.run(traced, micro)

    def run(self, traced: TracedStep, micro: list[dict[str, Any]], *, update: bool = True) -> StepOutput:
        """The step on its `micro`-batches with `traced` (cut first if it is new), the update left out when
        `update` is False (the per-stage plan adds it: torch's AdamW does not run on fake tensors)."""
        if traced is not self._traced:
            self.cut(traced)
        params = dict(self.model.named_parameters())
        self._params.clear()
        self._params.update(params)
        self._buffers.clear()
        self._buffers.update(self.model.named_buffers())
        mine = self.mine
        self._accums[:] = [torch.zeros_like(params[n]) if n in mine else None for n in traced.layout.grad_names]
        for name in mine:
            params[name].grad = None  # as zero_grad(set_to_none=True)
        return self._finish(traced.layout.grad_names, self._accums, self._run_schedule(micro), update=update)

    def _run_schedule(self, micro: list[dict[str, Any]]) -> list[torch.Tensor]:
        """The micro-batches through torch's schedule (its time kept for the bubble metric); the losses."""
        start = time.perf_counter()
        losses = run_schedule(self.schedule, self.stages, micro)
        self.schedule_s = time.perf_counter() - start
        return losses

    def _finish(
        self, names: Sequence[str], accums: list[torch.Tensor | None], losses: list[torch.Tensor], *, update: bool
    ) -> StepOutput:
        """After the schedule: reduce the gradients `accums` (one per trained parameter of the whole model, `names`
        in its gradient order, None for another stage's; the list is emptied), run the model's step update, clip by
        the norm over every stage, update, and return the step's loss on every rank."""
        params = dict(self.model.named_parameters())
        # Averaged over the replicas of this pipeline (dp_replicate), a gradient of another stage left None.
        reduce = self.graph_step.grad_reduce
        summed = reduce(list(accums)) if reduce is not None else list(accums)
        accums.clear()  # the gradients live on in `summed` and `.grad` only
        if self.graph_step.step_update is not None:  # a MoE's balancing bias: its stages' routers counted their tokens
            with torch.no_grad():
                self.graph_step.step_update(self.model)
        grads = [g for g in summed if g is not None]  # this rank's, in the whole model's order
        grad_norm = self._clip(tuple(names), grads)
        for name, grad in zip([n for n in names if n in self.mine], grads, strict=True):
            params[name].grad = grad
        if self.optimizer is not None and update:
            self.optimizer.step()
        # The last stage's rank holds the losses (rank 0 under a V); every rank returns their sum (0 + x is x).
        loss = sum_losses(losses) if losses else torch.zeros((), device=self.mesh.device)
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.mesh.group("pp"))
        return StepOutput(loss, grad_norm)

    def _clip(self, names: tuple[str, ...], grads: list[torch.Tensor]) -> torch.Tensor:
        """Clip this rank's `grads` by the norm over every rank's, reduced as one process reduces it."""
        mine = torch.stack(grad_norms(grads))
        width = max(len(p) for p in self.rank_parameters)
        padded = torch.zeros(width, dtype=mine.dtype, device=mine.device)
        padded[: len(mine)] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.pp)]
        dist.all_gather(gathered, padded, group=self.mesh.group("pp"))
        by_name = {
            n: g[i] for g, names in zip(gathered, self.rank_parameters, strict=True) for i, n in enumerate(names)
        }
        total = torch.linalg.vector_norm(torch.stack([by_name[n] for n in names]), 2.0)
        if self.parallel is not None:
            self.parallel.gathered_norms(by_name)
        if (reduce := self.graph_step.norm_reduce) is not None:  # sharded gradients: the norm over every shard
            total = torch.sqrt(reduce(total * total))
        scale_to_norm_(grads, total, self.max_norm)
        return total

    def report(self) -> StepReport:
        """Trace counts; no estimated peak of its own: the preflight plans the rank's stage (`plan.stage_plan`)."""
        s = self.graph_step.stats
        return StepReport(
            updates_inside=False, trace_count=s.count, trace_time_s=s.total_time_s, retrace_reasons=list(s.reasons)
        )

    def graph_nodes(self) -> None:
        """None: the step is several stage graphs, not one graph with an estimate at each node."""
        return None

    def held_blocks(self) -> list[int]:
        """The blocks this rank's stages hold, in order."""
        per_stage = stage_blocks(self.n_layers, self.pp * self.per_rank)
        return sorted(b for s in self.local for b in per_stage[s])

    def held_tensors(self) -> list[torch.Tensor]:
        """torch's receive buffers: each stage made at its first step one per micro-batch for the activation it
        receives and one for the gradient (`PipelineStage.args_recv_info`, `grad_recv_info`), and keeps them."""
        tables = [t for s in self.stages for t in (s.torch_stage.args_recv_info, s.torch_stage.grad_recv_info)]
        infos = [info for table in tables for chunk in table.values() for info in chunk]
        return [info.buffer for info in infos if isinstance(getattr(info, "buffer", None), torch.Tensor)]


def keep_only(model: nn.Module, names: set[str], optimizer: torch.optim.Optimizer | None = None) -> set[str]:
    """Remove from `model` (and from `optimizer`, its state included) every trainable parameter not in `names`,
    so that a rank holds its stage's parameters and their state only; the rest keep their whole-model names.
    Returns the names removed."""
    gone = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in names]
    for name, param in gone:
        owner, _, attr = name.rpartition(".")
        delattr(model.get_submodule(owner), attr)
        if optimizer is not None:
            optimizer.state.pop(param, None)
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if p is not param]
    return {name for name, _ in gone}


def meta_copy(model: nn.Module) -> nn.Module:
    """`model`'s structure with every parameter and buffer on the meta device, no tensor data copied: what the step
    traces when this rank holds only part of the model."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


class PipelineParallel(Parallelism):
    """Pipeline parallelism (`parallelism.pp`): each rank runs its stages of the traced micro-step (one, or several
    under the interleaved and zero-bubble schedules) under torch's schedule (`PipelinedStep`) and holds only their
    parameters and optimizer state. With dp_replicate, replicas of the pipeline average their gradients with
    replication's own hook (applied before this, so built for the whole model). The step traces a meta
    copy of the whole model (`traced_model`); the blocks of other stages are removed from the rank's model as the
    parallelism applies (before the optimizer makes their state), the rest of what other stages read (embedding,
    final norm, output) once the first trace's cut says which stage reads it."""

    kind = "pp"
    label = "pipeline"
    mesh_dim = "pp"
    shards_state = True  # a rank holds its stages' parameters and their state: about 1 / pp of them
    # The screen plans one process (`schedule_model` turns its plan into a rank's); exact rows plan every stage.
    screened_as = "staged"
    plans_apart = True  # each stage's plan differs: `plan.stage_plan` plans each (--dry-run) or its own (preflight)
    searched_options = ("pp_schedule",)
    SEARCHED_SCHEDULES = ("1F1B", "Interleaved1F1B")  # GPipe holds more for the same bubble; zero-bubble: not modelled

    def __init__(
        self,
        mesh: Mesh,
        model: nn.Module,
        layers: str | None,
        n_layers: int,
        schedule: str,
        n_micro: int,
        per_rank: int,
    ):
        self.mesh, self.model, self.n_layers, self.schedule, self.n_micro = mesh, model, n_layers, schedule, n_micro
        self.per_rank = per_rank
        self.step: PipelinedStep | None = None  # the step `wrap_step` made (its bubble is a step metric)
        self.whole = meta_copy(model)
        blocks = stage_blocks(n_layers, mesh.size("pp") * per_rank)
        mine = {b for s in local_stages(mesh.size("pp"), per_rank, mesh.coordinate("pp"), schedule) for b in blocks[s]}
        fqns = transformer_layers(model, layers)
        self.layers = next(iter(fqns)).rpartition(".")[0]  # the blocks' container (an eager stage's view keeps some)
        others = tuple(f"{fqn}." for fqn, i in fqns.items() if i not in mine)
        keep_only(model, {n for n, _ in model.named_parameters() if not n.startswith(others)})
        self.others = others  # the other stages' blocks, whose buffers the rank keeps unused (`holds`)

    @classmethod
    def apply(cls, model: nn.Module, mesh: Mesh, cfg: Any, plan: Any) -> PipelineParallel | None:
        """None at pp 1; else the stages' layout, after refusing in one line what cannot run with it yet.

        Raises:
            UserError: see `refuses`.
        """
        if mesh.size("pp") == 1:
            return None
        if (why := cls.refuses(cfg, model.args.n_layers)) is not None:
            raise UserError(why)
        p = cfg.parallelism
        n_layers = model.args.n_layers
        n_micro = micro_batch_count(cfg.training.local_batch_size, p.pp_microbatch_size, p.pp, p.pp_schedule)
        per_rank = stages_per_rank(p.pp_schedule, p.pp_stages_per_rank)
        layers = plan.layers if plan is not None else None
        return cls(mesh, model, layers, n_layers, p.pp_schedule, n_micro, per_rank)

    @classmethod
    def refuses(cls, cfg: Any, n_layers: int) -> str | None:
        """What pp > 1 cannot run with yet, its micro-batch count and its stages' split, in one line each (the
        trainer raises it, the layout search skips the candidate for it)."""
        from graph_trainer.job_config.batching import accumulation_steps

        p, c = cfg.parallelism, cfg.compile
        refused = [
            # An eager stage is the model's own modules; FSDP's and TP's eager forms gather around the whole
            # model's loss, which no stage but the last runs.
            (c.mode == "eager" and (p.dp_shard > 1 or p.tp > 1), "compile.mode eager beside dp_shard or tp",
             "--compile.mode trace"),
            (c.trace_optimizer, "compile.trace_optimizer", "--compile.trace_optimizer false"),
            (c.backend != "none", f"compile.backend {c.backend}", "--compile.backend none"),
            (accumulation_steps(cfg) > 1, "gradient accumulation (its micro-batches are the pipeline's)",
             "--training.global_batch_size -1"),
            (cfg.validation.enable, "validation", "--validation.enable false"),
            # A size is one rank's whole peak, which differs from position to position and with each position's
            # choice: not solved yet. A fraction is one process's choice at a micro-batch (`one_micro_batch`).
            (cfg.activation_checkpoint.mode == "budget"
             and parse_memory_budget(cfg.activation_checkpoint.memory_budget).peak_bytes is not None,
             f"a size memory_budget ({cfg.activation_checkpoint.memory_budget})",
             "a fraction (--activation_checkpoint.memory_budget 0.5: one process's choice at a micro-batch)"),
        ]  # fmt: skip
        for bad, what, fix in refused:
            if bad:
                return f"parallelism.pp > 1 with {what} is not supported yet; pass {fix} or --parallelism.pp 1"
        try:
            micro_batch_count(cfg.training.local_batch_size, p.pp_microbatch_size, p.pp, p.pp_schedule)
            job_stage_blocks(cfg, n_layers)
        except UserError as e:
            return str(e)
        return None

    @classmethod
    def search_options(
        cls, degrees: Mapping[str, int], accumulation: int, offered: Mapping[str, tuple[Any, ...]]
    ) -> dict[str, tuple[Any, ...]]:
        """The schedules the search models (`SEARCHED_SCHEDULES`, or those asked for), at micro-batches of one
        sequence (the most micro-batches: the smallest bubble and in-flight activations)."""
        if degrees.get(cls.mesh_dim, 1) == 1:
            return {}
        return {"pp_schedule": offered.get("pp_schedule", cls.SEARCHED_SCHEDULES)}

    @classmethod
    def describe_options(cls, options: Mapping[str, Any]) -> tuple[str, str]:
        """', 1F1B': the schedule, in the shape's words."""
        return (f", {options['pp_schedule']}" if "pp_schedule" in options else ""), ""

    @classmethod
    def schedule_model(
        cls, degrees: Mapping[str, int], options: Mapping[str, Any], local_batch: int, sequence_bytes: int
    ) -> ScheduleModel | None:
        """A rank's step under the schedule, from one process's plan of one micro-batch (docs/planner.md, "Pipeline
        parallelism"). With P stages positions, v stages a rank and M micro-batches, position 0 holds the most:
        - in flight, P micro-batches of 1 / P of the blocks under 1F1B (the whole model's activations of one
          micro-batch), all M under GPipe, and under Interleaved1F1B its (v - 1) P + 2 (P - 1) warm-up forwards
          and one more, each of 1 / (v P) of the blocks (torch's warm-up count);
        - the bubble is (P - 1) / (v M) of the compute (P - 1 stage-times at the start and end of the step);
        - each micro-batch's activation goes forward and its gradient back across every boundary of its stages;
          torch's stage keeps a receive buffer per micro-batch (held from step to step).
        The state is 1 / P of the whole model's (the embedding and output ride on the end stages), and the work
        M / P micro-batches' worth."""
        pp = degrees.get(cls.mesh_dim, 1)
        if pp == 1:
            return None
        schedule = options.get("pp_schedule", "1F1B")
        micro = options.get("pp_microbatch_size", 1)
        per_rank = stages_per_rank(schedule, options.get("pp_stages_per_rank", 2))
        count = max(local_batch // micro, 1)
        if schedule == "GPipe":
            in_flight = count / pp
        elif per_rank == 1:
            in_flight = min(pp, count) / pp
        else:
            in_flight = min(count * per_rank, (per_rank - 1) * pp + 2 * (pp - 1) + 1) / (per_rank * pp)
        return ScheduleModel(
            micro_batch=micro,
            work=count / pp,
            state=1 / pp,
            in_flight=in_flight,
            held_bytes=count * per_rank * micro * sequence_bytes,
            idle=(pp - 1) / (per_rank * count),
            p2p_bytes=2 * per_rank * count * micro * sequence_bytes,
            p2p_key=f"{cls.kind} send_recv",
        )

    @classmethod
    def planned_ranks(cls, world_size: int, degree: int) -> list[int]:
        """Each stage position's first rank (pp is the outermost mesh dimension): the replicas' plans are the same."""
        return [r * (world_size // degree) for r in range(degree)]

    def traced_model(self, model: nn.Module) -> nn.Module:
        return self.whole

    def step_metrics(self, model: nn.Module) -> dict[str, float]:
        """`pp_bubble_pct`: the share of the last schedule's time a rank spent outside its stages' graphs, the
        largest over the ranks (a collective); none for eager stages, whose busy time is not measured."""
        step = self.step
        if step is None or step.schedule_s is None or any(stage.busy_s is None for stage in step.stages):
            return {}
        busy = sum(stage.busy_s for stage in step.stages)
        idle = torch.tensor(100.0 * max(step.schedule_s - busy, 0.0) / step.schedule_s, device=self.mesh.device)
        dist.all_reduce(idle, op=dist.ReduceOp.MAX, group=self.mesh.group("pp"))
        return {"pp_bubble_pct": float(idle)}

    def splits_model(self) -> bool:
        return True

    def holds(self, name: str) -> bool:
        """Not another stage's block's tensors: their buffers (a router's balancing bias) stay on the rank's model,
        never updated there; the rank of their stage checkpoints them."""
        return not name.startswith(self.others)

    def micro_batches_per_step(self) -> int:
        return self.n_micro

    def shard_sum(self) -> Callable[[float], float]:
        """A sum over the stages (each holds its own parameters): the divergence guard's norm, the same on every
        rank."""

        def over_stages(value: float) -> float:
            total = torch.tensor(value, dtype=torch.float64, device=self.mesh.device)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.mesh.group("pp"))
            return total.item()

        return over_stages

    def runs_step(self) -> bool:
        return True

    def wrap_step(
        self, step: Any, optimizer: torch.optim.Optimizer | None, max_norm: float, parallel: Any
    ) -> PipelinedStep:
        """`step` run as this rank's pipeline stages: the traced step cut into stages (`PipelinedStep`), or a step
        that builds its own (`step.pipelined`: the eager step's, `eager_pipeline`)."""
        options = dict(
            n_layers=self.n_layers, schedule=self.schedule, n_micro=self.n_micro, per_rank=self.per_rank,
            optimizer=optimizer, max_norm=max_norm, parallel=parallel,
        )  # fmt: skip
        if (pipelined := getattr(step, "pipelined", None)) is not None:
            self.step = pipelined(self.mesh, self.model, self.whole, self.layers, **options)
        else:
            self.step = PipelinedStep(step, self.mesh, self.model, **options)
        return self.step


__all__ = [
    "SCHEDULES",
    "split_backward",
    "GraphStage",
    "PipelineParallel",
    "PipelinedStep",
    "StageGraphs",
    "build_schedule",
    "keep_only",
    "local_stages",
    "meta_copy",
    "cut_stages",
    "micro_batch_count",
    "one_micro_batch",
    "run_schedule",
    "stage_blocks",
    "job_stage_blocks",
    "short_counts",
    "stages_per_rank",
    "step_inputs",
    "the_loss",
    "without_stages",
]
