"""The planner's searches for Llama-3 on H100 clusters, as README.md and docs/planner.md show them.

    python -m benchmarks.plan_search [--clusters 8b-8 70b-64 405b-512 ds16b-8]

Each runs `python -m graph_trainer.plan` as a user would, in its own process (h100-80gb, 8 GPUs a node, the
config's own global batch, prefetch searched), reads the plan.json it writes, and times the search (CPU and wall
seconds, and the process's peak RSS: times are meaningful only on an idle machine). The tables go to
benchmarks/results/plan_search.json (`benchmarks.results.save`): `summary` (the best exact plan of each search),
`stats` (candidates per stage, depth-free plans, time, memory) and `ranked_<cluster>` (every ranked row). The
plans themselves (layout, peak, predicted tokens/s) are deterministic: they change only with the planner or its
cost model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import results
from benchmarks.results import markdown_table

CLUSTERS = {  # name: (config, GPUs)
    "8b-8": ("llama3_8b.toml", 8),
    "70b-64": ("llama3_70b.toml", 64),
    "405b-512": ("llama3_405b.toml", 512),
    "ds16b-8": ("deepseek_v3_16b.toml", 8),
}
RANKED_HEADER = ("#", "layout", "AC", "lb x acc", "peak GiB", "free GiB", "step s", "tok/s/GPU", "MFU",
                 "GiB/step fsdp-ag fsdp-rs tp-ag tp-rs ep-a2a dp-ar")  # fmt: skip
SUMMARY_HEADER = ("cluster (H100 80 GB, seq 8192)", "search CPU s / wall s", "best exact plan", "per-rank peak",
                  "tokens/s per GPU, predicted")  # fmt: skip
STATS_HEADER = ("cluster", "candidates (pruned, screened, planned exactly)", "depth-free plans", "whole-depth plans",
                "CPU s / wall s", "max RSS GiB")  # fmt: skip
COMM = (
    "fsdp all_gather",
    "fsdp reduce_scatter",
    "tp all_gather",
    "tp reduce_scatter",
    "ep all_to_all",
    "dp_replicate all_reduce",
)  # the replicas' average of the gradients (dp_replicate, HSDP)


def search(config: str, gpus: int) -> tuple[dict, float, float, float]:
    """(plan.json, CPU s, wall s, peak RSS GiB) of the planner's search for `config` on `gpus` h100-80gb GPUs, run
    as its own process (so its CPU time and peak memory are its own)."""
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "-m", "graph_trainer.plan", "--config", config, "--cluster.gpus", str(gpus),
                "--cluster.gpus_per_node", "8", "--cluster.device", "h100-80gb", "--out", out]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.Popen(argv)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv[1:])} exited {proc.returncode}")
        cpu = usage.ru_utime + usage.ru_stime
        rss_gib = usage.ru_maxrss * 1024 / 2**30  # ru_maxrss is in KiB on Linux
        return json.loads((Path(out) / "plan.json").read_text()), cpu, elapsed, rss_gib


def ranked_table(result: dict) -> str:
    """The ranked rows of one search as docs/planner.md shows them."""
    rows = []
    for i, r in enumerate(result["ranked"], 1):
        comm = " ".join(f"{r['comm_gib'].get(k, 0):.1f}" for k in COMM)
        batch = f"{r['local_batch']} x {r['accumulation']}" + ("s" if r["fsdp_grad_sync"] == "step" else "")
        rows.append((i, r["layout"], r["ac_mode"], batch, f"{r['peak_gib']:.2f}", f"{r['headroom_gib']:.2f}",
                     f"{r['step_s']:.2f}", f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['mfu']:.1%}", comm))  # fmt: skip
    return markdown_table(RANKED_HEADER, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS), choices=list(CLUSTERS))
    opts = parser.parse_args()
    tables, summary, stats, data = {}, [], [], {}
    for name in opts.clusters:
        config, gpus = CLUSTERS[name]
        result, cpu, wall, rss = search(config, gpus)
        n, plans = result["counts"], result["plans"]
        stats.append((name, f"{n['candidates']} ({n['pruned']}, {n['screened']}, {n['exact']})", plans["depth_free"],
                      plans["whole_depth"], f"{cpu:.1f} / {wall:.0f}", f"{rss:.2f}"))  # fmt: skip
        best = result["ranked"][0]
        summary.append((f"{name} (`--config {config} --cluster.gpus {gpus}`)", f"{cpu:.0f} / {wall:.0f}",
                        f"{best['layout']}, AC {best['ac_mode']}, {best['local_batch']} x {best['accumulation']}",
                        f"{best['peak_gib']:.1f} GiB", f"{best['tokens_per_s_per_gpu']:,.0f}"))  # fmt: skip
        tables[f"ranked_{name}"] = ranked_table(result)
        data[name] = {"cpu_s": cpu, "wall_s": wall, "max_rss_gib": rss, "counts": n, "plans": plans,
                      "ranked": result["ranked"], "command": result["command"]}  # fmt: skip
    tables["summary"] = markdown_table(SUMMARY_HEADER, summary)
    tables["stats"] = markdown_table(STATS_HEADER, stats)
    results.save("plan_search", tables, data)


if __name__ == "__main__":
    main()
