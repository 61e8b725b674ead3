"""The one GPU check: the GPU tests, the 1B step time of each way to run it, the memory estimates against the CUDA
caching allocator, and a bf16 fine-tune step, in at most 8 min 20 s on one H100 or H200. One JSON, one table.

    python -m benchmarks.gpu_check                  # CUDA: the real sizes below; no CUDA device: says so, exits 0
    python -m benchmarks.gpu_check --small          # any device: the same parts on a tiny 6-layer model

What it runs (each configuration in its own process: two 1B trainers do not fit one 80 GB card, and no mode may
inherit another's compile caches or allocator state):
- `pytest -m gpu`: its passed / failed / errors / skipped counts (read from pytest's JUnit XML);
- step time of configs/llama3_1b.toml (1 x 2048, bf16 autocast, its selective AC): eager, eager + torch.compile
  per block, traced, traced + Inductor (benchmarks/peers.py's modes, run by its `run_mode`): medians of 5 steps
  after 2 warm-up, and each one's ratio to eager;
- memory of the traced step for each AC mode (none, selective, full, and budget at `BUDGET`'s memory_budget):
  the trainer's estimate against the caching allocator's peak active bytes, and the allocator's peak allocated
  and reserved bytes (`torch.cuda.max_memory_allocated` / `max_memory_reserved`, one step after warm-up) next to
  the caching-allocator simulator's prediction for them (graph_trainer/plan/caching_allocator.py replaying two
  steps of the same job's allocations, graph_trainer/plan/allocation_stream.py). The measured step runs on an
  allocator warmed by the steps before it; the simulator's two steps start from an empty one;
- one fine-tune step in bf16: a 6-layer Llama of the 1B's width written as a Hugging Face folder by transformers
  (random weights, bf16 files) into a temporary folder, loaded with --checkpoint.initial_load_path, trained one
  step after the traced first one: tokens/s and peaks. Without transformers, graph_trainer's own writer writes
  the folder, and the row says so.

Budget: every part has a wall-clock cap (`Sizes.caps_s`), and the whole check stops at `Sizes.budget_s` (500 s):
a part that would start after it is reported as not run, one that runs past its cap as timed out. `--small` runs
the same code on the debug config's tiny shapes (tests/test_gpu_check.py runs it on CPU in CI).

On the GPU image (torch 2.11, Python 3.12, no network, no tomli-w): carry this repository and tomli-w's wheel
(`pip download tomli-w --no-deps -d wheels` on a machine with a network; transformers and safetensors likewise if
the image lacks them), then, from the repository root:

    pip install --no-deps wheels/*.whl
    PYTHONPATH=$PWD python -m benchmarks.gpu_check

`--no-deps` keeps the image's torch; `PYTHONPATH` runs the tree as it is, with nothing of it installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks import results

REPO = Path(__file__).resolve().parent.parent
ROW = "GPU_CHECK_ROW "  # a worker's one line of JSON on stdout starts with this
MIN_START_S = 5  # a part with less time than this left before the budget ends is not started


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run of the check measures: the real sizes on CUDA, or tiny ones that any CPU runs."""

    config: str  # the shipped config of the step-time, memory and fine-tune runs
    overrides: tuple[str, ...]  # ... with these options
    modes: tuple[str, ...]  # benchmarks.peers modes whose step times are compared, at the config's AC mode
    ac_modes: tuple[str, ...]  # AC modes whose traced step's memory is compared with the estimates
    finetune: tuple[str, ...]  # options of the fine-tune job on top of `overrides`
    pytest_args: tuple[str, ...]  # what `pytest -m gpu` collects (empty: the whole suite)
    warmup: int  # steps before the timed ones (the first traces / compiles)
    steps: int  # timed steps
    budget_s: float  # the whole check's wall-clock limit
    caps_s: dict[str, float]  # each part's wall-clock limit: "pytest", a mode, "memory" or "finetune"
    budget: tuple[str, ...] = ()  # options of the `budget` AC row on top of `overrides`


MODES = ("eager", "eager+compile(block)", "trace", "trace+inductor")
# `budget`: the solver's plan, measured against its estimate. Not at the schema's default memory_budget (0.5): for
# the 1B on CUDA that is below the smallest reachable peak (refused in one line: "0.734 or more"; H200, 2026-11-30).
AC_MODES = ("none", "selective", "full", "budget")
BUDGET = ("--activation_checkpoint.memory_budget", "0.8")
FINETUNE = ("--model.n_layers", "6", "--training.dtype", "bfloat16")  # >= 6 blocks: the depth-free plan is taken

GPU = Sizes(
    config="llama3_1b",
    overrides=(),
    modes=MODES,
    ac_modes=AC_MODES,
    finetune=FINETUNE,
    pytest_args=(),
    warmup=2,
    steps=5,
    budget_s=500,
    # Each 1B process spends ~15 s starting and building before its first step, ~20 s tracing, and ~20 s in the
    # simulator (the full-depth trace on fake tensors); compiling adds ~30-60 s. Measured on an H200 (torch 2.11,
    # 2026-11-30): pytest 70 s (45 s when its trainers fail to start), eager 20, compile per block 40, trace 24,
    # trace + Inductor 63, memory rows 19 and 26, budget 88 (its depth-free plan falls back to the whole depth on
    # CUDA, then a 32 s solve), fine-tune 24. The caps sum to 500 s.
    caps_s={
        "pytest": 90,
        "eager": 30,
        "eager+compile(block)": 55,
        "trace": 35,
        "trace+inductor": 75,
        "memory": 35,
        "budget": 110,  # the plan's solve instead of the simulator's run (`planned_runs`)
        "finetune": 35,
    },
    budget=BUDGET,
)
SMALL = Sizes(
    config="llama3_debug",
    overrides=(
        *("--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2"),
        *("--training.seq_len", "32", "--training.local_batch_size", "2"),
    ),
    # Every process costs seconds of CPU in CI: two modes (eager, for the ratios), and the traced step at the
    # config's AC mode (none), which serves both the step time and the memory rows.
    modes=("eager", "trace"),
    ac_modes=("none",),
    finetune=FINETUNE,
    pytest_args=("tests/test_gpu_check.py",),  # its one GPU test (skipped off CUDA): quick to collect
    warmup=1,
    steps=1,
    budget_s=900,
    caps_s=dict.fromkeys(("pytest", *MODES, "memory", "finetune"), 300),
)


# --------------------------------------------------------------------------------------------- workers


def _trainer_args(sizes: Sizes, *extra: str) -> list[str]:
    return ["--config", sizes.config, *sizes.overrides, *extra]


def _allocator_peaks(device: torch.device) -> dict[str, int | None]:
    """The CUDA allocator's peak allocated bytes since the last step started (`max_memory_allocated`; the trainer's
    record has active and reserved); None off CUDA, where the tracker's figure stands for all three."""
    from graph_trainer.observability.memory import cuda_memory_stats

    stats = cuda_memory_stats(device)
    return {"peak_allocated_bytes": stats.get("peak_allocated_bytes")}


def simulated_peaks(args: Sequence[str], device: torch.device) -> dict[str, int | bool]:
    """The caching-allocator simulator's peaks for two traced steps of the job `args` configures, on `device`
    (capped at the card's memory on CUDA)."""
    from graph_trainer.job_config.cli import load_config
    from graph_trainer.plan.allocation_stream import graph_step_stream
    from graph_trainer.plan.caching_allocator import replay

    cfg, _ = load_config(list(args))
    _, events = graph_step_stream(cfg, device)
    cap = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    peaks = replay(events, cap)
    return {
        "sim_requested_bytes": peaks.requested_bytes,
        "sim_allocated_bytes": peaks.allocated_bytes,
        "sim_reserved_bytes": peaks.reserved_bytes,
        "sim_oom": peaks.oom,
    }


def measure_run(sizes: Sizes, mode: str, ac: str, warmup: int, steps: int, simulate: bool) -> dict:
    """One configuration in this process: benchmarks.peers' row of `mode` at AC `ac` (median step time, tokens/s,
    the peaks of one tracked step), the allocator's allocated peak of that step, and with `simulate` the simulator's
    prediction for the same traced job."""
    import gc

    from benchmarks.peers import mode_overrides, run_mode

    overrides = [*sizes.overrides, *(sizes.budget if ac == "budget" else ())]
    row = run_mode(mode, ac, sizes.config, overrides, warmup, steps)
    device = torch.device(row["device"])
    row.update(_allocator_peaks(device))
    if simulate:
        gc.collect()  # the trainer is gone: its memory back before the simulator's fake job is built
        row.update(
            simulated_peaks(_trainer_args(sizes, *mode_overrides(mode), "--activation_checkpoint.mode", ac), device)
        )
    return row


def write_hf_llama(folder: Path, model_args, adapter, device: torch.device) -> str:
    """A random Llama of `model_args` written as a Hugging Face folder in bf16; says who wrote it."""
    torch.manual_seed(0)
    try:
        import transformers
    except ImportError:
        from graph_trainer.checkpoint.hf import save_hf
        from graph_trainer.job_config.model_args import get_model_spec

        with torch.device(device):
            model = get_model_spec("llama3").model_cls(model_args)
        save_hf(model.state_dict(), adapter, folder, dtype=torch.bfloat16)
        return "graph_trainer's save_hf (transformers is not installed)"
    config = transformers.LlamaConfig.from_dict(adapter.hf_config(torch.bfloat16))
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return f"transformers {transformers.__version__}"


def loaded_as_written(model: torch.nn.Module, adapter, folder: Path, n_layers: int) -> bool:
    """Whether the model's last block holds the folder's weights: its w2 (no layout change) against the file's
    bf16 tensor, which float32 holds exactly."""
    from safetensors import safe_open

    name = f"layers.{n_layers - 1}.feed_forward.w2.weight"
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safetensors file is no mapping
                if adapter.our_name(key) == name:
                    return torch.equal(model.get_parameter(name).detach().cpu().float(), f.get_tensor(key).float())
    return False


def finetune_step(sizes: Sizes) -> dict:
    """One bf16 fine-tune step in this process: the HF folder written, loaded by --checkpoint.initial_load_path,
    one traced step (it traces), then the measured step with memory tracking on."""
    import gc

    from benchmarks.common import next_batch
    from graph_trainer.checkpoint.hf import hf_adapter
    from graph_trainer.job_config.cli import load_config
    from graph_trainer.job_config.load import resolve_model_args
    from graph_trainer.job_config.model_args import get_model_spec
    from graph_trainer.runtime.device import resolve_device
    from graph_trainer.tracer.layers import transformer_layers
    from graph_trainer.trainer import Trainer

    args = _trainer_args(sizes, *sizes.finetune)
    cfg, _ = load_config(args)
    model_args = resolve_model_args(cfg)
    adapter = hf_adapter(get_model_spec(cfg.model.name), model_args)
    device = resolve_device(cfg.training.device)
    with tempfile.TemporaryDirectory(prefix="gt_gpu_check_") as tmp:
        folder = Path(tmp) / "hf"
        writer = write_hf_llama(folder, model_args, adapter, device)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the writer's model leaves the allocator before the trainer's step is measured
        run = ["--checkpoint.initial_load_path", str(folder), "--job.dump_folder", str(Path(tmp) / "run")]
        cfg, _ = load_config([*args, *run, "--metrics.enable_tensorboard", "false"])
        trainer = Trainer(cfg)
        trainer.log = lambda message: None
        as_written = loaded_as_written(trainer.model, adapter, folder, model_args.n_layers)
        trainer.memory.track = False
        first = trainer.train_step(next_batch(trainer))
        trainer.memory.track = True
        record = trainer.train_step(next_batch(trainer))
    return {
        "device": device.type,
        "writer": writer,
        "blocks": len(transformer_layers(trainer.model)),
        "loaded_as_written": as_written,
        "first_step_s": first["step_time_s"],
        "step_s": record["step_time_s"],
        "tokens_per_s": record["tokens_per_s"],
        "loss": record["loss"],
        "peak_active_bytes": record.get("peak_active_bytes"),
        "peak_reserved_bytes": record.get("peak_reserved_bytes"),
        "estimated_peak_bytes": record.get("estimated_peak_bytes"),
        **_allocator_peaks(device),
    }


def worker(spec: dict) -> dict:
    """The part `spec` describes (written by `_worker_command`), run in this process."""
    sizes = SIZES[spec["sizes"]]
    if spec["kind"] == "finetune":
        return finetune_step(sizes)
    return measure_run(sizes, spec["mode"], spec["ac"], spec["warmup"], spec["steps"], spec["simulate"])


# --------------------------------------------------------------------------------------------- the check


@dataclasses.dataclass
class Budget:
    """The check's wall-clock limit, spent by its parts one after another."""

    total_s: float
    start: float = dataclasses.field(default_factory=time.monotonic)

    def left_s(self) -> float:
        """Seconds left of the budget."""
        return self.start + self.total_s - time.monotonic()


def _run(command: list[str], timeout: float) -> tuple[int, str, str] | None:
    """(exit status, stdout, stderr) of `command` run from the repository root with it on PYTHONPATH; None when it
    ran past `timeout` (its whole process group is killed: compile workers included)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    with subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return None
    return proc.returncode, out, err


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1][:200]


def run_part(budget: Budget, cap_s: float, command: list[str], read: Callable[[int, str, str], dict]) -> dict:
    """Run one part in its own process within its cap and the budget; `read` turns its (status, stdout, stderr)
    into its figures. A part not started, timed out or failed is a row with an `error` that says so."""
    if budget.left_s() < MIN_START_S:
        return {"error": f"not run: the check's {budget.total_s:.0f} s budget is spent"}
    timeout = min(cap_s, budget.left_s())  # its cap, or what is left of the budget if that is less
    start = time.monotonic()
    done = _run(command, timeout)
    wall_s = time.monotonic() - start
    row = {"error": f"timed out after {timeout:.0f} s"} if done is None else read(*done)
    return {**row, "wall_s": wall_s}


def read_worker(status: int, out: str, err: str) -> dict:
    """A worker's row: the JSON of its `ROW` line."""
    found = [line for line in out.splitlines() if line.startswith(ROW)]
    if status != 0 or not found:
        return {"error": f"failed (exit {status}): {_last_line(err)}"}
    return json.loads(found[-1].removeprefix(ROW))


def pytest_counts(junit_xml: Path) -> dict:
    """Passed, failed, errors and skipped counts of a pytest run, and the failed tests' ids, from its JUnit XML."""
    root = ElementTree.parse(junit_xml).getroot()
    cases = list(root.iter("testcase"))
    outcome = {kind: [c for c in cases if c.find(kind) is not None] for kind in ("failure", "error", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in outcome["failure"] + outcome["error"]]
    return {
        "passed": len(cases) - sum(len(v) for v in outcome.values()),
        "failed": len(outcome["failure"]),
        "errors": len(outcome["error"]),
        "skipped": len(outcome["skipped"]),
        "failed_tests": failed,
    }


def run_pytest(budget: Budget, sizes: Sizes, folder: Path) -> dict:
    """`pytest -m gpu` in its own process: its counts."""
    junit = folder / "gpu_tests.xml"
    # A module that cannot be imported (e.g. on the image's older torch) is counted as an error, and the other GPU
    # tests still run.
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    command.append("--continue-on-collection-errors")

    def read(status: int, out: str, err: str) -> dict:
        # 0: all passed, 1: some failed, 5: none collected; anything else stopped pytest itself.
        if status not in (0, 1, 5) or not junit.is_file():
            return {"error": f"pytest stopped (exit {status}): {_last_line(out + err)}"}
        return pytest_counts(junit)

    return run_part(budget, sizes.caps_s["pytest"], [*command, *sizes.pytest_args], read)


def _worker_command(spec: dict) -> list[str]:
    return [sys.executable, "-m", "benchmarks.gpu_check", "--worker", json.dumps(spec)]


def planned_runs(sizes: Sizes, config_ac: str) -> list[tuple[tuple[str, str], float, dict]]:
    """((mode, AC), cap, worker spec) of every trainer run, in the order they run: the step-time modes at the
    config's AC mode, then the traced step at each other AC mode for memory. The traced step at the config's AC
    mode serves both (its timing and its simulator prediction come from one process)."""
    runs = []
    for mode in sizes.modes:
        simulate = mode == "trace" and config_ac in sizes.ac_modes
        spec = {"mode": mode, "ac": config_ac, "warmup": sizes.warmup, "steps": sizes.steps, "simulate": simulate}
        runs.append(((mode, config_ac), sizes.caps_s[mode], spec))
    for ac in sizes.ac_modes:
        if ("trace", ac) not in {key for key, _, _ in runs}:
            # Memory only. The simulator would solve budget's plan a second time: its row is the estimate against
            # the allocator.
            spec = {"mode": "trace", "ac": ac, "warmup": 1, "steps": 1, "simulate": ac != "budget"}
            runs.append((("trace", ac), sizes.caps_s.get(ac, sizes.caps_s["memory"]), spec))
    return runs


def _progress(part: str, row: dict) -> None:
    """One line on stderr as each part ends (the table comes at the end, on stdout)."""
    print(f"gpu_check: {part}: {row.get('error') or 'done'} ({row['wall_s']:.0f} s)", file=sys.stderr, flush=True)


def run_check(sizes: Sizes, name: str, config_ac: str, folder: Path, budget: Budget) -> dict:
    """Every part, in order, each in its own process; their figures."""
    data = {"pytest": run_pytest(budget, sizes, folder), "runs": []}
    _progress("pytest -m gpu", data["pytest"])
    for (mode, ac), cap_s, spec in planned_runs(sizes, config_ac):
        row = run_part(budget, cap_s, _worker_command({"kind": "run", "sizes": name, **spec}), read_worker)
        data["runs"].append({**row, "mode": mode, "ac": ac})
        _progress(f"{mode} (ac {ac})", row)
    finetune = _worker_command({"kind": "finetune", "sizes": name})
    data["finetune"] = run_part(budget, sizes.caps_s["finetune"], finetune, read_worker)
    _progress("fine-tune", data["finetune"])
    return data


# --------------------------------------------------------------------------------------------- the table

HEADER = (
    "part",
    "run",
    "step s",
    "vs eager",
    "tokens/s",
    "active GiB (estimate, ratio)",
    "allocated GiB (simulated, ratio)",
    "reserved GiB (simulated, ratio)",
    "note",
)


def gib(measured: int | None, predicted: int | None = None) -> str:
    """`measured` in GiB, with `predicted` and predicted / measured beside it when there is a prediction."""
    shown = "-" if measured is None else f"{measured / 2**30:.3f}"
    if predicted is None:
        return shown
    ratio = f", {predicted / measured:.3f}x" if measured else ""
    return f"{shown} ({predicted / 2**30:.3f}{ratio})"


def _row(part: str, run: str, r: dict, *, vs_eager: str = "-", predicted: bool = False, note: str = "") -> list:
    if "error" in r:
        return [part, run, "-", "-", "-", "-", "-", "-", r["error"]]
    return [
        part,
        run,
        f"{r['step_s']:.3f}",
        vs_eager,
        f"{r['tokens_per_s']:,.0f}",
        gib(r.get("peak_active_bytes"), r.get("estimated_peak_bytes") if predicted else None),
        gib(r.get("peak_allocated_bytes"), r.get("sim_allocated_bytes")),
        gib(r.get("peak_reserved_bytes"), r.get("sim_reserved_bytes")),
        note,
    ]


def _pytest_note(counts: dict) -> str:
    if "error" in counts:
        return counts["error"]
    note = (
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
    )
    return note + "".join(f"; {t}" for t in counts["failed_tests"])


def table(data: dict, sizes: Sizes, config_ac: str) -> str:
    """The check's one table: the GPU tests, each mode's step time and its ratio to eager, the traced step's memory
    at each AC mode against the estimate and the simulator, and the fine-tune step."""
    rows = [["pytest -m gpu", " ".join(sizes.pytest_args) or "tests/", *["-"] * 6, _pytest_note(data["pytest"])]]
    runs = {(r["mode"], r["ac"]): r for r in data["runs"]}
    eager = runs.get(("eager", config_ac), {}).get("step_s")
    for mode in sizes.modes:
        r = runs[(mode, config_ac)]
        ratio = f"{r['step_s'] / eager:.2f}x" if eager and "step_s" in r else "-"
        compiled = f"trace + compile {r['compile_s']:.1f} s" if "compile_s" in r and mode != "eager" else ""
        rows.append(_row("step time", f"{mode}, ac {config_ac}", r, vs_eager=ratio, note=compiled))
    for ac in sizes.ac_modes:
        r = runs[("trace", ac)]
        note = "simulator: OOM" if r.get("sim_oom") else ""
        if ac == "budget":
            from graph_trainer.job_config.schema import ActivationCheckpointConfig

            asked = dict(zip(sizes.budget[::2], sizes.budget[1::2], strict=True))
            default = ActivationCheckpointConfig().memory_budget
            budget = asked.get("--activation_checkpoint.memory_budget", f"{default} (the default)")
            note = f"memory_budget {budget}; no simulator run"
        rows.append(_row("memory", f"trace, ac {ac}", r, predicted=True, note=note))
    f = data["finetune"]
    note = "" if "error" in f else (
        f"weights loaded as written: {'yes' if f['loaded_as_written'] else 'NO'}; folder by {f['writer']}; "
        f"first (tracing) step {f['first_step_s']:.1f} s; loss {f['loss']:.3f}"
    )  # fmt: skip
    rows.append(_row("fine-tune", f"{f.get('blocks', '?')}-block HF Llama, bf16", f, predicted=True, note=note))
    return results.markdown_table(HEADER, rows)


def failures(data: dict) -> list[str]:
    """What went wrong, one entry a part: a part that did not finish, a failed GPU test, weights not loaded."""
    out = [f"{r['mode']} (ac {r['ac']}): {r['error']}" for r in data["runs"] if "error" in r]
    p, f = data["pytest"], data["finetune"]
    if "error" in p or p["failed"] or p["errors"]:
        out.append(f"pytest -m gpu: {_pytest_note(p)}")
    if "error" in f or not f["loaded_as_written"]:
        out.append(f"fine-tune: {f.get('error', 'the weights in the trainer are not the folder´s')}")
    return out


# --------------------------------------------------------------------------------------------- entry point

SIZES = {"gpu": GPU, "small": SMALL}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="the tiny sizes, on any device (what CI runs)")
    parser.add_argument("--results-dir", type=Path, help="write gpu_check.json here (default: benchmarks/results)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def _heading(name: str, sizes: Sizes, wall_s: float) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else results.machine()
    return (
        f"gpu_check ({name} sizes) on {device}: torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"{sizes.config} {' '.join(sizes.overrides)}; {wall_s:.0f} s of a {sizes.budget_s:.0f} s budget"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check (or one worker); 0 when every part finished and passed, 1 otherwise."""
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = _parser().parse_args(argv)
    if opts.worker:
        print(ROW + json.dumps(worker(json.loads(opts.worker))), flush=True)
        return 0
    if not opts.small and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here, nothing run (--small runs the same parts on a tiny model)")
        return 0
    name = "small" if opts.small else "gpu"
    sizes = SIZES[name]
    from graph_trainer.job_config.cli import load_config

    config_ac = load_config(_trainer_args(sizes))[0].activation_checkpoint.mode
    budget = Budget(sizes.budget_s)
    with tempfile.TemporaryDirectory(prefix="gt_gpu_check_") as tmp:
        data = run_check(sizes, name, config_ac, Path(tmp), budget)
    wall_s = time.monotonic() - budget.start
    text = table(data, sizes, config_ac)
    print(_heading(name, sizes, wall_s) + "\n\n" + text)
    environment = {"device": results.machine(), "torch": torch.__version__, "cuda": torch.version.cuda}
    record = {**environment, "sizes": dataclasses.asdict(sizes), "config_ac": config_ac, "wall_s": wall_s, **data}
    results.save("gpu_check", {"gpu_check": text}, record, argv=[__file__, *argv], folder=opts.results_dir)
    wrong = failures(data)
    for line in wrong:
        print(f"gpu_check: {line}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
