"""The pass pipeline: run the registered passes in their fixed order on each fresh trace.

The pipeline (not the passes) decides the order. For each enabled pass it logs
the time and the node-count change, and with `compile.dump_graphs` writes the
graph's code before and after it. Finally it estimates the step's peak memory
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
from graph_trainer.job_config.schema import ActivationCheckpointConfig
from graph_trainer.observability.log import get_logger
from graph_trainer.observability.units import MIB
from graph_trainer.passes.activation_checkpoint import policy_name
from graph_trainer.passes.graph_utils import count_nodes, node_by_name
from graph_trainer.passes.memory_estimate import estimate_peak_memory, saved_tensors
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import TracedStep
from graph_trainer.tracer.executor import Transformed
from graph_trainer.tracer.summary import graph_summary

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass may read besides the graph: its config section and one memory category per input."""

    ac: ActivationCheckpointConfig
    input_categories: list[str]


@dataclasses.dataclass(frozen=True)
class GraphPass:
    """A registered pass: `run(gm, ctx) -> gm` plus its name, numerics promise and when it is on."""

    name: str
    run: Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]
    preserves_numerics_bitwise: bool
    enabled: Callable[[ActivationCheckpointConfig], bool]
    doc: str


# Passes merged into another, by their old name: `compile.disable_passes` names the new one.
RENAMED = {"activation_checkpoint": "memory_policy", "memory_budget": "memory_policy"}


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
        ac: the activation-checkpointing section the memory-policy pass reads.
        dump_dir: where each trace's graphs are written (one `trace_<n>` folder each), or None.
        log_saved_activations: log the tensors kept for the backward after the passes.
    """

    def __init__(
        self,
        passes: list[GraphPass],
        ac: ActivationCheckpointConfig,
        *,
        dump_dir: Path | None = None,
        log_saved_activations: bool = False,
    ):
        self.passes = passes
        self.ac = ac
        self.dump_dir = dump_dir
        self.log_saved_activations = log_saved_activations
        self.runs = 0  # traces transformed so far; names the dump subfolder

    def __call__(self, traced: TracedStep) -> Transformed:
        self.runs += 1
        ctx = PassContext(self.ac, traced.layout.categories)
        gm = traced.gm
        dump = self.dump_dir / f"trace_{self.runs}" if self.dump_dir is not None else None
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            _dump(gm, dump / "00_traced.py")
        for i, p in enumerate(self.passes, start=1):
            before = count_nodes(gm)
            start = time.perf_counter()
            gm = p.run(gm, ctx)
            elapsed = time.perf_counter() - start
            after = count_nodes(gm)
            logger.info(f"pass {p.name}: {elapsed * 1000:.1f} ms, ops {before} -> {after} ({after - before:+d})")
            if dump is not None:
                _dump(gm, dump / f"{i:02d}_after_{p.name}.py")
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
