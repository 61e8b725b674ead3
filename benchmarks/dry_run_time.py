"""How long `python -m graph_trainer --dry-run` takes, end to end: CPU s and wall s of the whole process (imports,
the depth-free plan of every AC mode, the report) and its max RSS, one fresh process per job.

    python -m benchmarks.dry_run_time [--save]

The jobs are the ones docs/planner.md quotes (`JOBS`): one process of 8B, one rank of 70B, 405B, DeepSeek-V3 16B
and 671B. They are times: run it on an idle machine (about 1 minute on an idle 2-core CPU) before `--save`
writes benchmarks/results/dry_run_time.json for the docs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import results

REPO = Path(__file__).resolve().parents[1]
# (row label, the dry run's options after `python -m graph_trainer`)
JOBS = (
    ("8B, one process (`llama3_8b.toml`)", ["--config", "llama3_8b.toml"]),
    (
        "70B, one rank of 64 (`--parallelism.dp_shard 8 --parallelism.tp 8 --training.dtype bfloat16`)",
        ["--config", "llama3_70b.toml", "--parallelism.dp_shard", "8", "--parallelism.tp", "8"]
        + ["--training.dtype", "bfloat16"],
    ),
    (
        "405B, one rank of 512 (`--parallelism.dp_shard 64 --parallelism.tp 8 --training.dtype bfloat16`)",
        ["--config", "llama3_405b.toml", "--parallelism.dp_shard", "64", "--parallelism.tp", "8"]
        + ["--training.dtype", "bfloat16"],
    ),
    (
        "DeepSeek-V3 16B, one rank of 8 (`deepseek_v3_16b.toml --parallelism.dp_shard 8 --parallelism.ep 8`)",
        ["--config", "deepseek_v3_16b.toml", "--parallelism.dp_shard", "8", "--parallelism.ep", "8"],
    ),
    (
        "DeepSeek-V3 671B, one rank of 256 (`deepseek_v3_671b.toml --parallelism.dp_shard 256 --parallelism.ep 256`)",
        ["--config", "deepseek_v3_671b.toml", "--parallelism.dp_shard", "256", "--parallelism.ep", "256"],
    ),
)


def time_dry_run(options: list[str]) -> dict[str, float]:
    """CPU s (user + system), wall s and max RSS (GiB) of one `--dry-run` process."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "graph_trainer", *options, "--dry-run"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not the sum over all children
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"dry run {options} failed ({proc.returncode}): {stderr.strip().splitlines()[-1:]}")
    return {
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "wall_s": time.perf_counter() - start,
        "max_rss_gib": usage.ru_maxrss / 2**20,  # KiB -> GiB
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/dry_run_time.json")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} cores")
    rows, data = [], {}
    for label, options in JOBS:
        data[label] = r = time_dry_run(options)
        rows.append([label, f"{r['cpu_s']:.1f} / {r['wall_s']:.1f}", f"{r['max_rss_gib']:.2f} GiB"])
        print(" | ".join(rows[-1]), flush=True)
    table = results.markdown_table(["model, rank", "CPU s / wall s", "max RSS"], rows)
    results.show("dry_run_time", {"dry_run_time": table}, {"load_average": load, "jobs": data}, save_it=args.save)


if __name__ == "__main__":
    main()
