"""The pass pipeline: run the registered passes in their fixed order on each fresh trace.

The pipeline (not the passes) decides the order. For each enabled pass it logs
the time and the node-count change, checks the graph it left (`Graph.lint()`, and
no graph input written that was not written before: see passes/README.md), and
with `compile.dump_graphs` writes the graph's code before and after it. A broken
rule is a `PassError` naming the pass and the passes that ran before it. Finally it estimates the step's peak memory
and, with `compile.log_saved_activations`, prints the tensors kept for the
backward. It returns both: `Transformed(traced, memory_estimate)`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch.fx

from graph_trainer.errors import ConfigError, did_you_mean
from graph_trainer.job_config.schema import ActivationCheckpointConfig, ParallelismConfig
from graph_trainer.observability.log import get_logger
from graph_trainer.observability.units import MIB
from graph_trainer.optimizer.update_memory import Accumulation, EagerUpdate
from graph_trainer.passes.activation_checkpoint import policy_name
from graph_trainer.passes.budget_depth import BlockChoice
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import TracedStep
from graph_trainer.tracer.executor import Transformed
from graph_trainer.tracer.graph_utils import count_nodes, mutated_args, node_by_name
from graph_trainer.tracer.memory_estimate import estimate_peak_memory, saved_tensors
from graph_trainer.tracer.summary import graph_summary

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class PassConfig:
    """The configuration sections passes may read (each pass declares which keys in `GraphPass.reads`)."""

    ac: ActivationCheckpointConfig
    parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
    # The budget's choice the plan solved on the short traces of a deep model (`passes.budget_depth`), or None.
    budget_choice: BlockChoice | None = None
    # The AdamW update run after the graph (None: traced into it): its state is alive through the graph without
    # being one of its inputs, which a whole-step size budget must leave room for (`passes/budget.py`).
    eager_update: EagerUpdate | None = None
    # With gradient accumulation, the step's micro-batches: what is alive beside each micro-step, which a whole-step
    # size budget must leave room for too (`passes/budget.py`, `Accumulation`).
    accumulation: Accumulation | None = None


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass may read besides the graph: the configuration and one memory category per graph input."""

    config: PassConfig
    input_categories: list[str]


# The pipeline's stages, in order; each pass belongs to one. The clean-up passes read no option, so the pipeline of
# every AC mode starts with the same ones: the planner cleans a trace once and plans each mode from there
# (`graph_trainer.stages.transform(..., until=CLEAN_UP)`, then `after=CLEAN_UP`).
CLEAN_UP, DECIDE, APPLY = "clean-up", "decide", "apply"  # tidy the graph; tag save/recompute; act on the tags
STAGES = (CLEAN_UP, DECIDE, APPLY)


@dataclasses.dataclass(frozen=True)
class GraphPass:
    """A registered pass: `run(gm, ctx) -> gm`, its name, numerics promise, when it is on, and its contract.

    `enabled(config)` decides from the configuration alone whether the pass runs; `reads` names the config
    keys it reads. `needs` are facts an earlier pass of the pipeline must give (`gives`), e.g. the recompute
    tags `remat` acts on: a pipeline where none does is refused before anything is traced. `stage` is the part
    of the pipeline it runs in (`STAGES`).
    """

    name: str
    run: Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]
    preserves_numerics_bitwise: bool
    enabled: Callable[[PassConfig], bool]
    doc: str
    reads: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    gives: tuple[str, ...] = ()
    stage: str = DECIDE


class PassError(RuntimeError):
    """A pass broke a rule every pass keeps (a bug in the pass, not the user's input)."""


# Passes merged into another, by their old name: `compile.disable_passes` names the new one.
RENAMED = {"activation_checkpoint": "memory_policy", "memory_budget": "memory_policy"}


def check_needs(passes: list[GraphPass], registry: list[GraphPass]) -> None:
    """Raise ConfigError naming the first pass whose needs no earlier pass of `passes` gives (and the passes of
    `registry` that would give them)."""
    given: dict[str, str] = {}
    for p in passes:
        for fact in p.needs:
            if fact not in given:
                givers = sorted({q.name for q in registry if fact in q.gives} or {"an earlier pass"})
                raise ConfigError(
                    f"pass {p.name!r} needs {fact}, which no pass before it gives (passes: "
                    f"{', '.join(q.name for q in passes)}); {', '.join(givers)} must run first: check "
                    "compile.disable_passes"
                )
        given.update({fact: p.name for fact in p.gives})


def check_disabled(names: list[str], registry: list[GraphPass]) -> None:
    """Raise ConfigError for a `compile.disable_passes` entry that names no pass (or a renamed one)."""
    known = [p.name for p in registry]
    for name in names:
        if name in RENAMED:
            raise ConfigError(
                f"compile.disable_passes: pass {name!r} is now part of {RENAMED[name]!r}; "
                f"write --compile.disable_passes {RENAMED[name]}"
            )
        if name not in known:
            raise ConfigError(
                f"compile.disable_passes: unknown pass {name!r}{did_you_mean(name, known)}; "
                f"available passes: {', '.join(known)}"
            )


class Pipeline:
    """Callable TracedStep -> Transformed running `passes` in order (see module docstring).

    Args:
        passes: the passes to run, in order.
        config: the configuration the passes read.
        dump_dir: where each trace's graphs are written (one `trace_<n>` folder each), or None.
        log_saved_activations: log the tensors kept for the backward after the passes.
    """

    def __init__(
        self,
        passes: list[GraphPass],
        config: PassConfig,
        *,
        dump_dir: Path | None = None,
        log_saved_activations: bool = False,
    ):
        self.passes = passes
        self.config = config
        self.dump_dir = dump_dir
        self.log_saved_activations = log_saved_activations
        self.runs = 0  # traces transformed so far; names the dump subfolder

    def part(self, *, until: str | None = None, after: str | None = None) -> Pipeline:
        """The passes of the stages after `after` up to `until` included (None: from the first, to the last), as a
        pipeline of their own (same config, saved-activations log; no dumps: those number whole runs)."""
        for stage in (until, after):
            if stage is not None and stage not in STAGES:
                raise ValueError(f"no pipeline stage {stage!r}; the stages are {', '.join(STAGES)}")
        first = STAGES.index(after) + 1 if after is not None else 0
        last = STAGES.index(until) if until is not None else len(STAGES) - 1
        passes = [p for p in self.passes if first <= STAGES.index(p.stage) <= last]
        return Pipeline(passes, self.config, log_saved_activations=self.log_saved_activations)

    def __call__(self, traced: TracedStep) -> Transformed:
        self.runs += 1
        ctx = PassContext(self.config, traced.layout.categories)
        gm = traced.gm
        dump = self.dump_dir / f"trace_{self.runs}" if self.dump_dir is not None else None
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            _dump(gm, dump / "00_traced.py")
        gm = self.run_passes(gm, ctx.input_categories, dump=dump)
        est = estimate_peak_memory(gm, input_categories=ctx.input_categories)
        logger.info(
            f"memory estimate: peak {est.peak_bytes / MIB:.2f} MiB at {est.peak_node} "
            f"({est.peak_module_fqn or 'top level'}), saved for backward {est.saved_bytes / MIB:.2f} MiB"
        )
        if self.log_saved_activations:
            logger.info(saved_activation_report(gm))
        if dump is not None:
            (dump / "summary.txt").write_text(graph_summary(gm) + "\n" + est.summary() + "\n")
            (dump / "saved_tensors.txt").write_text(saved_activation_report(gm, limit=None) + "\n")
            logger.info(f"graphs written to {dump}")
        return Transformed(dataclasses.replace(traced, gm=gm), est)

    def run_passes(
        self, gm: torch.fx.GraphModule, input_categories: list[str], *, dump: Path | None = None
    ) -> torch.fx.GraphModule:
        """The passes run in order on `gm` (each checked and logged, as in `__call__`), without the estimate.

        The planner runs a pipeline in parts: the passes that do not depend on the AC mode once for every mode.
        """
        ctx = PassContext(self.config, input_categories)
        written = written_inputs(gm)
        for i, p in enumerate(self.passes, start=1):
            before = count_nodes(gm)
            start = time.perf_counter()
            gm = p.run(gm, ctx)
            elapsed = time.perf_counter() - start
            self._check(gm, i, written)
            after = count_nodes(gm)
            logger.info(f"pass {p.name}: {elapsed * 1000:.1f} ms, ops {before} -> {after} ({after - before:+d})")
            if dump is not None:
                _dump(gm, dump / f"{i:02d}_after_{p.name}.py")
        return gm

    def _check(self, gm: torch.fx.GraphModule, index: int, written: set[str]) -> None:
        """PassError unless the graph the `index`-th pass left is well formed and writes no new graph input."""
        name = self.passes[index - 1].name
        earlier = ", ".join(p.name for p in self.passes[: index - 1]) or "none"
        try:
            gm.graph.lint()
        except Exception as e:
            problem = str(e).strip().splitlines()[0]  # lint's message goes on to print the whole graph
            raise PassError(f"pass {name!r} left an invalid graph ({problem}); passes run before it: {earlier}") from e
        new_writes = written_inputs(gm) - written
        if new_writes:
            raise PassError(
                f"pass {name!r} writes graph inputs the traced step did not write ({sorted(new_writes)}); "
                f"passes run before it: {earlier}"
            )


def written_inputs(gm: torch.fx.GraphModule) -> set[str]:
    """Names of the graph inputs some op writes into (the traced update's parameters and state, ...)."""
    placeholders = set(gm.graph.find_nodes(op="placeholder"))
    # An op writing an input uses it: the inputs' users are the only ops to ask (not every node, after every pass).
    return {a.name for p in placeholders for n in p.users for a in mutated_args(n) if a in placeholders}


def _dump(gm: torch.fx.GraphModule, path: Path) -> None:
    path.write_text(gm.print_readable(print_output=False, include_stride=True, include_device=True))


def saved_activation_report(gm: torch.fx.GraphModule, limit: int | None = 50) -> str:
    """The tensors the step keeps for the backward, largest first, then totals per layer."""
    saved = saved_tensors(gm)
    nodes = node_by_name(gm)
    per_layer: dict[str, int] = defaultdict(int)
    lines = [
        f"saved activations: {len(saved)} tensors, {sum(s.nbytes for s in saved) / MIB:.2f} MiB",
        f"  {'bytes':>12}  {'dtype':<9} {'shape':<22} {'policy':<9} {'op':<40} module",
    ]
    for i, s in enumerate(saved):
        node = nodes[s.node]
        layer = node_meta.layer_id(node)
        per_layer["outside layers" if layer is None else f"layer {layer}"] += s.nbytes
        if limit is None or i < limit:
            lines.append(
                f"  {s.nbytes:>12,}  {str(s.dtype).removeprefix('torch.'):<9} {str(list(s.shape)):<22} "
                f"{policy_name(node):<9} {s.op:<40} {s.module_fqn}"
            )
    if limit is not None and len(saved) > limit:
        lines.append(f"  ... {len(saved) - limit} smaller tensors")
    lines.append("  per layer:")
    for name, nbytes in sorted(per_layer.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {nbytes / MIB:>10.2f} MiB  {name}")
    return "\n".join(lines)
