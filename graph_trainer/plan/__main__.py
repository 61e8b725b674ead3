"""`python -m graph_trainer.plan`: the best layout of a model that fits a cluster (docs/planner.md).

    python -m graph_trainer.plan --config llama3_8b.toml --cluster.gpus 8 --cluster.gpus_per_node 8 \\
        --cluster.device h100-80gb [--batch.global_seqs 16] [--search.exact 4] [--out outputs/plan] \\
        [any trainer option, e.g. --training.seq_len 8192]

`--help` lists every option with its default (`DESCRIPTION`, `EPILOG`: exit codes).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

EXIT_USER_ERROR = 2


DESCRIPTION = """\
Find the fastest layout of a model that fits a cluster: every dp_replicate x dp_shard x tp (x ep) of the GPU
count (and with --search.pp true, pp under 1F1B or Interleaved1F1B), local batch x accumulation, AC mode, loss
chunk and optimizer placement the trainer accepts is screened with depth-free plans of its step on fake tensors,
the best are planned exactly (pipeline stages: every stage's step on fake tensors) and ranked (docs/planner.md).

Any trainer option (--section.key VALUE, see python -m graph_trainer --help) sets the job, e.g.
--training.seq_len 8192; --plan.require_depth_free makes a whole-depth fallback an error."""

EPILOG = """\
Exit codes: 0 a plan fits (table, plan.json, plan.png and the command line of the best plan); 2 nothing fits
(one line naming what would), nothing could be planned, or a bad option (one line)."""


def _parser() -> argparse.ArgumentParser:
    from graph_trainer.job_config.load import shipped_configs
    from graph_trainer.layouts.cluster import DEVICES

    p = argparse.ArgumentParser(
        prog="python -m graph_trainer.plan",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=_Formatter,
        allow_abbrev=False,  # an abbreviation would swallow a trainer option the user meant
    )
    configs = ", ".join(shipped_configs())
    p.add_argument(
        "--config",
        metavar="NAME_OR_PATH",
        help=f"the trainer's TOML config: a shipped name ({configs}) or a path (default: the trainer's defaults)",
    )
    p.add_argument("--out", default="outputs/plan", metavar="DIR", help="folder of plan.json and plan.png")
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--cluster.gpus", dest="gpus", type=int, default=8, metavar="N", help="GPUs in all")
    cluster.add_argument(
        "--cluster.gpus_per_node", dest="gpus_per_node", type=int, default=8, metavar="N", help="GPUs a node"
    )
    devices = ", ".join(DEVICES)
    cluster.add_argument(
        "--cluster.device",
        dest="device",
        default="h100-80gb",
        metavar="NAME",
        help=f"one of {devices} (figures and sources: docs/planner.md), or cpu (this machine)",
    )
    # Every figure of the device table can be overridden; efficiency: the fraction of peak compute runs at.
    for name, what in (
        ("memory_gib", "memory per GPU, GiB"),
        ("peak_tflops", "dense bf16 peak, TFLOP/s"),
        ("intra_gbps", "intra-node bandwidth per GPU and direction, GB/s"),
        ("inter_gbps", "inter-node bandwidth per GPU and direction, GB/s"),
        ("efficiency", "the fraction of peak compute the step runs at"),
    ):
        help = f"{what} (default: the device's)"
        cluster.add_argument(f"--cluster.{name}", dest=name, type=float, metavar="X", help=help)
    batch = p.add_argument_group("batch (default: the config's local batch x GPUs sequences)")
    batch.add_argument("--batch.global_seqs", dest="global_seqs", type=int, metavar="N", help="sequences a step")
    batch.add_argument(
        "--batch.global_tokens", dest="global_tokens", type=int, metavar="N", help="tokens a step (x seq_len)"
    )
    space = p.add_argument_group("search space (each option takes one value or several)")
    space.add_argument("--search.ac_modes", dest="ac_modes", nargs="+", default=["none", "selective", "full"],
                       metavar="MODE",
                       help="activation_checkpoint.mode values (budget: planned to the device's memory)")  # fmt: skip
    space.add_argument("--search.loss_chunk_sizes", dest="chunks", type=int, nargs="+", metavar="N",
                       help="training.loss_chunk_size values (default: the config's)")  # fmt: skip
    space.add_argument("--search.optimizer_in_graph", dest="in_graph", nargs="+", default=["false"], metavar="BOOL",
                       help="compile.trace_optimizer values")  # fmt: skip
    # Prefetch on, as FSDP2 runs: the cost model hides FSDP's all-gathers behind compute (docs/planner.md).
    space.add_argument("--search.fsdp_prefetch", dest="prefetch", nargs="+", default=["true"], metavar="BOOL",
                       help="parallelism.fsdp_prefetch values")  # fmt: skip
    space.add_argument("--search.exact", dest="exact", type=int, default=4, metavar="N",
                       help="exact plans that fit to rank")  # fmt: skip
    # Off by default: a pp row's exact plan runs every stage's step on fake tensors at the model's depth, minutes a
    # row at 70B (docs/planner.md, "Pipeline parallelism"); the screen's estimate alone is never ranked.
    space.add_argument("--search.pp", dest="pipelines", choices=("true", "false"), default="false",
                       help="search pipeline parallelism too (parallelism.pp and its schedule)")  # fmt: skip
    return p


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and every option's default shown, as the trainer's --help shows them (a list as
    its words; an option without a default says in its help what stands in for one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or not action.option_strings or "default:" in text:
            return text
        shown = " ".join(action.default) if isinstance(action.default, list) else action.default
        return f"{text} (default: {shown})".lstrip()


def trainer_argv(opts: argparse.Namespace, rest: list[str]) -> list[str]:
    """The trainer's own command line inside the planner's: --config and every option the planner does not own."""
    return (["--config", opts.config] if opts.config else []) + rest


def main(argv: list[str] | None = None) -> int:
    from graph_trainer.errors import UserError

    argv = sys.argv[1:] if argv is None else argv
    opts, rest = _parser().parse_known_args(argv)
    try:
        return _plan(opts, trainer_argv(opts, rest))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


def _plan(opts: argparse.Namespace, rest: list[str]) -> int:
    import torch

    from graph_trainer.distributed import layout
    from graph_trainer.errors import UserError
    from graph_trainer.job_config.cli import given_keys, load_config
    from graph_trainer.job_config.pretrained import model_name
    from graph_trainer.layouts import search
    from graph_trainer.layouts.cluster import build_cluster
    from graph_trainer.layouts.cost_model import PREFETCH
    from graph_trainer.layouts.progress import Progress
    from graph_trainer.layouts.report import nothing_fits, print_table, write_json, write_picture
    from graph_trainer.observability.units import MIB, to_gib

    start, cpu_start = time.perf_counter(), time.process_time()
    overrides = {k: getattr(opts, k) for k in ("memory_gib", "peak_tflops", "intra_gbps", "inter_gbps", "efficiency")}
    cluster = build_cluster(opts.device, opts.gpus, opts.gpus_per_node, overrides)
    cfg, cli = load_config(rest)
    if (why := layout.not_searched(cfg.parallelism)) is not None:
        raise UserError(why)
    pipelines = opts.pipelines == "true"
    staged = [d for d in layout.staged_dims() if getattr(cfg.parallelism, d) > 1]
    if staged and not pipelines:
        d = staged[0]
        raise UserError(f"--parallelism.{d} is searched only with --search.pp true; pass it, or drop --parallelism.{d}")
    if opts.device != "cpu":  # the bf16 plan: as the trainer runs on a GPU (bf16 compute, bf16 FSDP gathers)
        cfg.training.dtype = "bfloat16"
    # AC budget: the fewest recompute FLOPs that fit the device, whatever the layout, unless the user gave a budget.
    own_budget = "activation_checkpoint.memory_budget" in given_keys(cli)
    if "budget" in opts.ac_modes and not own_budget:
        cfg.activation_checkpoint.memory_budget = f"{cluster.memory_bytes // MIB}MiB"
    seq = cfg.training.seq_len
    if opts.global_tokens is not None:
        if opts.global_tokens % seq:
            raise UserError(f"--batch.global_tokens {opts.global_tokens} is not a multiple of seq_len {seq}")
        opts.global_seqs = opts.global_tokens // seq
    global_seqs = opts.global_seqs or cfg.training.local_batch_size * cluster.gpus
    chunks = tuple(opts.chunks) if opts.chunks else (cfg.training.loss_chunk_size,)
    in_graph = tuple(v.lower() == "true" for v in opts.in_graph)
    prefetch = tuple(v.lower() == "true" for v in opts.prefetch)
    layouts, skipped = search.layouts(cfg, cluster, pipelines=pipelines)
    offered = {PREFETCH: prefetch}  # the option --search.fsdp_prefetch tries
    space = search.candidates(cfg, layouts, global_seqs, tuple(opts.ac_modes), chunks, in_graph, offered)
    cands = space.cands
    if not cands:
        raise UserError(
            f"no layout of {cluster.gpus} GPUs that the trainer accepts divides the global batch of {global_seqs} "
            "sequences: pick a global batch that is a multiple of the data-parallel degree"
        )
    kept = [c for c in cands if search.state_bytes(cfg, c) < cluster.memory_bytes]
    print(
        f"plan: {model_name(cfg)} on {cluster.gpus} x {cluster.device.name} "
        f"({cluster.gpus_per_node} per node), global batch {global_seqs} x {seq} tokens; {len(cands)} candidates, "
        f"{len(cands) - len(kept)} pruned (state alone over memory); screening the rest",
        flush=True,
    )
    out = Path(opts.out)
    details = out / "plan.json"
    if not pipelines:
        print(PP_NOT_SEARCHED)
    if "budget" in opts.ac_modes:
        whose = "yours" if own_budget else "the device's memory; less: --cluster.memory_gib"
        print(
            f"AC budget planned to --activation_checkpoint.memory_budget {cfg.activation_checkpoint.memory_budget} "
            f"({whose}): each layout's fewest recompute FLOPs under it"
        )
    if skipped:
        print(f"skipped {len(skipped)} layouts the model or the trainer refuses, e.g. {skipped[0]} ({details})")
    refused = sum(space.refused.values())
    if refused:
        first = next(iter(space.refused))
        print(f"skipped {refused} candidates the trainer refuses, e.g. {space.refused[first]} of {first} ({details})")
    plans = search.Plans(cfg, torch.device("cpu"), say=_say, progress=Progress(_say))
    rows = search.screen(cfg, cluster, kept, cluster.device.efficiency, plans) if kept else []
    if kept and not rows:  # not a memory verdict: no candidate could be planned at all
        first = plans.failed[0]
        raise UserError(
            f"no candidate could be planned ({len(plans.failed)} refused), e.g. {first['candidate']}: {first['error']}"
        )
    fitting = sorted((r for r in rows if r.peak <= cluster.memory_bytes), key=lambda r: r.time.total_s)
    exact = search.plan_best(cfg, cluster, fitting, opts.exact, cluster.device.efficiency, plans)
    final = sorted((r for r in exact if search.is_exact_fit(r, cluster)), key=lambda r: r.exact_time.total_s)
    if repeats := search.repeats_of_none(final):  # said once below, and left out of the table
        final = [r for r in final if r not in repeats]
    # Upper bounds that fit and would beat the best exact plan: listed, never ranked (every ranked row is exact).
    bounds = [
        r for r in exact
        if r.exact is not None and r.exact.approximate and r.exact.peak_bytes <= cluster.memory_bytes
        and (not final or r.exact_time.total_s < final[0].exact_time.total_s)
    ]  # fmt: skip
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(
        f"plan: {len(rows)} screened, {len(exact)} planned exactly; {plans.depth_free} depth-free plans, "
        f"{len(plans.full)} whole-depth, {elapsed:.0f} s ({cpu:.0f} s of CPU)"
    )
    if plans.failed:
        first = plans.failed[0]
        print(
            f"{len(plans.failed)} candidates could not be planned, e.g. {first['candidate']} ({first['stage']}): "
            f"{first['error']} ({details})"
        )
    for row, peak_err, time_err in search.screen_errors(exact):
        print(f"screen vs exact: {row.cand.label()}: peak {peak_err:+.1%}, step time {time_err:+.1%}")
    if repeats:
        print(
            f"{len(repeats)} AC budget rows recompute nothing (no AC fits there) and are their AC none rows: shown "
            f"once, as none, e.g. {repeats[0].cand.label()}"
        )
    for r in bounds:
        c = r.cand
        print(
            f"not ranked, an upper bound only: {c.layout()} {c.ac_mode} {c.batch()}, peak <= "
            f"{to_gib(r.exact.peak_bytes):.2f} GiB, {r.exact_time.total_s:.2f} s a step "
            "(docs/planner.md: approximate plans)"
        )
    if bounds:
        print(BOUNDS_EXPLAINED)
    command = _command(rest, final[0].cand, cluster) if final else None
    out.mkdir(parents=True, exist_ok=True)
    counts = {"candidates": len(cands), "pruned": len(cands) - len(kept), "screened": len(rows), "exact": len(exact)}
    write_json(details, final, exact, skipped, cluster, seq, command, refused=space.refused, plans=plans, counts=counts)
    if not final:
        print(
            "nothing ranked: only the upper bounds above fit (AC budget, fsdp_grad_sync step or accumulation without "
            "FSDP is planned approximately); plan more candidates with --search.exact or other --search.ac_modes"
            if bounds
            else nothing_fits(cfg, cluster, global_seqs, cands, rows, exact)
        )
        print(f"wrote {details}")
        return EXIT_USER_ERROR
    print_table(final, cluster, seq)
    print("best plan's command:\n  " + command)
    write_picture(out / "plan.png", rows, final, cluster, seq)
    print(f"wrote {details} and {out / 'plan.png'}")
    return 0


# Said once when pp is left out of the search.
PP_NOT_SEARCHED = (
    "pipeline parallelism not searched: --search.pp true adds it (each pp row's exact plan runs every stage's step "
    "on fake tensors, minutes a row at 70B)"
)

# Why the ranked best is preferred to a faster upper bound, in one line.
BOUNDS_EXPLAINED = (
    "why the ranked best comes first: an upper bound's peak is not known to the byte (the real one is at most "
    "that, so it fits) and under AC budget its FLOPs are interpolated; the ranking holds only exact plans, so "
    "take a bound only after checking it: the trainer's --dry-run with its options plans it whole, exactly"
)


def _say(line: str) -> None:
    print(line, flush=True)  # at once: a progress line is worth nothing once the search is over


def _command(rest: list[str], cand, cluster) -> str:
    """The torchrun command line that runs `cand` with the user's own options."""
    from graph_trainer.distributed import layout
    from graph_trainer.distributed.launch import trainer_command
    from graph_trainer.job_config.schema import TrainingConfig

    per_node = min(cluster.gpus, cluster.gpus_per_node)
    argv = trainer_command(per_node, python="python")
    if cluster.gpus > per_node:  # several nodes: torchrun's rendezvous replaces --standalone
        argv = ["torchrun", f"--nnodes={cluster.gpus // per_node}", f"--nproc_per_node={per_node}",
                "--rdzv_backend=c10d", "--rdzv_endpoint=$MASTER_ADDR:29500", "-m", "graph_trainer"]  # fmt: skip
    options = [a for o in cand.overrides() for a in o.split()]
    if cluster.device.name != "cpu":
        # bf16 as on a GPU, as the parallelisms run it (FSDP: bf16 gathered parameters set the compute dtype, and
        # the trainer refuses --training.dtype bfloat16 beside them); otherwise bf16 autocast. Defaults left out.
        for name, value in layout.bf16_settings(dict(cand.degrees)).items():
            if value != getattr(TrainingConfig(), name):
                options += [f"--training.{name}", value]
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
