"""The traced step (op by op and compiled by Inductor) against what users already run, one mode per process.

    python benchmarks/peers.py                                   # CPU: debug config, AC none and selective
    python benchmarks/peers.py --overrides --model.n_layers 16 --training.local_batch_size 8
    python benchmarks/peers.py --config llama3_1b                # CUDA
    python benchmarks/peers.py --config llama3_8b --overrides --model.n_layers 6 --training.local_batch_size 1
    python -m benchmarks.peers --modes eager trace --save peers  # also benchmarks/results/peers.json#steps

Modes (each with activation checkpointing none and selective):
  eager                        plain PyTorch (torch.optim.AdamW outside)
  eager+compile(block)         torch.compile on each transformer block (the torchtitan way)
  eager+compile(model)         torch.compile on the whole model
  trace / trace+opt            the traced step run op by op, optimizer outside / inside the graph
  trace+inductor[+opt]         the traced step compiled by Inductor (compile.backend = inductor), region by region
  trace+inductor(whole)[+opt]  ... compiled as one graph (compile.regional = false)
  trace+inductor+cudagraphs[+opt]   ... replayed as one CUDA graph (CUDA only; skipped elsewhere)

Each mode runs in its own process (GPU memory does not hold several 1B trainers, and compile
caches must not leak between modes): `--warmup` steps (the first one traces/compiles), then
`--steps` timed steps with memory tracking off, then one step with the CPU tracker on for the peak.
Prints step time (median), tokens/s, MFU (when the device's peak FLOPs are known), peak active and
reserved memory, and compile time; writes `peers.json` and `peers.md` to `--out`.

CPU peaks: the exact live-tensor tracker (graph_trainer.observability.memory) sees eager, traced and
trace+inductor steps (graph_trainer routes Inductor's buffers through the dispatcher). It cannot
see inside `torch.compile`d modules (Inductor's allocations skip the dispatcher there, and a
dispatch mode would force Dynamo to recompile), so those peaks are reported as unmeasured on CPU.
Compile time: trace + Inductor time for trace modes; for torch.compile modes, the first step's
time minus the median step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_trainer.observability.units import GIB  # noqa: E402

MODES = (
    "eager",
    "eager+compile(block)",
    "eager+compile(model)",
    "trace",
    "trace+opt",
    "trace+inductor",
    "trace+inductor+opt",
    "trace+inductor(whole)",
    "trace+inductor(whole)+opt",
    "trace+inductor+cudagraphs",
    "trace+inductor+cudagraphs+opt",
)


def mode_overrides(mode: str) -> list[str]:
    """Trainer options of a mode (torch.compile is applied to the model afterwards, see `run_mode`)."""
    if mode.startswith("eager"):
        return ["--compile.mode", "eager"]
    out = ["--compile.mode", "trace", "--compile.trace_optimizer", str(mode.endswith("+opt")).lower()]
    if "inductor" in mode:
        out += ["--compile.backend", "inductor"]
    if "cudagraphs" in mode:
        out += ["--compile.cudagraphs", "true"]
    if "cudagraphs" in mode or "whole" in mode:
        out += ["--compile.regional", "false"]
    return out


def run_mode(mode: str, ac: str, config: str, overrides: list[str], warmup: int, steps: int) -> dict:
    """One mode in this process: the figures of one table row."""

    from benchmarks.common import next_batch
    from graph_trainer.job_config.cli import load_config
    from graph_trainer.tracer.layers import transformer_layers
    from graph_trainer.trainer import Trainer

    folder = tempfile.mkdtemp(prefix="gt_peers_")
    cfg, _ = load_config(
        [
            "--config",
            config,
            *overrides,
            *mode_overrides(mode),
            "--activation_checkpoint.mode",
            ac,
            "--job.dump_folder",
            folder,
            "--metrics.enable_tensorboard",
            "false",
        ]
    )
    trainer = Trainer(cfg)
    trainer.log = lambda message: None
    if mode == "eager+compile(model)":
        trainer.model.compile()
    elif mode == "eager+compile(block)":
        for fqn in transformer_layers(trainer.model):
            trainer.model.get_submodule(fqn).compile()
    torch_compiled = "compile(" in mode
    trainer.memory.track = False
    times = []
    for _ in range(warmup + steps):
        record = trainer.train_step(next_batch(trainer))
        times.append(record["step_time_s"])
    median = statistics.median(times[warmup:])
    row = {
        "mode": mode,
        "ac": ac,
        "device": trainer.device.type,
        "step_s": median,
        "tokens_per_s": record["tokens_per_s"] * record["step_time_s"] / median,
        "mfu_pct": record.get("mfu_pct", 0.0) * record["step_time_s"] / median if "mfu_pct" in record else None,
        "compile_s": (
            record.get("trace_time_s", 0.0) + record.get("inductor_time_s", 0.0)
            if not torch_compiled
            else times[0] - median
        ),
        "first_step_s": times[0],
    }
    if trainer.device.type == "cuda" or not torch_compiled:
        trainer.memory.track = True
        record = trainer.train_step(next_batch(trainer))
        row["peak_active_bytes"] = record.get("peak_active_bytes")
        row["peak_reserved_bytes"] = record.get("peak_reserved_bytes")
        row["estimated_peak_bytes"] = record.get("estimated_peak_bytes")
    return row


def _fmt_gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.3f}"


def markdown(rows: list[dict], title: str | None = None) -> str:
    """The rows as a markdown table, under `title` when one is given."""
    lines = [] if title is None else [title, ""]
    lines += [
        "| ac | mode | step s | vs eager | tokens/s | MFU % | peak active GiB | peak reserved GiB | compile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    eager = {r["ac"]: r["step_s"] for r in rows if r["mode"] == "eager" and "step_s" in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['ac']} | {r['mode']} | {r['error']} | | | | | | |")
            continue
        ratio = f"{r['step_s'] / eager[r['ac']]:.2f}x" if r["ac"] in eager else "-"
        mfu = "-" if r.get("mfu_pct") is None else f"{r['mfu_pct']:.1f}"
        lines.append(
            f"| {r['ac']} | {r['mode']} | {r['step_s']:.3f} | {ratio} | {r['tokens_per_s']:,.0f} | {mfu} | "
            f"{_fmt_gib(r.get('peak_active_bytes'))} | {_fmt_gib(r.get('peak_reserved_bytes'))} | "
            f"{r['compile_s']:.1f} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama3_debug")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--ac", nargs="+", default=["none", "selective"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="outputs/peers")
    parser.add_argument("--save", metavar="NAME", help="also write the table to benchmarks/results/NAME.json")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per mode before it is reported as failed")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "AC"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--overrides",
        nargs=argparse.REMAINDER,
        default=[],
        help="trainer options for every mode, e.g. --overrides --model.n_layers 16 (must be last)",
    )
    return parser


def _run_worker(args: argparse.Namespace, mode: str, ac: str) -> dict:
    """One mode in a fresh process (so no mode inherits another's caches or allocator state); its row."""
    cmd = [
        sys.executable,
        __file__,
        "--config",
        args.config,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--worker",
        mode,
        ac,
        "--overrides",
        *args.overrides,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "ac": ac, "error": f"timed out after {args.timeout} s"}
    found = [line for line in proc.stdout.splitlines() if line.startswith("PEERS_ROW ")]
    if proc.returncode != 0 or not found:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"mode": mode, "ac": ac, "error": f"failed: {tail[:160]}"}
    return json.loads(found[-1].removeprefix("PEERS_ROW "))


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = (
        f"`benchmarks/peers.py --config {args.config} {' '.join(args.overrides)}`: median of {args.steps} "
        f"steps after {args.warmup} warm-up, one process per mode"
    )
    (out / "peers.json").write_text(
        json.dumps(
            {
                "config": args.config,
                "overrides": args.overrides,
                "steps": args.steps,
                "warmup": args.warmup,
                "rows": rows,
            },
            indent=1,
        )
    )
    table = markdown(rows, title)
    (out / "peers.md").write_text(table + "\n")
    print("\n" + table)
    print(f"\nwritten: {out / 'peers.json'}, {out / 'peers.md'}")
    if args.save:
        from benchmarks import results

        results.save(args.save, {"steps": markdown(rows)}, {"steps": args.steps, "warmup": args.warmup, "rows": rows})


def main() -> None:
    args = _parser().parse_args()
    if args.worker:
        row = run_mode(args.worker[0], args.worker[1], args.config, args.overrides, args.warmup, args.steps)
        print("PEERS_ROW " + json.dumps(row), flush=True)
        return

    import torch

    cuda = torch.cuda.is_available()
    rows = []
    for ac in args.ac:
        for mode in args.modes:
            if "cudagraphs" in mode and not cuda:
                print(f"skip {mode} ({ac}): CUDA graphs need a CUDA device", flush=True)
                continue
            start = time.perf_counter()
            row = _run_worker(args, mode, ac)
            rows.append(row)
            print(
                f"{ac:9} {mode:32} {row.get('step_s', float('nan')):8.3f} s/step  "
                f"peak {_fmt_gib(row.get('peak_active_bytes'))} GiB  compile {row.get('compile_s', 0):6.1f} s  "
                f"({time.perf_counter() - start:.0f} s wall){'  ' + row['error'] if 'error' in row else ''}",
                flush=True,
            )
    _write(args, rows)


if __name__ == "__main__":
    main()
