"""One rule for the whole suite: under CI=true, a skip is a failure unless it is legitimate.

A test that skips because a package or module is missing (`pytest.importorskip`, `tests.extras.import_extra`,
a `skipif` on a missing backend) passes by not running: on a developer's machine that is a convenience, in CI
it hides that the promise was never checked. `.ci/run` installs the `test` extra and pins torch, so there every
optional package and every torch module the tests use is present, and a skip for want of one is a failure.

Legitimate skips, the only ones CI=true lets through (each is impossible on CI's CPU machine, not merely
missing a package):
- a GPU test, when this machine has no CUDA device: its reason names CUDA or a GPU, and
  `torch.cuda.is_available()` is False. On a machine with CUDA the same skip fails.
- a parametrized case that the test's own layout does not train (`tests/distributed/test_fsdp.py`: a run
  trained at 2 ranks only, asked of the 4-rank layout).
- an API that the installed transformers does not have (`tests/tracer/test_hf_models.py`: a version without
  one of its checkpointing methods): the package is there, the method is not, and the test has nothing to
  refuse.
Everything else is not: a missing package, a torch module that moved, no gloo backend, no torch.distributed.
A new legitimate skip is added to LEGITIMATE below, with its reason.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

# A skip whose reason names CUDA or a GPU: legitimate only where there is no CUDA device.
GPU_SKIP = r"\b(CUDA|GPU)\b"
# (pattern searched in the skip's reason, why that skip is legitimate on CI's machine)
LEGITIMATE: tuple[tuple[str, str], ...] = (
    (r" is trained at \d+ ranks only$", "a case the test's layout does not train"),
    (r"^transformers \S+ has no \w+\(\)$", "an API the installed transformers does not have"),
)


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason a skipped report gives, without pytest's 'Skipped: ' prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def is_legitimate(reason: str) -> bool:
    """Whether a skip for `reason` is allowed under CI=true (see the module's docstring)."""
    if re.search(GPU_SKIP, reason):
        return not torch.cuda.is_available()
    return any(re.search(pattern, reason) for pattern, _why in LEGITIMATE)


def fail_illegitimate_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Under CI=true, turn a skipped report whose reason is not legitimate into a failure naming it."""
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if is_legitimate(reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true: {reason}. CI installs the test extra and pins torch, so this test must run there; "
        "if the skip is legitimate, add its reason to LEGITIMATE in tests/conftest.py"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A test's skip (from a skipif marker, importorskip or pytest.skip in setup or body)."""
    outcome = yield
    fail_illegitimate_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A whole module's skip (importorskip at module level, pytest.skip(allow_module_level=True))."""
    outcome = yield
    fail_illegitimate_skip(outcome.get_result())


# `-n auto` starts one pytest-xdist worker per core, at most this many: a multi-rank test starts up to 4 processes
# of its own, and more workers than that only make them wait for each other.
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it installed, never called
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """The worker count of `-n auto` (pytest-xdist's hook): the cores, at most MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch (and the processes it starts) gets its share of the cores.

    torch starts one compute thread per core in every process. With one worker per core, two workers each running
    two threads on two cores (beside a multi-rank test's own processes) spend their time preempting each other:
    on a 2-core machine the integration suite took 2047 s that way and 1836 s with one thread a worker. Results are
    unchanged: every bitwise comparison is between runs in one process or between processes started with the same
    thread count.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # the processes a test starts inherit it


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The multi-rank test files first (a stable sort: the rest keep their order).

    They are the longest units pytest-xdist hands out (`--dist loadfile`: a file is one unit; 1 to 4 minutes each on
    2 cores), and a long unit handed out last keeps one worker busy while the others wait. `.ci/run` passes
    `--no-loadscope-reorder` so that xdist keeps this order (its own puts the files with most tests first)."""
    for item in items:
        check_slow_marker(item)
    items.sort(key=lambda item: item.get_closest_marker("multiprocess") is None)


def check_slow_marker(item: pytest.Item) -> None:
    """A `slow` test (left out of CI, docs/tests.md) is also `integration`, so that the default run leaves it out
    too, and names the test CI runs that holds its claim at a smaller size: `@pytest.mark.slow(held_by="path::name")`,
    a test that exists. Raises pytest.UsageError otherwise, so that no test leaves CI without saying what stays."""
    marker = item.get_closest_marker("slow")
    if marker is None:
        return
    held_by = marker.kwargs.get("held_by", "")
    path, _, name = held_by.partition("::")
    source = Path(item.config.rootpath, path)
    if item.get_closest_marker("integration") is None:
        raise pytest.UsageError(f"{item.nodeid} is marked slow but not integration: mark it integration too")
    # Itself only as a parametrized case whose other cases CI runs: a test naming itself would hold nothing.
    names_itself = name == getattr(item, "originalname", None) and Path(item.path) == source.resolve()
    if names_itself and not hasattr(item, "callspec"):
        raise pytest.UsageError(f"{item.nodeid} is marked slow with held_by naming itself: name another test")
    if not name or not source.is_file() or f"def {name}(" not in source.read_text():
        raise pytest.UsageError(
            f"{item.nodeid} is marked slow with held_by={held_by!r}: name the test CI runs that holds its claim "
            "at a smaller size, as 'tests/<file>.py::<test name>'"
        )


# The budget solver's time limit in tests whose claim holds for whichever choice it returns (`short_solves`).
SHORT_SOLVE_S = 10.0


@pytest.fixture
def short_solves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget's solves stopped at SHORT_SOLVE_S instead of `passes/budget.SOLVE_TIME_LIMIT_S` (60 s).

    For tests whose claim holds for any choice the solver returns: a depth-free plan equals the whole trace of its
    own choice; a refusal names its sizes. At the debug widths the whole deep solve never proves its optimum in 60 s
    (gaps of 17-60% at 8 blocks, measured 2026-12-01 on 2 cores), so each such test waited a minute on a solve
    whose answer it does not judge. The choice's quality is judged where the limit is left alone: against
    enumeration (tests/passes/test_remat_model.py), at the debug and the 8B widths."""
    from graph_trainer.passes import budget

    monkeypatch.setattr(budget, "SOLVE_TIME_LIMIT_S", SHORT_SOLVE_S)
