"""What the planner prints and writes: the ranked table, the JSON file, the picture, and 'nothing fits'."""

from __future__ import annotations

import json
from pathlib import Path

from graph_trainer.distributed import layout
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.layouts import search
from graph_trainer.layouts.cluster import Cluster
from graph_trainer.observability.units import gib_at_least, gib_text, to_gib

# The table's communication columns: (heading, does a '<parallelism> <collective>' key count here).
COLUMNS = (
    ("fsdp-ag", lambda key: key == "fsdp all_gather"),
    ("fsdp-rs", lambda key: key == "fsdp reduce_scatter"),
    ("tp-ag", lambda key: key == "tp all_gather"),
    ("tp-rs", lambda key: key == "tp reduce_scatter"),
    ("ar", lambda key: key.endswith(" all_reduce")),
    ("a2a", lambda key: key.endswith(" all_to_all")),
    ("p2p", lambda key: key.endswith(" send_recv")),  # pipeline stages' sends
)


def _row(r: search.Screened, cluster: Cluster, seq: int) -> dict:
    plan, t = r.exact, r.exact_time
    tokens = r.cand.local_batch * r.cand.accumulation * seq
    tokens_per_gpu = tokens / r.cand.ranks_per_data_rank / t.total_s
    return {
        "layout": r.cand.layout(),
        "ac_mode": r.cand.ac_mode,
        "memory_budget": r.cand.memory_budget or None,  # AC budget: what it plans to
        "local_batch": r.cand.local_batch,
        "accumulation": r.cand.accumulation,
        **r.cand.parallelism_settings(),
        "loss_chunk_size": r.cand.loss_chunk_size,
        "optimizer_in_graph": r.cand.trace_optimizer,
        "peak_bytes": plan.peak_bytes,
        "peak_gib": to_gib(plan.peak_bytes),
        "peak_approximate": plan.approximate,  # an upper bound, not the exact plan (docs/planner.md says where)
        "headroom_gib": to_gib(cluster.memory_bytes - plan.peak_bytes),
        "step_s": t.total_s,
        "compute_s": t.compute_s,
        "exposed_comm_s": t.exposed_comm_s,
        "bubble_s": t.bubble_s,  # idle in a pipeline schedule's fill and drain
        "tokens_per_s_per_gpu": tokens_per_gpu,
        "mfu": plan.flops / t.total_s / (cluster.device.peak_tflops * 1e12),
        "tflop_per_step": plan.flops / 1e12,
        "comm_gib": {k: to_gib(v) for k, v in plan.comm_bytes.items()},
        "peak_at": list(plan.peak_location),
        "screen_peak_gib": to_gib(r.peak),
        "overrides": r.cand.overrides(),
    }


def print_table(rows: list[search.Screened], cluster: Cluster, seq: int) -> None:
    """The ranked table of exactly planned candidates, fastest first."""
    table = [_row(r, cluster, seq) for r in rows]
    # The layout with its options' words: "pp 8 x dp_shard 8 x tp 8, 1F1B, prefetch".
    shown = [x["layout"] + layout.describe_options(dict(r.cand.options))[0] for r, x in zip(rows, table, strict=True)]
    wide = max([26] + [len(text) for text in shown])  # HSDP with tp: "dp_replicate 2 x dp_shard 16 x tp 2"
    ac = max([9] + [len(r.cand.ac()) for r in rows])  # "budget 81920MiB": the budget it plans to
    print(
        f"{'#':>2} {'layout':<{wide}} {'ac':<{ac}} {'lb x acc':>8} {'peak GiB':>8} {'free GiB':>8} {'step s':>7} "
        f"{'tok/s/gpu':>9} {'MFU':>5}  comm GiB/step ({' '.join(name for name, _ in COLUMNS)})"
    )
    for i, (r, x, text) in enumerate(zip(rows, table, shown, strict=True), 1):
        comm = " ".join(f"{sum(v for k, v in x['comm_gib'].items() if counts(k)):.1f}" for _, counts in COLUMNS)
        batch = r.cand.batch()
        peak = ("~" if x["peak_approximate"] else "") + f"{x['peak_gib']:.2f}"  # ~: an upper bound
        print(
            f"{i:>2} {text:<{wide}} {r.cand.ac():<{ac}} {batch:>8} {peak:>8} "
            f"{x['headroom_gib']:8.2f} {x['step_s']:7.2f} {x['tokens_per_s_per_gpu']:9.0f} {x['mfu']:5.1%}  {comm}"
        )


def write_json(
    path: Path,
    final: list[search.Screened],
    exact: list[search.Screened],
    skipped: list[str],
    cluster: Cluster,
    seq: int,
    command: str | None,
    *,
    refused: dict[str, int],
    plans: search.Plans,
    counts: dict[str, int],
) -> None:
    """plan.json: the ranked rows, the screen's error, and what the console only counts: the layouts skipped, the
    candidates the trainer refuses, those whose plan failed, the plans made depth-free or whole-depth, and how
    many candidates each stage kept (`counts`: candidates, pruned, screened, exact)."""
    data = {
        "counts": counts,
        "cluster": {"device": cluster.device.__dict__, "gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node},
        "ranked": [_row(r, cluster, seq) for r in final],
        "screen_vs_exact": [
            {
                "layout": r.cand.layout(),
                "ac_mode": r.cand.ac_mode,
                "batch": r.cand.batch(),
                "screen_peak": r.peak,
                "exact_peak": r.exact.peak_bytes,
                "peak_error": peak_err,
                "step_time_error": time_err,
            }
            for r, peak_err, time_err in search.screen_errors(exact)
        ],
        "skipped_layouts": skipped,
        "refused_candidates": refused,  # 'layout: why' -> how many candidates the trainer refuses for it
        "unplannable": plans.failed,
        "plans": {"depth_free": plans.depth_free, "whole_depth": len(plans.full), "whole_depth_why": plans.full},
        "command": command,
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_picture(path: Path, screened, final, cluster: Cluster, seq: int) -> None:
    """Predicted tokens/s per GPU against per-rank peak (log scale: peaks span two orders of magnitude): screened
    candidates, exact plans, the memory limit and the frontier of the fitting candidates (the fastest at each
    peak or below)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def tokens(r) -> float:
        return r.cand.global_batch * seq / r.cand.dp / r.cand.ranks_per_data_rank / r.time.total_s

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([to_gib(r.peak) for r in screened], [tokens(r) for r in screened], s=12, c="0.6", label="screened")
    pts = sorted((_row(r, cluster, seq)["peak_gib"], _row(r, cluster, seq)["tokens_per_s_per_gpu"]) for r in final)
    ax.scatter([p for p, _ in pts], [t for _, t in pts], s=30, c="C0", label="planned exactly (ranked)")
    frontier, best = [], 0.0
    for p, t in sorted((to_gib(r.peak), tokens(r)) for r in screened if r.peak <= cluster.memory_bytes):
        if t > best:
            frontier.append((p, t))
            best = t
    ax.step([p for p, _ in frontier], [t for _, t in frontier], where="post", c="C1", label="frontier of fitting")
    ax.axvline(to_gib(cluster.memory_bytes), c="C3", ls="--", label=f"memory {cluster.device.memory_gib:g} GiB")
    ax.set_xscale("log")
    ax.set_xlabel("per-rank peak (GiB, log scale)")
    ax.set_ylabel("predicted tokens/s per GPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def nothing_fits(cfg: JobConfig, cluster: Cluster, global_seqs: int, cands, screened, exact) -> str:
    """One line: why nothing fits (the state alone, or the activations at the smallest local batch), the
    smallest GPU count or memory per GPU that would fit."""
    where = f"nothing fits on {cluster.gpus} x {cluster.device.name} ({cluster.device.memory_gib:g} GiB each)"
    limit = cluster.memory_bytes
    if screened and any(r.peak <= limit for r in screened):  # the screen's fitting candidates were planned low
        return (
            f"{where}: the {len(exact)} fastest candidates the screen fitted exceed the memory when planned exactly; "
            f"plan more of them with --search.exact {4 * max(len(exact), 1)}"
        )
    if not screened:
        state = min(search.state_bytes(cfg, c) for c in cands)
        gpus = cluster.gpus
        while state * cluster.gpus / gpus >= limit and gpus < 1 << 20:
            gpus *= 2
        return (
            f"{where}: parameters, gradients and AdamW state alone need {gib_text(state)} GiB per GPU at the "
            f"most sharded layout; try --cluster.gpus {gpus} or --cluster.memory_gib {gib_at_least(state * 1.25)} "
            "(then plan again: activations come on top)"
        )
    low = min(screened, key=lambda r: r.peak)  # the smallest local batch, most sharded, most recomputing
    state = search.state_bytes(cfg, low.cand)
    act = low.peak - state  # what no more GPUs lower: activations at this local batch and tp
    c = low.cand
    what = f"{c.layout()}, AC {c.ac_mode}, local batch {c.local_batch} x {c.accumulation} micro-steps"
    if act >= limit:
        return (
            f"{where}: the activations at the smallest local batch ({what}) alone take {gib_text(act)} GiB per "
            f"GPU, and more GPUs do not lower them (nor does pipeline parallelism: under 1F1B its first stage holds "
            f"pp micro-batches of 1/pp of the model each); --cluster.memory_gib {gib_at_least(low.peak * 1.05)} or a "
            "shorter --training.seq_len would make it fit"
        )
    gpus = cluster.gpus
    while state * cluster.gpus / gpus + act > limit and gpus < 1 << 20:
        gpus *= 2
    return (
        f"{where}: the smallest plan ({what}) needs {gib_text(low.peak)} GiB per GPU ({gib_text(state)} of "
        f"state, {gib_text(act)} of activations at its local batch); try --cluster.gpus {gpus} (and a global "
        f"batch they divide) or --cluster.memory_gib {gib_at_least(low.peak * 1.05)}"
    )


__all__ = ["nothing_fits", "print_table", "write_json", "write_picture"]
