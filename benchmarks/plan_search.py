"""The planner's searches for Llama-3 on H100 clusters, as README.md and docs/planner.md show them.

    python -m benchmarks.plan_search [--clusters 8b-8 70b-64 405b-512]

Each runs `python -m graph_trainer.plan` as a user would (h100-80gb, 8 GPUs a node, the config's own global batch,
prefetch searched), reads the plan.json it writes, and times the search (CPU and wall seconds: meaningful only on
an idle machine). The tables go to benchmarks/results/plan_search.json (`benchmarks.results.save`): `summary` (the
best exact plan of each search) and `ranked_<cluster>` (every ranked row). The plans themselves (layout, peak,
predicted tokens/s) are deterministic: they change only with the planner or its cost model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.results import markdown_table, save
from graph_trainer.plan.__main__ import main as plan

CLUSTERS = {  # name: (config, GPUs)
    "8b-8": ("llama3_8b.toml", 8),
    "70b-64": ("llama3_70b.toml", 64),
    "405b-512": ("llama3_405b.toml", 512),
}
RANKED_HEADER = ("#", "layout", "AC", "lb x acc", "peak GiB", "free GiB", "step s", "tok/s/GPU", "MFU",
                 "GiB/step fsdp-ag fsdp-rs tp-ag tp-rs")  # fmt: skip
SUMMARY_HEADER = ("cluster (H100 80 GB, seq 8192)", "search CPU s / wall s", "best exact plan", "per-rank peak",
                  "tokens/s per GPU, predicted")  # fmt: skip
COMM = ("fsdp all_gather", "fsdp reduce_scatter", "tp all_gather", "tp reduce_scatter")


def search(config: str, gpus: int) -> tuple[dict, float, float]:
    """(plan.json, CPU s, wall s) of the planner's search for `config` on `gpus` h100-80gb GPUs."""
    with tempfile.TemporaryDirectory() as out:
        argv = ["--config", config, "--cluster.gpus", str(gpus), "--cluster.gpus_per_node", "8",
                "--cluster.device", "h100-80gb", "--out", out]  # fmt: skip
        start, cpu = time.perf_counter(), time.process_time()
        code = plan(argv)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        if code != 0:
            raise SystemExit(f"python -m graph_trainer.plan {' '.join(argv)} exited {code}")
        return json.loads((Path(out) / "plan.json").read_text()), cpu, elapsed


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
    tables, summary, data = {}, [], {}
    for name in opts.clusters:
        config, gpus = CLUSTERS[name]
        result, cpu, wall = search(config, gpus)
        best = result["ranked"][0]
        summary.append((f"{name} (`--config {config} --cluster.gpus {gpus}`)", f"{cpu:.0f} / {wall:.0f}",
                        f"{best['layout']}, AC {best['ac_mode']}, {best['local_batch']} x {best['accumulation']}",
                        f"{best['peak_gib']:.1f} GiB", f"{best['tokens_per_s_per_gpu']:,.0f}"))  # fmt: skip
        tables[f"ranked_{name}"] = ranked_table(result)
        data[name] = {"cpu_s": cpu, "wall_s": wall, "ranked": result["ranked"], "command": result["command"]}
    tables["summary"] = markdown_table(SUMMARY_HEADER, summary)
    save("plan_search", tables, data)


if __name__ == "__main__":
    main()
