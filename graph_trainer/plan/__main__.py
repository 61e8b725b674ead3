"""`python -m graph_trainer.plan`: the best layout of a model that fits a cluster (docs/planner.md).

    python -m graph_trainer.plan --config llama3_8b.toml --cluster.gpus 8 --cluster.gpus_per_node 8 \\
        --cluster.device h100-80gb [--batch.global_seqs 16] [--search.exact 4] [--out outputs/plan] \\
        [any trainer option, e.g. --training.seq_len 8192]

Exit codes: 0 a plan fits (table, JSON, picture and the command line of the best plan); 2 nothing fits (one
line naming the smallest GPU count that would) or a bad option (one line).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

EXIT_USER_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m graph_trainer.plan", add_help=True)
    p.add_argument("--cluster.gpus", dest="gpus", type=int, default=8)
    p.add_argument("--cluster.gpus_per_node", dest="gpus_per_node", type=int, default=8)
    p.add_argument("--cluster.device", dest="device", default="h100-80gb")
    # Every figure of the device table can be overridden; efficiency: the fraction of peak compute runs at.
    for name in ("memory_gib", "peak_tflops", "intra_gbps", "inter_gbps", "efficiency"):
        p.add_argument(f"--cluster.{name}", dest=name, type=float, default=None)
    p.add_argument("--batch.global_seqs", dest="global_seqs", type=int, default=None)
    p.add_argument("--batch.global_tokens", dest="global_tokens", type=int, default=None)
    p.add_argument("--search.ac_modes", dest="ac_modes", nargs="+", default=["none", "selective", "full"])
    p.add_argument("--search.loss_chunk_sizes", dest="chunks", type=int, nargs="+", default=None)
    p.add_argument("--search.optimizer_in_graph", dest="in_graph", nargs="+", default=["false"])
    # Prefetch on, as FSDP2 runs: the cost model hides FSDP's all-gathers behind compute (docs/planner.md).
    p.add_argument("--search.fsdp_prefetch", dest="prefetch", nargs="+", default=["true"])
    p.add_argument("--search.exact", dest="exact", type=int, default=4, help="candidates planned exactly")
    p.add_argument("--out", default=None, help="folder for plan.json and plan.png")
    return p


def main(argv: list[str] | None = None) -> int:
    from graph_trainer.errors import UserError

    argv = sys.argv[1:] if argv is None else argv
    opts, rest = _parser().parse_known_args(argv)
    try:
        return _plan(opts, rest)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


def _plan(opts: argparse.Namespace, rest: list[str]) -> int:
    import torch

    from graph_trainer.errors import UserError
    from graph_trainer.job_config.cli import load_config
    from graph_trainer.observability.units import to_gib
    from graph_trainer.plan import search
    from graph_trainer.plan.cluster import build_cluster
    from graph_trainer.plan.report import nothing_fits, print_table, write_json, write_picture

    start, cpu_start = time.perf_counter(), time.process_time()
    overrides = {k: getattr(opts, k) for k in ("memory_gib", "peak_tflops", "intra_gbps", "inter_gbps", "efficiency")}
    cluster = build_cluster(opts.device, opts.gpus, opts.gpus_per_node, overrides)
    cfg, _ = load_config(rest)
    if opts.device != "cpu":  # the bf16 plan: as the trainer runs on a GPU (bf16 compute, bf16 FSDP gathers)
        cfg.training.dtype = "bfloat16"
    seq = cfg.training.seq_len
    if opts.global_tokens is not None:
        if opts.global_tokens % seq:
            raise UserError(f"--batch.global_tokens {opts.global_tokens} is not a multiple of seq_len {seq}")
        opts.global_seqs = opts.global_tokens // seq
    global_seqs = opts.global_seqs or cfg.training.local_batch_size * cluster.gpus
    chunks = tuple(opts.chunks) if opts.chunks else (cfg.training.loss_chunk_size,)
    in_graph = tuple(v.lower() == "true" for v in opts.in_graph)
    prefetch = tuple(v.lower() == "true" for v in opts.prefetch)
    layouts, skipped = search.layouts(cfg, cluster)
    space = search.candidates(cfg, layouts, global_seqs, tuple(opts.ac_modes), chunks, in_graph, prefetch)
    cands = space.cands
    if not cands:
        raise UserError(
            f"no layout of {cluster.gpus} GPUs that the trainer accepts divides the global batch of {global_seqs} "
            "sequences: pick a global batch that is a multiple of the data-parallel degree"
        )
    kept = [c for c in cands if search.state_bytes(cfg, c) < cluster.memory_bytes]
    plans = search.Plans(cfg, torch.device("cpu"))
    rows = search.screen(cfg, cluster, kept, cluster.device.efficiency, plans) if kept else []
    if kept and not rows:  # not a memory verdict: no candidate could be planned at all
        raise UserError(f"no candidate could be planned ({len(plans.errors)} refused), e.g. {plans.errors[0]}")
    fitting = sorted((r for r in rows if r.peak <= cluster.memory_bytes), key=lambda r: r.time.total_s)
    exact = search.plan_best(cfg, cluster, fitting, opts.exact, cluster.device.efficiency, plans)
    final = sorted((r for r in exact if search.is_exact_fit(r, cluster)), key=lambda r: r.exact_time.total_s)
    # Upper bounds that fit and would beat the best exact plan: listed, never ranked (every ranked row is exact).
    bounds = [
        r for r in exact
        if r.exact is not None and r.exact.approximate and r.exact.peak_bytes <= cluster.memory_bytes
        and (not final or r.exact_time.total_s < final[0].exact_time.total_s)
    ]  # fmt: skip
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(
        f"plan: {cfg.model.name}/{cfg.model.flavor} on {cluster.gpus} x {cluster.device.name} "
        f"({cluster.gpus_per_node} per node), global batch {global_seqs} x {seq} tokens; "
        f"{len(cands)} candidates, {len(cands) - len(kept)} pruned (state alone over memory), {len(rows)} screened, "
        f"{len(exact)} planned exactly; {plans.calls} depth-free plans, {elapsed:.0f} s ({cpu:.0f} s of CPU)"
    )
    for line in skipped:
        print(f"skipped layout {line}")
    for what, n in space.refused.items():
        print(f"skipped {n} candidates of {what}")
    for row, peak_err, time_err in search.screen_errors(exact):
        c = row.cand
        print(f"screen vs exact: {c.layout()} {c.ac_mode} {c.batch()}: peak {peak_err:+.1%}, step time {time_err:+.1%}")
    for r in bounds:
        c = r.cand
        print(
            f"not ranked, an upper bound only: {c.layout()} {c.ac_mode} {c.batch()}, peak <= "
            f"{to_gib(r.exact.peak_bytes):.2f} GiB, {r.exact_time.total_s:.2f} s a step "
            "(docs/planner.md: approximate plans)"
        )
    if not final:
        print(
            "nothing ranked: only the upper bounds above fit (AC budget, fsdp_grad_sync step or accumulation without "
            "FSDP is planned approximately); plan more candidates with --search.exact or other --search.ac_modes"
            if bounds
            else nothing_fits(cfg, cluster, global_seqs, cands, rows, exact)
        )
        return EXIT_USER_ERROR
    print_table(final, cluster, seq)
    best = final[0]
    command = _command(rest, best.cand, cluster)
    print("best plan's command:\n  " + command)
    if opts.out:
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "plan.json", final, exact, skipped, cluster, seq, command)
        write_picture(out / "plan.png", rows, final, cluster, seq)
        print(f"wrote {out / 'plan.json'} and {out / 'plan.png'}")
    return 0


def _command(rest: list[str], cand, cluster) -> str:
    """The torchrun command line that runs `cand` with the user's own options."""
    from graph_trainer.distributed.launch import trainer_command

    per_node = min(cluster.gpus, cluster.gpus_per_node)
    argv = trainer_command(per_node, python="python")
    if cluster.gpus > per_node:  # several nodes: torchrun's rendezvous replaces --standalone
        argv = ["torchrun", f"--nnodes={cluster.gpus // per_node}", f"--nproc_per_node={per_node}",
                "--rdzv_backend=c10d", "--rdzv_endpoint=$MASTER_ADDR:29500", "-m", "graph_trainer"]  # fmt: skip
    options = [a for o in cand.overrides() for a in o.split()]
    if cluster.device.name != "cpu":
        # bf16 as on a GPU: FSDP's bf16 gathered parameters set the compute dtype (the trainer refuses
        # --training.dtype bfloat16 beside them); without FSDP, bf16 autocast.
        fsdp = dict(cand.degrees).get("dp_shard", 1) > 1
        options += ["--training.mixed_precision_param", "bfloat16"] if fsdp else ["--training.dtype", "bfloat16"]
    dtype = {"--training.dtype"} if cluster.device.name != "cpu" else set()
    rest = _without(rest, {a for a in options if a.startswith("--")} | dtype)
    endpoint = "--rdzv_endpoint=$MASTER_ADDR:29500"  # shlex quotes it whole; the shell must expand $MASTER_ADDR
    return shlex.join([*argv, *rest, *options]).replace(f"'{endpoint}'", endpoint)


def _without(argv: list[str], keys: set[str]) -> list[str]:
    """`argv` without the `--key value` pairs whose key the plan sets itself."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in keys:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
