"""The memory timeline of one step: live bytes at every node of the step's graph, estimate against measurement.

On CPU there is no allocator history to snapshot; what this project can show instead is its own two
figures side by side: the static estimate of the step graph (`tracer.memory_estimate`, live bytes at
each node) and the bytes `LiveTensorTracker` measured after each op while the same graph ran. They
agree to the byte on CPU, so the picture shows where memory goes (forward activations piling up, the
peak in the backward, the optimizer's scratch) and that the plan the memory passes acted on was right.

Written for one step as `rank{r}_memory_timeline.json` (every node: name, op, module, phase, estimated
and measured bytes; both peaks) and `rank{r}_memory_timeline.png` (matplotlib, the `plots` extra).
A graph run op by op (compile.backend none) is measured node by node; a compiled one has the estimate
only, and an eager step (no graph) the measurement per op only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from graph_trainer.errors import ConfigError
from graph_trainer.observability.units import MIB
from graph_trainer.runtime.fsutil import atomic_write, atomic_write_text

PLOTS_HINT = "pip install 'graph_trainer[plots]' (matplotlib)"
_PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fbe3d6", "optimizer": "#e2f0d9"}


class Node(Protocol):
    """What the timeline reads of a graph node (`graph_trainer.step.GraphNode`)."""

    name: str
    op: str
    module_fqn: str
    phase: str | None
    estimated_bytes: int | None
    dispatches: Any


def require_matplotlib(option: str) -> None:
    """ConfigError in one line when matplotlib, which draws the timeline, is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{option} draws the memory timeline with matplotlib, which is not installed; {PLOTS_HINT}, "
            f"or set {option} = false"
        ) from None


def measured_per_node(nodes: Sequence[Node], ops: Sequence[tuple[Any, int]]) -> list[int | None] | None:
    """The measured live bytes after each node that dispatches an op (None elsewhere), found by lining the
    graph's ops up with the recorded ones; None when they do not line up (a compiled graph)."""
    wanted = [(i, n.dispatches) for i, n in enumerate(nodes) if n.dispatches is not None]
    funcs = [f for f, _ in ops]
    if not wanted or len(wanted) > len(funcs):
        return None
    sequence = [op for _, op in wanted]
    for start in range(len(funcs) - len(sequence) + 1):  # the step's own ops (inputs, the update) surround it
        if funcs[start] == sequence[0] and funcs[start : start + len(sequence)] == sequence:
            measured: list[int | None] = [None] * len(nodes)
            for k, (i, _) in enumerate(wanted):
                measured[i] = ops[start + k][1]
            return measured
    return None


def timeline_rows(
    nodes: Sequence[Node] | None, ops: Sequence[tuple[Any, int]], outside_bytes: int = 0
) -> list[dict[str, Any]]:
    """One row per graph node (or per recorded op, without a graph): what the JSON holds and the plot draws.

    `outside_bytes`: memory the measurement counts that is no graph input (the AdamW state of an update
    that runs after the graph), added to the estimate so that both count the same tensors."""
    if nodes is None:
        return [
            {"index": i, "name": f"op{i}", "op": str(f), "module": "", "phase": None, "estimated_bytes": None}
            | {"measured_bytes": live}
            for i, (f, live) in enumerate(ops)
        ]
    measured = measured_per_node(nodes, ops) or [None] * len(nodes)
    return [
        {
            "index": i,
            "name": n.name,
            "op": n.op,
            "module": n.module_fqn,
            "phase": n.phase,
            "estimated_bytes": None if n.estimated_bytes is None else n.estimated_bytes + outside_bytes,
            "measured_bytes": m,
        }
        for i, (n, m) in enumerate(zip(nodes, measured, strict=True))
    ]


def _peak(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    values = [r for r in rows if r[key] is not None]
    if not values:
        return None
    top = max(values, key=lambda r: (r[key], -r["index"]))  # the first node that reaches the peak
    return {"bytes": top[key], "index": top["index"], "node": top["name"], "op": top["op"], "module": top["module"]}


def summarize(rows: list[dict[str, Any]], step: int, rank: int, outside_bytes: int = 0) -> dict[str, Any]:
    """The JSON document: the rows, both peaks, and how far the measurement is from the estimate."""
    both = [r for r in rows if r["estimated_bytes"] is not None and r["measured_bytes"] is not None]
    return {
        "step": step,
        "rank": rank,
        "outside_graph_bytes": outside_bytes,
        "estimated_peak": _peak(rows, "estimated_bytes"),
        "measured_peak": _peak(rows, "measured_bytes"),
        "nodes_compared": len(both),
        "max_abs_difference_bytes": max((abs(r["estimated_bytes"] - r["measured_bytes"]) for r in both), default=None),
        "nodes": rows,
    }


def _phase_spans(rows: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    spans: list[tuple[str, int, int]] = []
    for r in rows:
        if r["phase"] is None:
            continue
        if spans and spans[-1][0] == r["phase"]:
            spans[-1] = (r["phase"], spans[-1][1], r["index"])
        else:
            spans.append((r["phase"], r["index"], r["index"]))
    return spans


def draw(doc: dict[str, Any], path: Path) -> None:
    """The PNG: estimate as a line, measurement as dots, phases shaded, the peak node and its module marked."""
    from matplotlib.figure import Figure  # the object API: no pyplot, no display, no global backend state

    rows = doc["nodes"]
    fig = Figure(figsize=(12, 5.5), layout="constrained")
    ax = fig.add_subplot()
    for phase, first, last in _phase_spans(rows):
        ax.axvspan(first - 0.5, last + 0.5, color=_PHASE_COLORS.get(phase, "#eeeeee"), zorder=0, lw=0)
        ax.text((first + last) / 2, 1.0, phase, transform=ax.get_xaxis_transform(), ha="center", va="bottom")
    est = [(r["index"], r["estimated_bytes"] / MIB) for r in rows if r["estimated_bytes"] is not None]
    meas = [(r["index"], r["measured_bytes"] / MIB) for r in rows if r["measured_bytes"] is not None]
    outside = doc["outside_graph_bytes"]
    if est:
        label = "estimate (static, per node)"
        label += f" + {outside / MIB:.2f} MiB optimizer state outside the graph" if outside else ""
        ax.plot(*zip(*est, strict=True), drawstyle="steps-mid", lw=1.6, color="C0", label=label)
    if meas:
        ax.plot(
            *zip(*meas, strict=True),
            ls="none",
            marker=".",
            ms=3,
            color="C1",
            label="measured (live tensor bytes after each op)",
        )
    peak = doc["estimated_peak"] or doc["measured_peak"]
    top = max(p["bytes"] for p in (doc["estimated_peak"], doc["measured_peak"]) if p is not None) if peak else 1
    if peak is not None:
        ax.axvline(peak["index"], color="C3", ls="--", lw=1)
        left = peak["index"] > len(rows) / 2  # the label goes in the half away from the peak, above the curves
        ax.annotate(
            _peak_label(doc, peak),
            xy=(peak["index"], peak["bytes"] / MIB),
            xytext=(0.02 if left else 0.98, 0.97),
            textcoords="axes fraction",
            ha="left" if left else "right",
            va="top",
            arrowprops={"arrowstyle": "->", "color": "C3"},
            bbox={"boxstyle": "round", "fc": "white", "ec": "C3"},
        )
    ax.set_xlim(-0.5, len(rows) - 0.5)
    ax.set_ylim(0, 1.45 * top / MIB)  # headroom above the peak for the label
    ax.set_xlabel("graph node, in execution order" if est else "op, in execution order")
    ax.set_ylabel("live tensor memory (MiB)")
    ax.set_title(f"Step {doc['step']}, rank {doc['rank']}: live bytes across the step", pad=18)
    ax.legend(loc="lower right")
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))


def _peak_label(doc: dict[str, Any], peak: dict[str, Any]) -> str:
    where = f"in {peak['module']}" if peak["module"] else "at the top level (outside every module)"
    sizes = [
        f"{name} {doc[key]['bytes'] / MIB:.3f} MiB"
        for key, name in (("estimated_peak", "estimated"), ("measured_peak", "measured"))
        if doc[key] is not None
    ]
    return f"peak: {', '.join(sizes)}\nat node {peak['index']}: {peak['node']} ({peak['op']})\n{where}"


def write_timeline(
    folder: Path,
    step: int,
    rank: int,
    nodes: Sequence[Node] | None,
    ops: Sequence[tuple[Any, int]],
    outside_bytes: int = 0,
) -> tuple[Path, Path]:
    """Write `rank{rank}_memory_timeline.json` and `.png` into `folder` (see `timeline_rows`); returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = summarize(timeline_rows(nodes, ops, outside_bytes), step, rank, outside_bytes)
    json_path, png_path = folder / f"rank{rank}_memory_timeline.json", folder / f"rank{rank}_memory_timeline.png"
    atomic_write_text(json_path, json.dumps(doc, indent=1) + "\n")
    draw(doc, png_path)
    return json_path, png_path


__all__ = ["PLOTS_HINT", "measured_per_node", "require_matplotlib", "summarize", "timeline_rows", "write_timeline"]
