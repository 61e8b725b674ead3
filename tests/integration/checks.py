"""Check one test's declared expectations against what its run left behind.

Pure functions over `RunOutcome`s (exit codes, output, metrics read back): no
subprocess, no torch, so every rule here is unit-tested on made-up outcomes.
Cross-test expectations look their reference up in the outcomes of the whole
session, so they are checked only after every test has finished.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from tests.integration.collect import TAG_ACTIVE, TAG_TRACE_COUNT, RunMetrics
from tests.integration.spec import IntegrationTest

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass
class RunOutcome:
    """How a test's invocations ended and what they wrote.

    `exit_codes` has one entry per invocation that ran (a failing invocation stops
    the test); `stdout`/`stderr` are the last invocation's. `skip_reason` is set
    when the runner did not run the test (a missing requirement).
    """

    exit_codes: list[int] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    metrics: RunMetrics | None = None
    timed_out: bool = False
    wall_time_s: float = 0.0
    skip_reason: str | None = None


@dataclass
class Verdict:
    """The result of checking one test: a status, the failed checks, and informational notes."""

    status: str
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skip_reason: str | None = None


def bits(x: float) -> bytes:
    """The IEEE-754 double bit pattern: equality of these is bitwise equality (NaN == NaN, -0.0 != 0.0)."""
    return struct.pack("<d", x)


def as_float32(x: float) -> float:
    """`x` rounded to float32, as TensorBoard stores scalars."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:  # finite doubles beyond float32 range become inf in TensorBoard
        return math.copysign(math.inf, x)


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["(no stderr)"])[-1]


def check_test(
    test: IntegrationTest, outcome: RunOutcome, outcomes: Mapping[str, RunOutcome], *, on_cpu: bool = True
) -> Verdict:
    """Check `test`'s expectations; `outcomes` maps every test name run this session to its outcome."""
    if outcome.skip_reason is not None:
        return Verdict(SKIPPED, skip_reason=outcome.skip_reason)
    exp = test.expect
    codes = outcome.exit_codes
    if not codes:
        return Verdict(FAILED, ["no invocation ran"])
    n = len(test.runs)
    if outcome.timed_out:
        return Verdict(FAILED, [f"timed out after {test.timeout_s:.0f} s (invocation {len(codes)}/{n})"])
    for i, code in enumerate(codes[: n - 1]):
        if code != 0:
            return Verdict(FAILED, [f"invocation {i + 1}/{n} exited {code}, expected 0"])
    if len(codes) != n:
        return Verdict(FAILED, [f"{len(codes)} of {n} invocations ran"])
    last = codes[-1]
    if exp.skip_if_rejected and last == 2 and exp.skip_if_rejected in outcome.stderr:
        return Verdict(SKIPPED, skip_reason=f"the trainer rejects it: {_error_line(outcome.stderr)}")

    failures: list[str] = []
    notes: list[str] = []
    if last != exp.exit_code:
        failures.append(f"exit code {last}, expected {exp.exit_code}")
    for fragment in exp.stderr_contains:
        if fragment not in outcome.stderr:
            failures.append(f"stderr lacks {fragment!r}")
    for fragment in exp.stdout_contains:
        if fragment not in outcome.stdout:
            failures.append(f"stdout lacks {fragment!r}")
    if exp.exit_code != 0 and "Traceback" in outcome.stderr:
        failures.append("a user error printed a traceback; it must be one 'error: ...' line")
    if exp.exit_code == 0 and last == 0 and exp.trains:
        failures += _check_own_metrics(test, outcome.metrics, on_cpu, notes)
        skipped_ref = _skipped_reference(test, outcomes)
        if skipped_ref is not None and not failures:
            return Verdict(SKIPPED, notes=notes, skip_reason=skipped_ref)
        if not failures:
            failures += _check_references(test, outcome.metrics, outcomes)
    return Verdict(FAILED if failures else PASSED, failures, notes)


def _check_own_metrics(test: IntegrationTest, m: RunMetrics | None, on_cpu: bool, notes: list[str]) -> list[str]:
    """Checks that need only this run: logs present and consistent, loss, trace count, memory."""
    exp = test.expect
    if m is None or not m.has_tensorboard:
        return ["no TensorBoard events under the dump folder's tb/"]
    if not m.has_summary:
        return ["no summary.json in the dump folder"]
    failures = []
    if m.tb_steps != m.steps:
        failures.append(f"TensorBoard logged steps {m.tb_steps} but summary.json {m.steps}")
    else:
        for step, tb, exact in zip(m.steps, m.tb_losses, m.losses, strict=True):
            if bits(tb) != bits(as_float32(exact)):
                failures.append(f"step {step}: TensorBoard loss {tb!r} is not summary.json's {exact!r} as float32")
                break
    if exp.steps is not None and m.steps != list(range(1, exp.steps + 1)):
        failures.append(f"logged steps {m.steps}, expected 1..{exp.steps}")
    if exp.finite_loss:
        bad = [(s, x) for s, x in zip(m.steps, m.losses, strict=True) if not math.isfinite(x)]
        if bad:
            failures.append(f"loss is {bad[0][1]} at step {bad[0][0]}")
    if exp.falling_loss:
        if len(m.losses) < 2:
            failures.append("falling loss needs at least 2 steps")
        elif not m.losses[-1] < m.losses[0]:
            failures.append(
                f"loss did not fall: {m.losses[0]:.6f} at step {m.steps[0]} -> {m.losses[-1]:.6f} at step {m.steps[-1]}"
            )
    if exp.trace_count is not None and m.trace_count != exp.trace_count:
        got = "none logged" if m.trace_count is None else m.trace_count
        failures.append(f"{TAG_TRACE_COUNT} = {got}, expected {exp.trace_count}")
    if exp.max_peak_gib is not None:
        if m.peak_active_gib is None:
            failures.append(f"no {TAG_ACTIVE} in TensorBoard")
        elif m.peak_active_gib > exp.max_peak_gib:
            failures.append(f"peak active {m.peak_active_gib:.4f} GiB > limit {exp.max_peak_gib} GiB")
    if exp.estimate_matches_measured:
        if not on_cpu:
            notes.append("estimate == measured is checked on CPU only")
        elif m.estimated_peak_bytes is None:  # memory is tracked for every test that asks: a missing one is a bug
            failures.append("no memory estimate logged: estimate == measured cannot be checked")
        elif m.peak_active_bytes is None:
            failures.append("a memory estimate is logged but no measured peak")
        elif m.estimated_peak_bytes != m.peak_active_bytes:
            failures.append(
                f"estimated peak {m.estimated_peak_bytes:,} B != measured {m.peak_active_bytes:,} B "
                f"({m.estimated_peak_bytes - m.peak_active_bytes:+,} B)"
            )
    return failures


def _skipped_reference(test: IntegrationTest, outcomes: Mapping[str, RunOutcome]) -> str | None:
    """Why a cross-test comparison cannot be made because its reference was skipped, else None."""
    for ref_name in test.expect.references():
        ref = outcomes.get(ref_name)
        if ref is not None and ref.skip_reason is not None:
            return f"reference test {ref_name!r} was skipped ({ref.skip_reason})"
    return None


def _check_references(test: IntegrationTest, m: RunMetrics, outcomes: Mapping[str, RunOutcome]) -> list[str]:
    """Cross-test checks against references that ran (skipped ones are handled by the caller)."""
    exp = test.expect
    for ref_name in exp.references():
        ref = outcomes.get(ref_name)
        if ref is None:
            return [f"reference test {ref_name!r} did not run in this session"]
        if not ref.exit_codes or ref.exit_codes[-1] != 0 or ref.metrics is None or not ref.metrics.has_summary:
            return [f"reference test {ref_name!r} has no results to compare with"]
    failures = []
    if exp.bitwise_equal_to:
        failures += compare_bitwise(m, outcomes[exp.bitwise_equal_to].metrics, exp.bitwise_equal_to)
    if exp.peak_ratio:
        failures += compare_peak(
            m, outcomes[exp.peak_ratio.reference].metrics, exp.peak_ratio.reference, exp.peak_ratio.ratio
        )
    if exp.loss_close_to:
        name, rtol = exp.loss_close_to
        failures += compare_close(m, outcomes[name].metrics, name, rtol)
    return failures


def compare_bitwise(m: RunMetrics, ref: RunMetrics, ref_name: str) -> list[str]:
    """Every step's exact loss and the final parameter/gradient digests equal the reference's."""
    if m.steps != ref.steps:
        return [f"logged steps {m.steps} differ from {ref_name}'s {ref.steps}"]
    for step, a, b in zip(m.steps, m.losses, ref.losses, strict=True):
        if bits(a) != bits(b):
            return [f"loss at step {step} is {a!r}, {ref_name} has {b!r} (not bitwise equal)"]
    failures = []
    for what in ("params_sha256", "grads_sha256"):
        a, b = getattr(m, what), getattr(ref, what)
        if a is None or b is None:
            failures.append(f"{what} missing from summary.json (here {a}, {ref_name} {b})")
        elif a != b:
            failures.append(f"final {what} differs from {ref_name}'s ({a[:12]} vs {b[:12]})")
    return failures


def compare_peak(m: RunMetrics, ref: RunMetrics, ref_name: str, ratio: float) -> list[str]:
    """Peak active memory (TensorBoard) <= ratio x the reference's."""
    if m.peak_active_gib is None or ref.peak_active_gib is None:
        missing = "this run" if m.peak_active_gib is None else ref_name
        return [f"no {TAG_ACTIVE} in TensorBoard for {missing}"]
    limit = ref.peak_active_gib * ratio
    if m.peak_active_gib > limit:
        return [
            f"peak active {m.peak_active_gib * 1024:.2f} MiB > {ratio:.2f} x {ref_name}'s "
            f"{ref.peak_active_gib * 1024:.2f} MiB (ratio {m.peak_active_gib / ref.peak_active_gib:.3f})"
        ]
    return []


def compare_close(m: RunMetrics, ref: RunMetrics, ref_name: str, rtol: float) -> list[str]:
    """Same logged steps and every loss within `rtol` of the reference's."""
    if m.steps != ref.steps:
        return [f"logged steps {m.steps} differ from {ref_name}'s {ref.steps}"]
    for step, a, b in zip(m.steps, m.losses, ref.losses, strict=True):
        if not abs(a - b) <= rtol * abs(b):
            return [f"loss at step {step} is {a!r}, {ref_name} has {b!r} (beyond rtol {rtol})"]
    return []
