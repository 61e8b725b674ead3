"""Integration runner: run the declared CLI tests, read each run back from TensorBoard, check expectations.

    python run_tests.py OUTPUT_DIR [--suite quick|full] [--test NAME ...] [--list]
                        [--collect-peak-memory] [--parallel N] [--overwrite]

Each test in `tests/integration/integration_tests.py` is one or more
`python -m graph_trainer ...` invocations (torchrun for multi-process tests) with
TensorBoard on and its own dump folder `OUTPUT_DIR/<name>/`. After a run, its
TensorBoard events are read back with tensorboard's EventAccumulator (loss curve,
peak active/reserved/estimated memory, throughput, trace time) together with
summary.json (exact losses and digests), and the test's declared expectations are
checked; cross-test ones (bitwise-equal loss curves, peak ratios) once every test
has finished. The runner prints a table, writes `OUTPUT_DIR/results.json` and
`OUTPUT_DIR/peak_memory.png` (with matplotlib, the `plots` extra), shows the stderr tail of failing runs, and ends with
the line `N passed, N failed[, N skipped]`. Exit status: 0 all passed, 1 a check
failed, 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent
if str(REPO_ROOT) not in sys.path:  # so `tests.integration` imports from any cwd
    sys.path.insert(0, str(REPO_ROOT))

from graph_trainer.distributed.launch import trainer_command  # noqa: E402
from graph_trainer.errors import did_you_mean  # noqa: E402
from graph_trainer.observability.units import MIB_PER_GIB  # noqa: E402
from tests.integration.checks import FAILED, PASSED, SKIPPED, RunOutcome, Verdict, check_test  # noqa: E402
from tests.integration.collect import collect_run  # noqa: E402
from tests.integration.spec import SUITES, IntegrationTest, with_dependencies  # noqa: E402

MARKER = ".run_tests_output"  # marks a folder this runner created, so --overwrite may empty it
RESULTS_FILE = "results.json"
CHART_FILE = "peak_memory.png"
LOGS_DIR = "logs"
STDERR_TAIL_LINES = 25
CHART_INSTALL_HINT = "pip install 'graph_trainer[plots]'"


class UsageError(Exception):
    """A mistake on the runner's own command line or output folder (exit 2)."""


# ---------------------------------------------------------------------------
# Selection and commands
# ---------------------------------------------------------------------------


def load_tests() -> list[IntegrationTest]:
    """The declared tests (validated on import)."""
    from tests.integration.integration_tests import TESTS

    return list(TESTS)


def select_tests(all_tests: list[IntegrationTest], suite: str, names: list[str] | None) -> list[IntegrationTest]:
    """Tests named by --test (plus what they compare against), else the suite's tests."""
    if names:
        by_name = {t.name: t for t in all_tests}
        for name in names:
            if name not in by_name:
                raise UsageError(f"unknown test '{name}'{did_you_mean(name, list(by_name))}; see --list")
        return with_dependencies([by_name[n] for n in names], all_tests)
    return with_dependencies([t for t in all_tests if suite in t.suites], all_tests)


def memory_needed(tests: list[IntegrationTest]) -> set[str]:
    """Names of the tests whose expectations (or whose dependents') need memory measurements."""
    names = {t.name for t in tests if t.expect.needs_memory()}
    names |= {t.expect.peak_ratio.reference for t in tests if t.expect.peak_ratio}
    return names


def build_command(test: IntegrationTest, args: tuple[str, ...], dump_folder: Path, track_memory: bool) -> list[str]:
    """The argv of one invocation: the trainer CLI (under torchrun when nproc > 1) plus runner flags."""
    launcher = trainer_command(test.nproc)
    return [
        *launcher,
        *args,
        "--job.dump_folder",
        str(dump_folder),
        "--metrics.enable_tensorboard",
        "true",
        "--metrics.track_memory",
        "true" if track_memory else "false",
    ]


def check_requirements(test: IntegrationTest) -> str | None:
    """Why `test` cannot run here (a missing requirement), or None."""
    if not test.requires:
        return None
    import torch
    import torch.distributed as dist

    for req in test.requires:
        if req == "cuda" and not torch.cuda.is_available():
            return "needs a CUDA device"
        if req == "distributed" and not (dist.is_available() and dist.is_gloo_available()):
            return "needs torch.distributed with the gloo backend"
    return None


def running_on_cpu() -> bool:
    """Whether the trainer's device 'auto' resolves to CPU here (estimate == measured holds on CPU)."""
    import torch

    return not torch.cuda.is_available()


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


@dataclass
class TestRun:
    """Everything known about one test after it ran and was checked."""

    test: IntegrationTest
    outcome: RunOutcome
    commands: list[list[str]]
    verdict: Verdict | None = None


def prepare_output_dir(out: Path, overwrite: bool) -> None:
    """Create OUTPUT_DIR; a non-empty one is refused unless --overwrite and it is an earlier runner output."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUTPUT_DIR '{out}' is a file; choose a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UsageError(
                f"OUTPUT_DIR '{out}' is not empty; pass --overwrite to replace an earlier "
                "run_tests.py output, or choose another folder"
            )
        if not (out / MARKER).exists():
            raise UsageError(
                f"OUTPUT_DIR '{out}' is not empty and was not written by run_tests.py "
                f"(no {MARKER}); refusing to delete it even with --overwrite"
            )
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    (out / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by run_tests.py; --overwrite may delete this folder's contents\n")


def child_env(parallel: int) -> dict[str, str]:
    """The subprocess environment: unbuffered output, and CPU threads shared among parallel runs."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if parallel > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // parallel))
    return env


def _run_one(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str, str, bool]:
    """Run `cmd` in its own process group (torchrun's workers die with it on timeout)."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return proc.returncode, out, err, True


def run_test(test: IntegrationTest, out: Path, track_memory: bool, env: dict[str, str]) -> TestRun:
    """Run a test's invocations in order (stopping at the first that fails) and read its dump folder."""
    dump = out / test.name
    commands = [build_command(test, args, dump, track_memory) for args in test.runs]
    skip = check_requirements(test)
    if skip is not None:
        return TestRun(test, RunOutcome(skip_reason=skip), commands)
    outcome = RunOutcome()
    start = time.perf_counter()
    with (
        open(out / LOGS_DIR / f"{test.name}.stdout.txt", "w") as log_out,
        open(out / LOGS_DIR / f"{test.name}.stderr.txt", "w") as log_err,
    ):
        for i, cmd in enumerate(commands):
            budget = test.timeout_s - (time.perf_counter() - start)
            code, stdout, stderr, timed_out = _run_one(cmd, env, max(budget, 1.0))
            header = f"$ {shlex.join(cmd)}\n"
            log_out.write(header + stdout)
            log_err.write(header + stderr)
            outcome.exit_codes.append(code)
            outcome.stdout, outcome.stderr, outcome.timed_out = stdout, stderr, timed_out
            last = i == len(commands) - 1
            if timed_out or (not last and code != 0):
                break
    outcome.wall_time_s = time.perf_counter() - start
    outcome.metrics = collect_run(dump)
    return TestRun(test, outcome, commands)


def run_all(tests: list[IntegrationTest], out: Path, parallel: int, collect_memory: bool) -> list[TestRun]:
    """Run every test, `parallel` at a time; progress goes to stdout as each finishes."""
    env = child_env(parallel)
    needs_memory = memory_needed(tests)
    results: dict[str, TestRun] = {}
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {pool.submit(run_test, t, out, collect_memory or t.name in needs_memory, env): t for t in tests}
        for done, future in enumerate(as_completed(futures), 1):
            run = future.result()
            results[run.test.name] = run
            o = run.outcome
            how = (
                f"skipped: {o.skip_reason}"
                if o.skip_reason
                else f"exit {o.exit_codes[-1] if o.exit_codes else '-'}{' (timed out)' if o.timed_out else ''}"
            )
            print(f"[{done}/{len(tests)}] {run.test.name}: {how} in {o.wall_time_s:.1f} s", flush=True)
    return [results[t.name] for t in tests]


def check_all(runs: list[TestRun]) -> None:
    """Check every test's expectations once all have run (cross-test references need both)."""
    outcomes = {r.test.name: r.outcome for r in runs}
    on_cpu = running_on_cpu() if any(r.test.expect.estimate_matches_measured for r in runs) else True
    for r in runs:
        r.verdict = check_test(r.test, r.outcome, outcomes, on_cpu=on_cpu)


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------

COLUMNS = ("test", "status", "steps", "final loss", "peak active MiB", "peak est MiB", "tokens/s", "trace s", "wall s")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_rows(runs: list[TestRun]) -> list[tuple[str, ...]]:
    """One row of table cells per test, in COLUMNS order."""
    rows = []
    for r in runs:
        m = r.outcome.metrics
        has = m is not None and m.has_tensorboard
        rows.append(
            (
                r.test.name,
                r.verdict.status if r.verdict else "?",
                str(len(m.tb_steps)) if has else "-",
                _fmt(m.final_loss if has else None, ".4f"),
                _fmt(m.peak_active_gib * MIB_PER_GIB if has and m.peak_active_gib is not None else None, ".2f"),
                _fmt(m.estimated_peak_gib * MIB_PER_GIB if has and m.estimated_peak_gib is not None else None, ".2f"),
                _fmt(m.tokens_per_s if has else None, ",.0f"),
                _fmt(m.trace_time_s if has else None, ".2f"),
                _fmt(r.outcome.wall_time_s if not r.outcome.skip_reason else None, ".1f"),
            )
        )
    return rows


def format_table(rows: list[tuple[str, ...]]) -> str:
    """A plain-text table with a header; text columns left-aligned, numbers right-aligned."""
    widths = [max(len(COLUMNS[i]), *(len(row[i]) for row in rows)) for i in range(len(COLUMNS))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(COLUMNS), line(tuple("-" * w for w in widths)), *(line(r) for r in rows)])


def counts_line(runs: list[TestRun]) -> str:
    """The CI-parsable last line: `N passed, N failed` and `, N skipped` when any were."""
    n = {s: sum(1 for r in runs if r.verdict and r.verdict.status == s) for s in (PASSED, FAILED, SKIPPED)}
    line = f"{n[PASSED]} passed, {n[FAILED]} failed"
    return line + (f", {n[SKIPPED]} skipped" if n[SKIPPED] else "")


def write_results(out: Path, runs: list[TestRun], meta: dict) -> Path:
    """OUTPUT_DIR/results.json: per test its status, checks, commands and collected metrics."""
    tests = []
    for r in runs:
        v, o = r.verdict, r.outcome
        tests.append(
            {
                "name": r.test.name,
                "description": r.test.description,
                "suites": list(r.test.suites),
                "status": v.status,
                "failures": v.failures,
                "notes": v.notes,
                "skip_reason": v.skip_reason,
                "commands": [shlex.join(c) for c in r.commands],
                "exit_codes": o.exit_codes,
                "timed_out": o.timed_out,
                "wall_time_s": o.wall_time_s,
                "dump_folder": str(out / r.test.name),
                "metrics": o.metrics.as_json() if o.metrics is not None else None,
            }
        )
    statuses = [r.verdict.status for r in runs]
    data = {
        **meta,
        "passed": statuses.count(PASSED),
        "failed": statuses.count(FAILED),
        "skipped": statuses.count(SKIPPED),
        "tests": tests,
    }
    path = out / RESULTS_FILE
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


def write_chart(out: Path, runs: list[TestRun]) -> Path | None:
    """OUTPUT_DIR/peak_memory.png: measured (TensorBoard) and estimated peak per test that has one.

    Returns None when no test logged memory. Raises ImportError when matplotlib (the
    `plots` extra) is missing; the caller reports that and writes everything else.
    """
    with_mem = [
        r
        for r in runs
        if r.outcome.metrics is not None
        and (r.outcome.metrics.peak_active_gib is not None or r.outcome.metrics.estimated_peak_gib is not None)
    ]
    if not with_mem:
        return None
    # The object API without pyplot: no display and no global backend state; savefig draws with Agg.
    from matplotlib.figure import Figure

    active = [r.outcome.metrics.peak_active_gib for r in with_mem]
    estimated = [r.outcome.metrics.estimated_peak_gib for r in with_mem]
    top = max(v for v in active + estimated if v is not None)
    scale, unit = (1.0, "GiB") if top >= 1.0 else (MIB_PER_GIB, "MiB")
    series = {"peak active": active}
    if any(v is not None for v in estimated):
        series["estimated"] = estimated
    names = [r.test.name for r in with_mem]
    height = 0.8 / len(series)
    fig = Figure(figsize=(8, 1.2 + 0.35 * len(names) * len(series)), layout="constrained")
    ax = fig.add_subplot()
    for k, (label, values) in enumerate(series.items()):
        ys = [i + k * height for i in range(len(names))]
        widths = [0.0 if v is None else v * scale for v in values]
        bars = ax.barh(ys, widths, height=height, label=label)
        ax.bar_label(bars, labels=["" if v is None else f"{v * scale:.2f}" for v in values], padding=2, fontsize=8)
    ax.set_yticks([i + height * (len(series) - 1) / 2 for i in range(len(names))], names)
    ax.invert_yaxis()  # first test on top, as in the table
    ax.set_xlabel(unit)
    ax.set_title(f"Peak memory per test ({unit}, from TensorBoard)")
    ax.legend(loc="lower right")
    path = out / CHART_FILE
    fig.savefig(path, format="png")
    return path


def chart_line(out: Path, runs: list[TestRun]) -> tuple[str, str | None]:
    """Write the chart if possible: (the report's `chart:` line, the file name or None)."""
    try:
        chart = write_chart(out, runs)
    except ImportError:
        return f"chart: not written, matplotlib is missing ({CHART_INSTALL_HINT} draws it)", None
    if chart is None:
        return "chart: none (no test logged peak memory)", None
    return f"chart: {chart}", chart.name


def stderr_tail(text: str, lines: int = STDERR_TAIL_LINES) -> str:
    """The last `lines` lines of a run's stderr, indented."""
    tail = text.rstrip().splitlines()[-lines:]
    return "\n".join("    " + line for line in tail) if tail else "    (empty)"


def report(out: Path, runs: list[TestRun], meta: dict) -> int:
    """Print the table, failures and notes; write results.json and the chart; return the exit code."""
    print()
    print(format_table(table_rows(runs)))
    for r in runs:
        v = r.verdict
        if v.status == SKIPPED:
            print(f"SKIPPED {r.test.name}: {v.skip_reason}")
        for note in v.notes:
            print(f"note {r.test.name}: {note}")
    for r in runs:
        if r.verdict.status != FAILED:
            continue
        print(f"\nFAILED {r.test.name}: " + "; ".join(r.verdict.failures))
        print(f"  $ {shlex.join(r.commands[len(r.outcome.exit_codes) - 1] if r.outcome.exit_codes else r.commands[0])}")
        print(f"  stderr (last {STDERR_TAIL_LINES} lines, full log in {out / LOGS_DIR}):")
        print(stderr_tail(r.outcome.stderr))
    chart_text, chart_name = chart_line(out, runs)
    results = write_results(out, runs, {**meta, "chart": chart_name})
    print(f"\nresults: {results}")
    print(chart_text)
    print(f"wall time: {meta['wall_time_s']:.1f} s")
    print(counts_line(runs))
    return 1 if any(r.verdict.status == FAILED for r in runs) else 0


def print_list(tests: list[IntegrationTest], collect_memory: bool) -> None:
    """--list: each test's suites, requirements, description and command lines."""
    needs_memory = memory_needed(tests)
    for t in tests:
        extra = f"  requires: {', '.join(t.requires)}" if t.requires else ""
        print(f"{t.name}  [{', '.join(t.suites)}]{extra}")
        if t.description:
            print(f"    {t.description}")
        for args in t.runs:
            cmd = build_command(t, args, Path("OUTPUT_DIR") / t.name, collect_memory or t.name in needs_memory)
            print(f"    $ {shlex.join(['python' if c == sys.executable else c for c in cmd])}")
    print(f"{len(tests)} tests")


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The runner's command line."""
    p = argparse.ArgumentParser(prog="run_tests.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "output_dir",
        nargs="?",
        type=Path,
        help="folder for each test's dump folder, logs, results.json and the chart (required unless --list)",
    )
    p.add_argument("--suite", choices=SUITES, default="quick", help="which declared suite to run (default quick)")
    p.add_argument(
        "--test",
        action="append",
        metavar="NAME",
        help="run only this test (repeatable); the tests it compares against run too",
    )
    p.add_argument("--list", action="store_true", help="print the selected tests and their commands, run nothing")
    p.add_argument(
        "--collect-peak-memory",
        action="store_true",
        help="measure memory in every test (not only those whose checks need it) and chart it",
    )
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="run N tests at once (default 1)")
    p.add_argument("--overwrite", action="store_true", help="empty a non-empty OUTPUT_DIR from an earlier run")
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error("--parallel must be >= 1")
    if args.output_dir is None and not args.list:
        p.error("OUTPUT_DIR is required (or pass --list)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the runner; returns the exit code (0 passed, 1 a check failed, 2 a usage error)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        tests = select_tests(load_tests(), args.suite, args.test)
        if args.list:
            print_list(tests, args.collect_peak_memory)
            return 0
        out = args.output_dir.resolve()
        prepare_output_dir(out, args.overwrite)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    label = f"tests {', '.join(args.test)}" if args.test else f"suite {args.suite}"
    print(f"running {len(tests)} tests ({label}) into {out}, {args.parallel} at a time", flush=True)
    runs = run_all(tests, out, args.parallel, args.collect_peak_memory)
    check_all(runs)
    meta = {
        "suite": None if args.test else args.suite,
        "selected": args.test,
        "parallel": args.parallel,
        "collect_peak_memory": args.collect_peak_memory,
        "python": sys.executable,
        "wall_time_s": time.perf_counter() - start,
    }
    return report(out, runs, meta)


if __name__ == "__main__":
    sys.exit(main())
