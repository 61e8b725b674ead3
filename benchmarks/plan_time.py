"""Plan time against depth: the depth-free plan (3 + 4 blocks traced) vs the full trace, all four AC modes;
with `--batches`, against the local batch instead (at the first depth).

    python -m benchmarks.plan_time [--config llama3_8b] [--depths 8 16 32 80 126] [--full-up-to 32]
        [--dp-shard 1] [--tp 1] [--batches 1 2 8 32 64] [--extra --training.seq_len 8192 ...]
    python -m benchmarks.plan_time --doc

`--doc` plans docs/planner.md's rows (8B, and 70B as one rank of 64, depth-free at every depth) and saves their CPU
seconds to benchmarks/results/plan_time.json: times, so run it on an idle machine (about 90 s on an idle 2-core CPU).

With `--batches`, each batch is planned alone (as the dry run plans its own batch: traced at that batch, or
extended from two small batches when its chunked loss has many chunks), then all of them in one call (as the
planner's search plans a shape: `block_plan.plan_batches`).

Each (depth, method) runs in a fresh process so the max RSS is its own; plan s is wall time, CPU s the
process's CPU time (on a shared machine the wall time includes waiting for a core). The full trace is skipped above
`--full-up-to` blocks (it grows with depth: 70B as one rank of 64 took 161 s here before this plan). Both
print the none-mode peak so the rows can be compared. The machine's load is printed with the table: on a
shared machine every time is inflated.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import results

REPO = Path(__file__).resolve().parents[1]


def _one(args: list[str], method: str) -> dict:
    """Plan all four modes of `args` in this process (`method`: fast, full, or batches=1,2,...: all those local
    batches in one call); time, max RSS, and the none peak (of the largest batch)."""
    import torch

    from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
    from graph_trainer.job_config.cli import load_config
    from graph_trainer.plan.block_plan import plan_batches, plan_modes
    from graph_trainer.plan.step_plan import AC_MODES

    cfg, _ = load_config(args)
    start, cpu = time.perf_counter(), time.process_time()
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), torch.device("cpu")) as mesh:
        if method.startswith("batches="):
            batches = [int(b) for b in method.split("=")[1].split(",")]
            plans = plan_batches(cfg, mesh, AC_MODES, batches)[max(batches)]
        else:
            plans = plan_modes(cfg, mesh, AC_MODES, fast=method == "fast")
    elapsed = time.perf_counter() - start
    none = plans["none"]
    return {
        "seconds": elapsed,
        "cpu_seconds": time.process_time() - cpu,  # on a shared machine, wall time waits for the CPU
        "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
        "none_peak": getattr(none, "peak_bytes", None),
        # the exact modes' peaks, which the depth-free plan must equal to the byte (budget's is a bound)
        "exact_peaks": {m: getattr(p, "peak_bytes", None) for m, p in plans.items() if m != "budget"},
        "blocks_traced": getattr(none, "blocks_traced", None),
    }


# The rows docs/planner.md quotes (`--doc`): (row label, config, dp_shard, tp, extra options).
DOC_ROWS = (
    ("8B", "llama3_8b", 1, 1, []),
    ("70B one rank of 64 (`--dp-shard 8 --tp 8 --extra --training.dtype bfloat16`)", "llama3_70b", 8, 8,
     ["--training.dtype", "bfloat16"]),
)  # fmt: skip


def _run(depth: int, method: str, config: str, dp_shard: int, tp: int, extra: list[str]) -> dict | str:
    """One (depth, method) planned in a fresh process: its figures, or the last line of its error."""
    args = ["--config", config, "--model.n_layers", str(depth), *extra]
    for dim, size in (("dp_shard", dp_shard), ("tp", tp)):
        if size > 1:
            args += [f"--parallelism.{dim}", str(size)]
    cmd = [sys.executable, "-m", "benchmarks.plan_time", "--child", method, *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return f"failed: {proc.stderr.strip().splitlines()[-1:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _print(depth: int, batch: str, method: str, r: dict | str) -> None:
    label = method if len(method) <= 10 else "batches"
    if isinstance(r, str):
        print(f"{depth:>5} {batch:>5} {label:>10} {r}")
        return
    peak = r["none_peak"] / 1024**3 if r["none_peak"] else float("nan")
    print(
        f"{depth:>5} {batch:>5} {label:>10} {r['seconds']:8.1f} {r['cpu_seconds']:6.1f} {r['rss_gib']:8.2f} "
        f"{r['blocks_traced']:>6} {peak:14.3f}",
        flush=True,
    )


def save_doc_rows(depths: list[int]) -> None:
    """Plan `DOC_ROWS` at each depth (depth-free plan only) and save the CPU s as docs/planner.md's table."""
    rows, data = [], {"load_average": os.getloadavg()[0]}
    for label, config, dp_shard, tp, extra in DOC_ROWS:
        runs = {depth: _run(depth, "fast", config, dp_shard, tp, extra) for depth in depths}
        for depth, r in runs.items():
            _print(depth, "", "fast", r)
            if isinstance(r, str):
                raise RuntimeError(f"{label} at {depth} layers {r}")
        rows.append([label, *(f"{r['cpu_seconds']:.1f}" for r in runs.values())])
        data[label] = runs
    results.save("plan_time", {"depth": results.markdown_table(["layers", *map(str, depths)], rows)}, data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama3_8b")
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 80, 126])
    parser.add_argument("--full-up-to", type=int, default=32)
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--doc", action="store_true", help="plan docs/planner.md's rows and save them")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        method, *args = opts.child
        print(json.dumps(_one(args, method)))
        return
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'depth':>5} {'batch':>5} {'method':>10} {'plan s':>8} {'CPU s':>6} {'RSS GiB':>8} {'blocks':>6} "
          f"{'none peak GiB':>14}")  # fmt: skip
    if opts.doc:
        save_doc_rows(opts.depths)
        return
    runs = []  # (depth, batch label, method, extra args)
    if opts.batches:
        depth = opts.depths[0]
        runs += [(depth, str(b), "fast", ["--training.local_batch_size", str(b)]) for b in opts.batches]
        runs.append((depth, "all", "batches=" + ",".join(map(str, opts.batches)), []))
    else:
        for depth in opts.depths:
            runs += [(depth, "", m, []) for m in ("fast", "full") if m == "fast" or depth <= opts.full_up_to]
    by_depth: dict[int, dict[str, dict | str]] = {}
    for depth, batch, method, more in runs:
        r = _run(depth, method, opts.config, opts.dp_shard, opts.tp, [*opts.extra, *more])
        _print(depth, batch, method, r)
        by_depth.setdefault(depth, {})[method] = r
    _check_depth_free_equals_full(by_depth)


def _check_depth_free_equals_full(by_depth: dict[int, dict[str, dict | str]]) -> None:
    """Exit 1 unless, at every depth planned both ways, the depth-free plan's none, selective and full peaks equal
    the full trace's to the byte (the claim docs/planner.md makes; CI checks it at 8 blocks)."""
    differ = [
        f"{depth} blocks: depth-free {r['fast']['exact_peaks']} != full {r['full']['exact_peaks']}"
        for depth, r in by_depth.items()
        if isinstance(r.get("fast"), dict) and isinstance(r.get("full"), dict)
        and r["fast"]["exact_peaks"] != r["full"]["exact_peaks"]
    ]  # fmt: skip
    compared = [d for d, r in by_depth.items() if isinstance(r.get("full"), dict)]
    if differ:
        sys.exit("the depth-free plan differs from the full trace at " + "; ".join(differ))
    if compared:
        print(f"depth-free peaks == full trace's to the byte (none, selective, full) at {compared} blocks")


if __name__ == "__main__":
    main()
