"""The vocabulary of the integration suite: a test is a declared command line plus expectations.

`run_tests.py` runs each `IntegrationTest` in a subprocess with its own dump folder,
reads the run back (TensorBoard events and summary.json) and checks its `Expect`.
These classes hold data only; they import nothing heavy, so `--list` is instant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SUITES = ("quick", "full")
REQUIREMENTS = ("distributed", "cuda")
# Keys the runner sets on every invocation; a declaration must not set them itself.
RUNNER_KEYS = ("--job.dump_folder", "--job.overwrite", "--metrics.enable_tensorboard")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_]*$")
RESERVED_NAMES = ("logs",)


@dataclass(frozen=True)
class PeakRatio:
    """This test's peak active memory must be <= `ratio` x the peak of test `reference`."""

    reference: str
    ratio: float = 1.0


@dataclass(frozen=True)
class Expect:
    """What a passing run looks like. Cross-test fields name another declared test.

    exit_code / stderr_contains apply to the last invocation (earlier ones must exit 0).
    Loss, memory and trace checks apply only when the expected exit code is 0 and
    `trains` is true (a dry run or a rejected config writes no training metrics).
    """

    exit_code: int = 0
    stderr_contains: tuple[str, ...] = ()
    stdout_contains: tuple[str, ...] = ()
    trains: bool = True
    steps: int | None = None  # exact number of logged steps
    finite_loss: bool = True
    falling_loss: bool = True  # last loss < first loss
    trace_count: int | None = None  # e.g. 1: the step was traced once and reused
    max_peak_gib: float | None = None  # absolute limit on peak active memory
    peak_ratio: PeakRatio | None = None
    bitwise_equal_to: str | None = None  # every loss and the final digests equal to this test's
    loss_close_to: tuple[str, float] | None = None  # (test, rtol): same steps, losses within rtol
    estimate_matches_measured: bool = False  # on CPU: the logged estimate equals the measured peak (none logged fails)
    # When the (last) run exits 2 with this fragment in stderr, the feature is not
    # there yet: the test is skipped with the trainer's message as the reason.
    skip_if_rejected: str | None = None

    def references(self) -> list[str]:
        """Names of the other tests these expectations compare against."""
        refs = [
            self.bitwise_equal_to,
            self.peak_ratio.reference if self.peak_ratio else None,
            self.loss_close_to[0] if self.loss_close_to else None,
        ]
        return [r for r in refs if r is not None]

    def needs_memory(self) -> bool:
        """Whether checking these expectations needs the run's memory measurements."""
        return bool(self.max_peak_gib is not None or self.peak_ratio or self.estimate_matches_measured)


@dataclass(frozen=True)
class IntegrationTest:
    """One declared test: `python -m graph_trainer` invocations sharing one dump folder.

    `runs` holds one argument list per invocation, run in order (a resumed run is a
    second invocation into the same folder). With `nproc` > 1 each invocation is
    launched with torchrun. The runner appends `--job.dump_folder` and TensorBoard flags.
    """

    name: str
    runs: tuple[tuple[str, ...], ...]
    suites: tuple[str, ...]
    expect: Expect = field(default_factory=Expect)
    description: str = ""
    nproc: int = 1
    requires: tuple[str, ...] = ()
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.name in RESERVED_NAMES:
            raise ValueError(f"test name {self.name!r} must be lower_snake_case and not {RESERVED_NAMES}")
        if not self.runs:
            raise ValueError(f"test {self.name!r} declares no invocation")
        for args in self.runs:
            if isinstance(args, str):
                raise ValueError(f"test {self.name!r}: each run is a tuple of arguments, not a string")
            for arg in args:
                if arg.split("=", 1)[0] in RUNNER_KEYS:
                    raise ValueError(f"test {self.name!r} sets {arg}; the runner sets it")
        unknown = set(self.suites) - set(SUITES)
        if not self.suites or unknown:
            raise ValueError(f"test {self.name!r}: suites must be a non-empty subset of {SUITES}")
        if set(self.requires) - set(REQUIREMENTS):
            raise ValueError(f"test {self.name!r}: requires must be among {REQUIREMENTS}")
        if self.nproc < 1:
            raise ValueError(f"test {self.name!r}: nproc must be >= 1")


def validate_tests(tests: list[IntegrationTest]) -> None:
    """Names are unique and every cross-test reference names a declared test, not itself."""
    names = [t.name for t in tests]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate test names: {dupes}")
    for t in tests:
        for ref in t.expect.references():
            if ref not in names or ref == t.name:
                raise ValueError(f"test {t.name!r} refers to {ref!r}, which is not another declared test")


def with_dependencies(selected: list[IntegrationTest], all_tests: list[IntegrationTest]) -> list[IntegrationTest]:
    """`selected` plus every test they compare against (transitively), in declaration order."""
    by_name = {t.name: t for t in all_tests}
    wanted = {t.name for t in selected}
    stack = list(wanted)
    while stack:
        for ref in by_name[stack.pop()].expect.references():
            if ref not in wanted:
                wanted.add(ref)
                stack.append(ref)
    return [t for t in all_tests if t.name in wanted]
