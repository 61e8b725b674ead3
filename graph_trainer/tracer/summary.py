"""A readable summary of a traced step: node counts by phase, by op and by module."""

from __future__ import annotations

from collections import Counter

import torch.fx

from graph_trainer.tracer import node_meta


def graph_summary(gm: torch.fx.GraphModule, top: int = 25) -> str:
    """Op counts per phase, the most frequent ops per phase, and the modules with the most ops."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    by_phase = Counter(node_meta.phase(n) or "none" for n in ops)
    lines = [
        f"{len(ops)} ops, {sum(n.op == 'placeholder' for n in gm.graph.nodes)} inputs",
        "by phase: " + ", ".join(f"{p} {c}" for p, c in by_phase.most_common()),
    ]
    recomputed = sum(node_meta.is_rematerialized(n) for n in ops)
    if recomputed:
        lines.append(f"recomputed in the backward: {recomputed}")
    for phase in node_meta.PHASES:
        counts = Counter(str(n.target) for n in ops if node_meta.phase(n) == phase)
        if counts:
            lines.append(f"\n{phase} ops:")
            lines += [f"  {c:6d}  {op}" for op, c in counts.most_common(top)]
    modules = Counter(node_meta.module_fqn(n) or "(outside modules)" for n in ops)
    lines.append("\nops by module (forward + backward):")
    lines += [f"  {c:6d}  {m}" for m, c in modules.most_common(top)]
    return "\n".join(lines) + "\n"
