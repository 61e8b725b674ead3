"""A plan whose cost does not grow with depth: trace 3 and 4 blocks, prove the blocks identical, extend to L.

A model of L identical transformer blocks is planned from two short traces of the same job, with 3 and 4
blocks, each traced once and shared by every activation-checkpointing mode (the trace does not depend on
the mode; only the passes do). Each node of a short step graph gets a key: the class of its block (`first`,
`mid_first` = block 1, `mid_last` = block k-2, `last`, or `outside` for the embedding, loss and global
ops) and its rank among the nodes of that class. The keys of the 3- and 4-block graphs must match one to
one, node for node (op, shapes, phase, module, policy), and the middle blocks of each graph must hold the same
sequence of ops and shapes, before and after the passes: that is the proof that the middle blocks are identical
and the first and last the same at any depth (they may differ from the middle ones: FSDP's prefetch leaves the
last block's gathered parameters alive into its backward). Otherwise the plan falls back to a full trace.

Why two depths suffice, exactly: at a node of a `first`, `last` or `outside` class, what is alive from the
other blocks is one identical contribution per middle block (their parameters and optimizer state, the
activations they saved, the gradients they made), so the live bytes there are affine in L. Inside the
middle blocks they are affine in the block's index, so their maximum is at the first or the last middle
block, which is what `mid_first` and `mid_last` are. Every count the plan reports is then affine in L and
known at L = 3 and 4: the live bytes at each key (hence the peak, its place and its categories), the
saved bytes, the FLOPs, the bytes per collective kind, and the eager update's state and scratch. This
assumes no storage lives from one block into the block after next; the tests check the result against
full traces at 8 and 16 blocks, and 8B dimensions at 8 blocks, to the byte.

The `budget` mode is the exception: its pass chooses what to recompute from the whole step's peak, so its
plan is approximated from the none and full plans: an upper bound, marked approximate (its error is measured
in tests/plan/test_block_plan.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import time
from collections import Counter
from collections.abc import Iterable

import torch
import torch.fx

from graph_trainer.builder import Job, build_job
from graph_trainer.distributed.mesh import Mesh
from graph_trainer.errors import ConfigError, UserError
from graph_trainer.job_config.batching import accumulation_steps
from graph_trainer.job_config.load import resolve_model_args
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.log import get_logger, quiet
from graph_trainer.observability.units import GIB
from graph_trainer.optimizer.update_memory import EagerUpdate
from graph_trainer.passes import build_pipeline
from graph_trainer.passes.communication import communication_bytes
from graph_trainer.passes.graph_utils import ATTENTION_OPS, graph_module, lazy_codegen, node_flops, tensors
from graph_trainer.passes.memory_estimate import MemoryEstimate, estimate_peak_memory, live_by_category
from graph_trainer.passes.pipeline import GraphPass, Pipeline
from graph_trainer.passes.remat import remat_graph
from graph_trainer.plan.step_plan import (
    AC_MODES,
    StepPlan,
    eager_update_of,
    extra_compiled_bytes,
    finish_plan,
    meta_batch,
    node_blocks,
    peak_location,
    plan_of,
    plan_step,
    with_ac_mode,
)
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import TracedStep
from graph_trainer.tracer.executor import Transformed

logger = get_logger(__name__)

SHORT = (3, 4)  # the depths traced: 3 has one middle block, 4 has a first and a last middle block
APPROXIMATE_MODES = ("budget",)  # decided from the whole step's peak: not extended exactly


class NotUniform(Exception):
    """The short graphs do not prove the blocks identical; the reason says where they differ."""


def plan_modes(
    cfg: JobConfig, mesh: Mesh, modes: Iterable[str] = AC_MODES, *, log_passes: bool = False, fast: bool = True
) -> dict[str, StepPlan | UserError]:
    """One rank's plan of `cfg`'s step for each AC mode in `modes` (a mode that cannot be planned maps to its
    UserError), at a cost that does not grow with the number of blocks (see the module docstring).

    Deep models (more than 4 blocks) are extended from traces of 3 and 4 blocks; shallower ones, `fast` False,
    or blocks the short graphs do not prove identical are traced whole, once for all modes.
    """
    modes = list(modes)
    depth = resolve_model_args(cfg).n_layers
    if accumulation_steps(cfg) > 1:
        # The accumulating step is two graphs (a micro-step run k times, then the update); the extension reads one
        # whole-step graph. Each mode is planned whole: its cost grows with depth, not with k.
        return _planned_per_mode(cfg, mesh, modes, log_passes)
    if fast and depth > SHORT[-1]:
        try:
            with lazy_codegen():
                return _extended(cfg, mesh, modes, depth, log_passes)
        except NotUniform as e:
            logger.info(f"planning the whole depth: {e}")
    return _traced_whole(cfg, mesh, modes, log_passes)


def _traced_whole(cfg: JobConfig, mesh: Mesh, modes: list[str], log_passes: bool) -> dict[str, StepPlan | UserError]:
    """Trace all blocks once and plan every mode on a copy of the trace."""
    job = build_job(cfg, mesh, materialize=False)
    with lazy_codegen():
        return _planned_from_one_trace(job, modes, log_passes)


def _planned_from_one_trace(job: Job, modes: list[str], log_passes: bool) -> dict[str, StepPlan | UserError]:
    cfg = job.cfg
    traced, elapsed = _trace(job)
    out: dict[str, StepPlan | UserError] = {}
    for mode in modes:
        mode_job = job.with_config(with_ac_mode(cfg, mode))
        try:
            result = _transform(mode_job, traced, log_passes)
        except UserError as e:
            out[mode] = e
            continue
        out[mode] = plan_of(mode_job, result, elapsed, blocks_traced=job.model.args.n_layers)
    return out


def _planned_per_mode(
    cfg: JobConfig, mesh: Mesh, modes: list[str], log_passes: bool
) -> dict[str, StepPlan | UserError]:
    """Each mode's step traced and planned whole (`plan_step`)."""
    out: dict[str, StepPlan | UserError] = {}
    for mode in modes:
        try:
            out[mode] = plan_step(build_job(with_ac_mode(cfg, mode), mesh, materialize=False), log_passes=log_passes)
        except UserError as e:
            out[mode] = e
    return out


def _trace(job: Job) -> tuple[TracedStep, float]:
    """The job's step traced once, before any pass: what every AC mode's pipeline starts from."""
    step = job.graph_step(compile_stage=False)
    step.transform = None
    start = time.perf_counter()
    with quiet():
        traced = step.ensure_traced(meta_batch(job.cfg))
    return traced, time.perf_counter() - start


def _transform(job: Job, traced: TracedStep, log_passes: bool) -> Transformed:
    """`job`'s pass pipeline (its AC mode) run on a copy of `traced`, which stays as it was."""
    transform = job.graph_step(compile_stage=False).transform
    with contextlib.nullcontext() if log_passes else quiet():
        return transform(copy_traced(traced))


def copy_traced(traced: TracedStep) -> TracedStep:
    """A copy of a traced step whose graph the passes may rewrite: new nodes, the same fake values (so storage
    identity, which the memory estimate reads, is kept), and node metadata dicts of its own."""
    graph = torch.fx.Graph()
    value_map: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(traced.gm.graph, value_map)
    graph.output(out)
    for node in graph.nodes:
        for key in (node_meta.CUSTOM, node_meta.COLLECTIVE):
            if isinstance(node.meta.get(key), dict):
                node.meta[key] = dict(node.meta[key])
    return dataclasses.replace(traced, gm=graph_module(traced.gm, graph))


# The extension from two short depths.


@dataclasses.dataclass
class _Short:
    """One short depth planned for one mode: its job, final graph, estimate and eager update."""

    job: Job
    gm: torch.fx.GraphModule
    est: MemoryEstimate
    update: EagerUpdate | None
    keys: dict[tuple[str, int], int]  # node key -> index in graph order
    categories: list[str]


def _extended(cfg: JobConfig, mesh: Mesh, modes: list[str], depth: int, log_passes: bool):
    exact = [m for m in modes if m not in APPROXIMATE_MODES]
    if any(m in APPROXIMATE_MODES for m in modes):  # the budget is read off these two
        exact += [m for m in ("none", "full") if m not in exact]
    variants = [(mode, pin) for mode in exact for pin in _attention_pins(cfg, mode)]
    shorts: dict[int, dict[tuple[str, str], _Short | _Deferred | UserError]] = {}
    decisions: dict[int, dict[tuple[str, str], _Short]] = {}
    start = time.perf_counter()
    for k in SHORT:
        short_cfg = copy.deepcopy(cfg)
        short_cfg.model.n_layers = k
        job = build_job(short_cfg, mesh, materialize=False)
        shorts[k], decisions[k] = _plan_short(job, variants, log_passes and k == SHORT[-1])
    deep = _ArgsOnly(cfg, job)
    parts: dict[str, _Parts | UserError] = {}
    for mode in exact:
        pins = _attention_pins(cfg, mode)
        failed = next(
            (s[(mode, pin)] for s in shorts.values() for pin in pins if isinstance(s[(mode, pin)], UserError)), None
        )
        if failed is not None:
            parts[mode] = failed
            continue
        # As the pass decides at depth L: the lower peak of the graph it compares (rematerialized right after the
        # memory policy, before the passes that follow), saving attention on a tie (listed first).
        decisive = (
            [_peak({k: decisions[k][(mode, pin)] for k in SHORT}, depth)[1] for pin in pins] if len(pins) > 1 else [0]
        )
        pin = pins[decisive.index(min(decisive))]
        try:
            parts[mode] = _extend({k: _finished(shorts[k][(mode, pin)]) for k in SHORT}, depth)
        except UserError as e:
            parts[mode] = e
    elapsed = time.perf_counter() - start  # the whole plan, all modes together (they share the traces)
    out: dict[str, StepPlan | UserError] = {}
    for mode in modes:
        mode_job = deep.for_mode(mode)
        part = parts.get(mode) or _approximate_budget(mode_job.cfg, parts["none"], parts["full"])
        out[mode] = part if isinstance(part, UserError) else part.plan(mode_job, elapsed)
    return out


def _plan_short(
    job: Job, variants: list[tuple[str, str]], log_passes: bool
) -> tuple[dict[tuple[str, str], _Short | _Deferred | UserError], dict[tuple[str, str], _Short]]:
    """One short depth: traced once, then planned for each (AC mode, attention pin) of `variants` (see
    `_attention_pins`), with its blocks checked identical as traced and after each variant's passes.

    The passes that do not depend on the mode (the leading ones: dead code, no-ops) run once on the trace; each
    variant runs the rest on a copy (the last on the trace itself). A variant with a pin also gives the graph
    the `full` pass compares its two choices on (`_decision_short`), and with FSDP its passes after the memory
    policy are deferred until the choice is made at depth L (`_Deferred`). Returns the variants' shorts (or the
    UserError a variant's config raised) and the decision shorts.
    """
    k, layers = job.model.args.n_layers, job.spec.parallel_plan.layers
    pipelines: dict[tuple[str, str], Pipeline | UserError] = {}
    for variant in variants:
        try:
            pipelines[variant] = build_pipeline(_pinned(job.cfg, *variant), dump_dir=None)
        except UserError as e:
            pipelines[variant] = e
    traced, _ = _trace(job)
    _check_blocks(traced.gm, k, layers, "as traced")
    try:
        traced = job.parallel.check_traced(traced)
    except UserError as e:  # what the parallelism cannot run, whatever the mode
        return dict.fromkeys(variants, e), {}
    planned = [p for p in pipelines.values() if isinstance(p, Pipeline)]
    shared = _mode_independent(planned)
    with _logged(log_passes):
        if shared:
            gm = Pipeline(shared, planned[0].config).run_passes(traced.gm, traced.layout.categories)
            traced = dataclasses.replace(traced, gm=gm)
        shorts: dict[tuple[str, str], _Short | _Deferred | UserError] = {}
        decisions: dict[tuple[str, str], _Short] = {}
        last = max((i for i, v in enumerate(variants) if isinstance(pipelines[v], Pipeline)), default=-1)
        for i, variant in enumerate(variants):
            pipeline = pipelines[variant]
            if isinstance(pipeline, UserError):
                shorts[variant] = pipeline
                continue
            rest = pipeline.passes[len(shared) :]
            mine = traced if i == last else copy_traced(traced)  # the trace itself is not needed after
            mode_job = job.with_config(_pinned(job.cfg, *variant))
            try:
                shorts[variant], decision = _short(mode_job, mine, rest, pipeline, bool(variant[1]), log_passes)
            except UserError as e:
                shorts[variant] = e
                continue
            if decision is not None:
                decisions[variant] = decision
    return shorts, decisions


def _logged(log_passes: bool) -> contextlib.AbstractContextManager:
    """The passes' log as asked: shown (the preflight's step), else quiet (the other plans would only add noise)."""
    return contextlib.nullcontext() if log_passes else quiet()


def _mode_independent(pipelines: list[Pipeline]) -> list[GraphPass]:
    """The leading passes every pipeline of `pipelines` runs alike whatever its AC mode: the same passes, none
    of which reads `activation_checkpoint`."""
    shared: list[GraphPass] = []
    for passes in zip(*(p.passes for p in pipelines)):
        first = passes[0]
        if any(p is not first for p in passes) or any(r.startswith("activation_checkpoint") for r in first.reads):
            break
        shared.append(first)
    return shared if pipelines else []


def _short(
    job: Job, traced: TracedStep, passes: list[GraphPass], pipeline: Pipeline, decide: bool, log_passes: bool
) -> tuple[_Short | _Deferred, _Short | None]:
    """`traced` (one short depth, its mode-independent passes run) planned under `job`'s AC mode: `passes` run on
    it, its blocks checked identical after them. With `decide`, also the graph the `full` pass compares
    (`_decision_short`), taken right after the memory policy; where passes follow the policy before remat
    (FSDP's), the rest is deferred: only the variant chosen at depth L needs it."""
    names = [p.name for p in passes]
    split = names.index("memory_policy") + 1 if decide else 0
    if decide and names[split:] != ["remat"]:
        gm = Pipeline(passes[:split], pipeline.config).run_passes(traced.gm, traced.layout.categories)
        decision = _decision_short(job, gm, traced.layout.categories)
        return _Deferred(job, dataclasses.replace(traced, gm=gm), passes[split:], pipeline, log_passes), decision
    short = _finish(job, traced, passes, pipeline)
    # Nothing but remat after the policy (no FSDP): the graph the pass compares is the final one.
    return short, short if decide else None


def _finish(job: Job, traced: TracedStep, passes: list[GraphPass], pipeline: Pipeline) -> _Short:
    """`passes` (the rest of `pipeline`) run on `traced`, its blocks checked identical after them."""
    k, layers = job.model.args.n_layers, job.spec.parallel_plan.layers
    rest = Pipeline(passes, pipeline.config, log_saved_activations=pipeline.log_saved_activations)
    result = rest(traced)
    gm = result.traced.gm
    _check_blocks(gm, k, layers, f"after the passes of AC mode {job.cfg.activation_checkpoint.mode}")
    categories = traced.layout.categories
    return _Short(job, gm, result.memory_estimate, eager_update_of(job), _keys(gm, k, layers), categories)


@dataclasses.dataclass
class _Deferred:
    """A variant's short graph with its passes up to the memory policy run; the rest run if it is chosen."""

    job: Job
    traced: TracedStep
    passes: list[GraphPass]
    pipeline: Pipeline
    log_passes: bool

    def finish(self) -> _Short:
        with _logged(self.log_passes):
            return _finish(self.job, self.traced, self.passes, self.pipeline)


def _finished(short: _Short | _Deferred) -> _Short:
    return short.finish() if isinstance(short, _Deferred) else short


def _pinned(cfg: JobConfig, mode: str, pin: str) -> JobConfig:
    """`cfg` in AC mode `mode` with attention pinned saved ("save") or recomputed ("recompute"), or not ("")."""
    cfg = with_ac_mode(cfg, mode)
    if pin:
        ac = cfg.activation_checkpoint
        listed = ac.save_list if pin == "save" else ac.recompute_list
        listed.extend(f"aten.{packet.__name__}" for packet in sorted(ATTENTION_OPS, key=str))
    return cfg


def _decision_short(job: Job, gm: torch.fx.GraphModule, categories: list[str]) -> _Short:
    """The short graph as the `full` pass compares its two choices: `gm` (the passes up to the memory policy
    run) rematerialized (`passes.remat.peak_after_remat`'s graph, `gm` itself unchanged), with its keys and
    estimate."""
    graph = remat_graph(gm.graph)
    if graph is not None:
        gm = graph_module(gm, graph)
    est = estimate_peak_memory(gm, input_categories=categories)
    k, layers = job.model.args.n_layers, job.spec.parallel_plan.layers
    return _Short(job, gm, est, None, _keys(gm, k, layers), categories)


def _attention_pins(cfg: JobConfig, mode: str) -> list[str]:
    """The `full` pass saves or recomputes attention, whichever peaks lower at the model's depth (shallow
    models save it): plan both, pinned, and choose at full depth. "" (no pin) for every other mode, and when
    the user's recompute_list pins attention already (then the pass does not choose)."""
    pinned = any("attention" in p for p in cfg.activation_checkpoint.recompute_list)
    return ["save", "recompute"] if mode == "full" and not pinned else [""]


@dataclasses.dataclass
class _ArgsOnly:
    """What `finish_plan` reads of the deep job, without building it: its config and parameter count."""

    cfg: JobConfig
    short: Job

    def for_mode(self, mode: str) -> _ArgsOnly:
        return dataclasses.replace(self, cfg=with_ac_mode(self.cfg, mode))

    def num_params(self) -> int:
        return self.short.spec.num_params(resolve_model_args(self.cfg))


@dataclasses.dataclass
class _Parts:
    """A deep step's graph estimate, eager update, peak location, FLOPs and traffic, before `finish_plan`."""

    est: MemoryEstimate
    update: EagerUpdate | None
    location: tuple[int | None, str, str]
    flops: int
    comm: dict[str, int]
    approximate: bool = False

    def plan(self, job: _ArgsOnly, elapsed: float) -> StepPlan:
        return finish_plan(
            job,
            self.est,
            self.update,
            self.location,
            num_params=job.num_params(),
            flops=self.flops,
            comm=self.comm,
            trace_time_s=elapsed,
            blocks_traced=sum(SHORT),
            approximate=self.approximate,
        )


def _affine(at3: int, at4: int, depth: int) -> int:
    """The value at `depth` of what is `at3` at 3 blocks and `at4` at 4, one identical block apart."""
    return at3 + (depth - SHORT[0]) * (at4 - at3)


def _affine_dict(at3: dict[str, int], at4: dict[str, int], depth: int) -> dict[str, int]:
    out = {k: _affine(at3.get(k, 0), at4.get(k, 0), depth) for k in dict.fromkeys([*at4, *at3])}  # a stable order
    return {k: v for k, v in out.items() if v}


def _extend(shorts: dict[int, _Short], depth: int) -> _Parts:
    """The deep step's numbers from the two short ones (see the module docstring for why this is exact)."""
    s3, s4 = shorts[SHORT[0]], shorts[SHORT[1]]
    key, peak_bytes = _peak(shorts, depth)
    i3, i4 = s3.keys[key], s4.keys[key]
    peak_by_category = _affine_dict(
        live_by_category(s3.gm, i3, input_categories=s3.categories),
        live_by_category(s4.gm, i4, input_categories=s4.categories),
        depth,
    )
    est = MemoryEstimate(
        peak_bytes=peak_bytes,
        peak_node="",
        peak_op="",
        peak_module_fqn="",
        peak_bytes_by_category=peak_by_category,
        final_bytes_by_category=_affine_dict(s3.est.final_bytes_by_category, s4.est.final_bytes_by_category, depth),
        input_bytes=_affine(s3.est.input_bytes, s4.est.input_bytes, depth),
        saved_bytes=_affine(s3.est.saved_bytes, s4.est.saved_bytes, depth),
        timeline=(),
    )
    update = None
    if s3.update is not None:
        update = EagerUpdate(
            s3.update.implementation,
            _affine(s3.update.state_bytes, s4.update.state_bytes, depth),
            _affine(s3.update.scratch_bytes, s4.update.scratch_bytes, depth),
        )
    return _Parts(
        est,
        update,
        _deep_location(s4.gm, i4, key[0], depth, s4.job.spec.parallel_plan.layers),
        flops=_affine(_flops(s3.gm), _flops(s4.gm), depth),
        comm=_affine_dict(communication_bytes(s3.gm), communication_bytes(s4.gm), depth),
    )


def _peak(shorts: dict[int, _Short], depth: int) -> tuple[tuple[str, int], int]:
    """The deep step's graph peak (the compile stage's extra included) and the key of the node it is at.

    NotUniform unless the two short graphs have the same keys running the same ops."""
    s3, s4 = shorts[SHORT[0]], shorts[SHORT[1]]
    if s3.keys.keys() != s4.keys.keys():
        raise NotUniform("the 3- and 4-block graphs have different nodes outside the middle blocks")
    n3, n4 = list(s3.gm.graph.nodes), list(s4.gm.graph.nodes)
    # A block's node is the same op, shapes, phase, module and policy at both depths; outside the blocks only the
    # op must agree (some shapes there count the blocks: the clip's stack of per-parameter norms).
    for k, i in s4.keys.items():
        a, b = n3[s3.keys[k]], n4[i]
        if (a.target != b.target) if k[0] == "outside" else (_signature(a) != _signature(b)):
            raise NotUniform(f"node {k} differs between 3 blocks ({a.target}) and 4 ({b.target})")
    t3, t4 = s3.est.timeline, s4.est.timeline
    # The peak: the largest extended live bytes; ties go to the earliest node, as in the estimate (key order
    # in the 4-block graph is node order in the deep one).
    key = max(s4.keys, key=lambda k: (_affine(t3[s3.keys[k]], t4[s4.keys[k]], depth), -s4.keys[k]))
    compiled = _affine(extra_compiled_bytes(s3.job.cfg, s3.gm), extra_compiled_bytes(s4.job.cfg, s4.gm), depth)
    return key, _affine(t3[s3.keys[key]], t4[s4.keys[key]], depth) + compiled


def _approximate_budget(cfg: JobConfig, none: _Parts | UserError, full: _Parts | UserError) -> _Parts | UserError:
    """The `budget` mode's plan, approximated from the deep none and full plans (marked approximate).

    The pass recomputes until the graph's peak fits its target (inputs + `memory_budget` of the no-AC
    activations, or that many GiB), so the peak is taken as the target (at most none's; below full's the
    budget is reported infeasible, as the pass does for a target under its smallest probe); FLOPs and
    saved bytes are interpolated between none and full in the same proportion. The error against full
    traces is measured in tests/plan/test_block_plan.py.
    """
    if isinstance(none, UserError):
        return none
    if isinstance(full, UserError):
        return full
    budget = cfg.activation_checkpoint.memory_budget
    base = none.est.input_bytes
    target = base + (budget * (none.est.peak_bytes - base) if budget <= 1 else budget * GIB)
    if target < full.est.peak_bytes:  # the pass's smallest probe recomputes what full AC does
        return ConfigError(
            f"activation_checkpoint.memory_budget {budget} is infeasible (approximate, from the depth-free plan): "
            f"full AC's graph peak {full.est.peak_bytes / GIB:.4f} GiB is above the target "
            f"{target / GIB:.4f} GiB; raise the budget or lower the batch size"
        )
    peak = int(min(target, none.est.peak_bytes))
    span = none.est.peak_bytes - full.est.peak_bytes
    w = (none.est.peak_bytes - peak) / span if span > 0 else 0.0  # 0: as none, 1: as full

    def mix(a: int, b: int) -> int:
        return int(round(a + w * (b - a)))

    est = dataclasses.replace(
        none.est,
        peak_bytes=peak,
        saved_bytes=mix(none.est.saved_bytes, full.est.saved_bytes),
        peak_bytes_by_category={
            **none.est.peak_bytes_by_category,
            "activation": none.est.peak_bytes_by_category.get("activation", 0) - (none.est.peak_bytes - peak),
        },
    )
    comm = {k: mix(none.comm.get(k, 0), full.comm.get(k, 0)) for k in dict.fromkeys([*none.comm, *full.comm])}
    return _Parts(est, none.update, (None, "", "approximate"), mix(none.flops, full.flops), comm, approximate=True)


def _flops(gm: torch.fx.GraphModule) -> int:
    return sum(node_flops(n) for n in gm.graph.nodes)


def _deep_location(
    gm: torch.fx.GraphModule, index: int, cls: str, depth: int, layers: str | None
) -> tuple[int | None, str, str]:
    """The (layer, module, op) in the deep model of the `index`-th node of the 4-block graph, of class `cls`."""
    layer, module, op = peak_location(gm, index, layers)
    if layer is None:
        return layer, module, op
    deep = {"first": 0, "mid_first": 1, "mid_last": depth - 2, "last": depth - 1}[cls]
    if layers:
        module = re.sub(rf"(^|\.){re.escape(layers)}\.{layer}(?=\.|$)", rf"\g<1>{layers}.{deep}", module)
    return deep, module, op


# Node keys and the proof that the blocks are identical.


def _classes(layer: int | None, k: int) -> list[str]:
    """The block classes a node of block `layer` of a `k`-block graph stands for (block 1 of 3 is both middles)."""
    if layer is None:
        return ["outside"]
    if layer == 0:
        return ["first"]
    if layer == k - 1:
        return ["last"]
    return [c for c, j in (("mid_first", 1), ("mid_last", k - 2)) if j == layer]


def _keys(gm: torch.fx.GraphModule, k: int, layers: str | None) -> dict[tuple[str, int], int]:
    """Each running node's key (block class, rank among that class's nodes) -> its index in graph order."""
    seen: Counter = Counter()
    keys: dict[tuple[str, int], int] = {}
    per_layer: Counter = Counter()
    for i, _, layer in node_blocks(gm, layers):
        rank = per_layer[layer]
        per_layer[layer] += 1
        for cls in _classes(layer, k):
            if cls == "outside":
                rank = seen[cls]
                seen[cls] += 1
            keys[(cls, rank)] = i
    return keys


def _signature(node: torch.fx.Node) -> tuple:
    """What must agree between two blocks' nodes: the op, its outputs' shapes and dtypes, its place in the step,
    its module (block index left out) and what the memory policy made of it."""
    vals = tuple((tuple(t.shape), t.dtype) for t in tensors(node.meta.get("val")))
    module = re.sub(r"\.\d+(?=\.|$)", ".#", node_meta.module_fqn(node))
    return (
        str(node.target),
        vals,
        node_meta.phase(node),
        module,
        node.meta.get(node_meta.RECOMPUTE) is not None and str(node.meta.get(node_meta.RECOMPUTE)),
        node_meta.is_rematerialized(node),
    )


def _check_blocks(gm: torch.fx.GraphModule, k: int, layers: str | None, when: str) -> None:
    """NotUniform unless every middle block of the `k`-block graph holds the same op sequence (`_signature`).

    The first and the last block may differ from the middle ones (FSDP's prefetch: the last block's backward
    keeps the parameters its forward gathered, the others gather again); `_peak` then proves them the same at
    both short depths, key by key, which is all the extension needs."""
    blocks: dict[int, list[tuple]] = {}
    for _, node, layer in node_blocks(gm, layers):
        if layer is not None:
            blocks.setdefault(layer, []).append(_signature(node))
    if sorted(blocks) != list(range(k)):
        raise NotUniform(f"the {k}-block graph {when} tags blocks {sorted(blocks)}")
    for layer in range(2, k - 1):
        if blocks[layer] != blocks[1]:
            raise NotUniform(f"block {layer} of the {k}-block graph {when} differs from block 1")


__all__ = ["SHORT", "NotUniform", "copy_traced", "plan_modes"]
