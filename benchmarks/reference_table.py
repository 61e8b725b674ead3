"""The planner against torchtitan's published Llama-3 rows on H100s (predicted vs published, with ratios).

    python -m benchmarks.reference_table [--rows 8b-8 8b-128] [--best]

Rows (torchtitan's benchmarks/llama3_h100_202412_torchtitan.md and docs/performance.md; seq 8192, bf16, no
Float8; H100 96 GB at 500 W): each is planned pinned to its layout (`--cluster.device h100-96gb`). The
"torch.compile" rows correspond to our traced step compiled by Inductor (`--compile.backend inductor`): the
same per-rank memory plan plus the compile stage's gather buffer; the cost model has no compile-speed term,
so both published rows of a layout meet the same prediction. The compute efficiency is the device table's
one constant (graph_trainer.plan.cluster, from the Llama 3 paper's MFU, not from these rows). torchtitan's
memory is the reserved peak of its caching allocator; ours is the active peak, which is at most that.
`--best` also runs the search at the row's GPU count and prints predicted(best) / predicted(pinned).
The 405B row (FSDP 16 x TP 8 on 128 H100s at 95 GB) publishes throughput and MFU, no memory.
"""

from __future__ import annotations

import argparse
import time

import torch

from graph_trainer.job_config.cli import load_config
from graph_trainer.observability.units import to_gib
from graph_trainer.plan import search
from graph_trainer.plan.cluster import DEVICES, Cluster

SEQ = 8192
ROWS = {
    # name: (config, gpus, degrees, ac mode, local batch, [(label, tokens/s/GPU, memory GiB)])
    "8b-8": ("llama3_8b", 8, {"dp_shard": 8}, "selective", 2, [("eager", 5762, 82.4), ("torch.compile", 6667, 77.0)]),
    "405b-128": ("llama3_405b", 128, {"dp_shard": 16, "tp": 8}, "full", 2, [("eager, 29.0% MFU", 109, None)]),
    "8b-128": (
        "llama3_8b",
        128,
        {"dp_shard": 128},
        "selective",
        2,
        [("eager", 5605, 67.0), ("torch.compile", 6514, 62.0)],
    ),  # fmt: skip
}


def _plan(cfg, cluster: Cluster, cand: search.Candidate) -> search.Screened:
    row = search.Screened(cand, 0, None)
    search.plan_exactly(cfg, cluster, [row], cluster.device.efficiency, torch.device("cpu"))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS))
    parser.add_argument("--best", action="store_true")
    opts = parser.parse_args()
    device = DEVICES["h100-96gb"]
    print(f"device h100-96gb: efficiency {device.efficiency} ({device.efficiency_source})")
    print(f"{'row':<8} {'mode':<14} {'tok/s/GPU pred':>14} {'published':>9} {'ratio':>6} {'GiB pred':>8} "
          f"{'published':>9} {'ratio':>6} {'MFU':>6} {'best/pinned':>11} {'plan s':>7}")  # fmt: skip
    for name in opts.rows:
        config, gpus, degrees, mode, batch, published = ROWS[name]
        # torchtitan's loss takes the whole [tokens, vocab] logits: no chunking, as there.
        args = ["--config", config, "--training.seq_len", str(SEQ), "--training.dtype", "bfloat16"]
        cfg, _ = load_config([*args, "--training.loss_chunk_size", "0"])
        cluster = Cluster(device, gpus, 8)
        cand = search.Candidate(
            tuple({"dp_replicate": 1, **degrees}.items()), mode, batch, cfg.training.loss_chunk_size, False
        )
        start = time.perf_counter()
        row = _plan(cfg, cluster, cand)
        elapsed = time.perf_counter() - start
        tokens = batch * SEQ / (degrees.get("tp", 1) * row.exact_time.total_s)  # per GPU: tp ranks share a batch
        mfu = row.exact.flops / row.exact_time.total_s / (device.peak_tflops * 1e12)
        ratio_best = float("nan")
        if opts.best:
            layouts, _ = search.layouts(cfg, cluster)
            cands = search.candidates(
                cfg, layouts, batch * gpus, ("none", "selective", "full"), (cand.loss_chunk_size,), (False,)
            )
            screened = search.screen(cfg, cluster, cands, device.efficiency, torch.device("cpu"))
            fitting = sorted((r for r in screened if r.peak <= cluster.memory_bytes), key=lambda r: r.time.total_s)[:2]
            search.plan_exactly(cfg, cluster, fitting, device.efficiency, torch.device("cpu"))
            fits = [r for r in fitting if r.exact and r.exact.peak_bytes <= cluster.memory_bytes]
            best = min((r.exact_time.total_s for r in fits), default=float("nan"))
            ratio_best = row.exact_time.total_s / best
        peak = to_gib(row.exact.peak_bytes)
        for label, tps, gib in published:
            memory = f"{gib:9.1f} {peak / gib:6.2f}" if gib else f"{'-':>9} {'-':>6}"
            print(
                f"{name:<8} {label:<14} {tokens:14.0f} {tps:9,} {tokens / tps:6.2f} {peak:8.1f} "
                f"{memory} {mfu:6.1%} {ratio_best:11.2f} {elapsed:7.0f}"
            )


if __name__ == "__main__":
    main()
