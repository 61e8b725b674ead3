"""Tests of the integration runner itself: expectation checks, reading runs back, the chart, the CLI.

Everything but the last test works on made-up outcomes or on a dump folder written
by the trainer's own `MetricsLogger`, so no training runs. The last one runs
`run_tests.py` end to end on one tiny test and is marked `integration`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import run_tests
from tests.extras import import_extra
from tests.integration.checks import FAILED, PASSED, SKIPPED, RunOutcome, as_float32, check_test
from tests.integration.collect import RunMetrics, collect_run
from tests.integration.integration_tests import TESTS
from tests.integration.spec import Expect, IntegrationTest, PeakRatio, validate_tests, with_dependencies

REPO = Path(run_tests.__file__).resolve().parent
SHA_A, SHA_B = "a" * 64, "b" * 64


# ---------------------------------------------------------------------------
# Helpers: made-up runs
# ---------------------------------------------------------------------------


def metrics(
    losses: list[float],
    *,
    peak_gib: float | None = 0.05,
    est_bytes: int | None = None,
    active_bytes: int | None = None,
    trace_count: int | None = 1,
    params: str = SHA_A,
    grads: str = SHA_A,
) -> RunMetrics:
    """A consistent RunMetrics: TensorBoard holds the float32 of the exact summary.json losses."""
    steps = list(range(1, len(losses) + 1))
    return RunMetrics(
        tb_steps=steps,
        tb_losses=[as_float32(x) for x in losses],
        peak_active_gib=peak_gib,
        trace_count=trace_count,
        steps=steps,
        losses=list(losses),
        peak_active_bytes=active_bytes,
        estimated_peak_bytes=est_bytes,
        params_sha256=params,
        grads_sha256=grads,
        status="ok",
        has_tensorboard=True,
        has_summary=True,
    )


def ok(m: RunMetrics, n_runs: int = 1) -> RunOutcome:
    return RunOutcome(exit_codes=[0] * n_runs, metrics=m, wall_time_s=1.0)


def decl(name: str, runs: int = 1, **expect) -> IntegrationTest:
    return IntegrationTest(
        name=name, runs=(("--config", "llama3_debug.toml"),) * runs, suites=("quick",), expect=Expect(**expect)
    )


LOSSES = [5.9, 5.7, 5.5]


def check(t: IntegrationTest, outcome: RunOutcome, others: dict[str, RunOutcome] | None = None, **kw):
    return check_test(t, outcome, {t.name: outcome, **(others or {})}, **kw)


# ---------------------------------------------------------------------------
# Own-run checks
# ---------------------------------------------------------------------------


def test_passing_run_passes():
    v = check(decl("a", steps=3, trace_count=1), ok(metrics(LOSSES)))
    assert v.status == PASSED, v.failures


def test_unexpected_exit_code_fails():
    v = check(decl("a"), RunOutcome(exit_codes=[1], stderr="Traceback ...\nRuntimeError: boom"))
    assert v.status == FAILED and v.failures == ["exit code 1, expected 0"]


def test_expected_user_error_passes_with_message_and_fails_without():
    t = decl("bad", exit_code=2, stderr_contains=("error: unknown option",), trains=False)
    assert check(t, RunOutcome(exit_codes=[2], stderr="error: unknown option '--x'\n")).status == PASSED
    v = check(t, RunOutcome(exit_codes=[2], stderr="error: something else\n"))
    assert v.status == FAILED and "stderr lacks" in v.failures[0]
    v = check(t, RunOutcome(exit_codes=[0]))
    assert v.status == FAILED and "exit code 0, expected 2" in v.failures


def test_user_error_with_traceback_fails():
    t = decl("bad", exit_code=2, trains=False)
    v = check(t, RunOutcome(exit_codes=[2], stderr="Traceback (most recent call last):\nerror: x\n"))
    assert v.status == FAILED and "traceback" in v.failures[0]


def test_stdout_fragment_is_checked():
    t = decl("dry", trains=False, stdout_contains=("peak",))
    assert check(t, RunOutcome(exit_codes=[0], stdout="estimated peak 12 GiB")).status == PASSED
    assert check(t, RunOutcome(exit_codes=[0], stdout="nothing")).status == FAILED


def test_loss_must_fall_and_be_finite():
    assert "did not fall" in check(decl("a"), ok(metrics([5.0, 5.1, 5.2]))).failures[0]
    v = check(decl("a", falling_loss=False), ok(metrics([5.0, math.nan, 4.0])))
    assert v.failures == ["loss is nan at step 2"]


def test_step_count_and_trace_count():
    v = check(decl("a", steps=4), ok(metrics(LOSSES)))
    assert v.failures == ["logged steps [1, 2, 3], expected 1..4"]
    v = check(decl("a", trace_count=1), ok(metrics(LOSSES, trace_count=2)))
    assert v.failures == ["trace/count = 2, expected 1"]
    v = check(decl("a", trace_count=1), ok(metrics(LOSSES, trace_count=None)))
    assert v.failures == ["trace/count = none logged, expected 1"]


def test_missing_tensorboard_or_summary_fails():
    assert "no TensorBoard" in check(decl("a"), ok(RunMetrics())).failures[0]
    m = replace(metrics(LOSSES), has_summary=False)
    assert "no summary.json" in check(decl("a"), ok(m)).failures[0]


def test_tensorboard_must_agree_with_summary():
    m = metrics(LOSSES)
    m.tb_losses[1] = as_float32(5.71)
    assert "is not summary.json's" in check(decl("a"), ok(m)).failures[0]
    m = metrics(LOSSES)
    m.tb_steps = [1, 2]
    assert "TensorBoard logged steps" in check(decl("a"), ok(m)).failures[0]


def test_absolute_peak_limit():
    assert check(decl("a", max_peak_gib=0.1), ok(metrics(LOSSES, peak_gib=0.05))).status == PASSED
    v = check(decl("a", max_peak_gib=0.01), ok(metrics(LOSSES, peak_gib=0.05)))
    assert "> limit 0.01 GiB" in v.failures[0]
    assert (
        "no memory/max_active(GiB)" in check(decl("a", max_peak_gib=1), ok(metrics(LOSSES, peak_gib=None))).failures[0]
    )


def test_estimate_must_be_logged_and_equal_measured_on_cpu():
    t = decl("a", estimate_matches_measured=True)
    assert check(t, ok(metrics(LOSSES, est_bytes=1000, active_bytes=1000))).status == PASSED
    v = check(t, ok(metrics(LOSSES, est_bytes=1000, active_bytes=1504)))
    assert v.failures == ["estimated peak 1,000 B != measured 1,504 B (-504 B)"]
    v = check(t, ok(metrics(LOSSES, active_bytes=1000)))
    assert v.status == FAILED and v.failures == ["no memory estimate logged: estimate == measured cannot be checked"]
    v = check(t, ok(metrics(LOSSES, est_bytes=1000, active_bytes=1504)), on_cpu=False)
    assert v.status == PASSED and "CPU only" in v.notes[0]


def test_timeout_and_earlier_invocation_failures():
    t = decl("a", runs=2)
    assert check(t, RunOutcome(exit_codes=[0, -9], timed_out=True)).failures == [
        "timed out after 900 s (invocation 2/2)"
    ]
    assert check(t, RunOutcome(exit_codes=[3])).failures == ["invocation 1/2 exited 3, expected 0"]


def test_rejected_feature_is_skipped_with_the_trainers_message():
    t = decl("dp", skip_if_rejected="dp_shard")
    v = check(t, RunOutcome(exit_codes=[2], stderr="W warning\nerror: parallelism.dp_shard > 1 is not supported\n"))
    assert v.status == SKIPPED and v.skip_reason.endswith("error: parallelism.dp_shard > 1 is not supported")
    assert check(t, RunOutcome(exit_codes=[2], stderr="error: other\n")).status == FAILED


def test_missing_requirement_is_skipped():
    v = check(decl("a"), RunOutcome(skip_reason="needs a CUDA device"))
    assert v.status == SKIPPED and v.skip_reason == "needs a CUDA device"


# ---------------------------------------------------------------------------
# Cross-test checks
# ---------------------------------------------------------------------------


def test_bitwise_equal_losses_and_digests():
    t = decl("trace", bitwise_equal_to="eager")
    ref = ok(metrics(LOSSES))
    assert check(t, ok(metrics(LOSSES)), {"eager": ref}).status == PASSED
    one_ulp = math.nextafter(5.7, math.inf)
    v = check(t, ok(metrics([5.9, one_ulp, 5.5])), {"eager": ref})
    assert v.status == FAILED and "step 2" in v.failures[0] and "not bitwise equal" in v.failures[0]
    v = check(t, ok(metrics(LOSSES, grads=SHA_B)), {"eager": ref})
    assert v.failures == ["final grads_sha256 differs from eager's (bbbbbbbbbbbb vs aaaaaaaaaaaa)"]
    v = check(t, ok(metrics(LOSSES[:2])), {"eager": ref})
    assert "logged steps [1, 2] differ" in v.failures[0]


def test_bitwise_distinguishes_signed_zero():
    t = decl("trace", bitwise_equal_to="eager", falling_loss=False)
    v = check(t, ok(metrics([0.0, 0.0])), {"eager": ok(metrics([0.0, -0.0]))})
    assert v.status == FAILED


def test_peak_ratio():
    t = decl("trace_full", peak_ratio=PeakRatio("eager_full", 1.0))
    eager = ok(metrics(LOSSES, peak_gib=0.05))
    assert check(t, ok(metrics(LOSSES, peak_gib=0.05)), {"eager_full": eager}).status == PASSED
    v = check(t, ok(metrics(LOSSES, peak_gib=0.051)), {"eager_full": eager})
    assert v.status == FAILED and "ratio 1.020" in v.failures[0]
    loose = decl("trace_full", peak_ratio=PeakRatio("eager_full", 1.1))
    assert check(loose, ok(metrics(LOSSES, peak_gib=0.051)), {"eager_full": eager}).status == PASSED
    v = check(t, ok(metrics(LOSSES)), {"eager_full": ok(metrics(LOSSES, peak_gib=None))})
    assert "for eager_full" in v.failures[0]


def test_loss_close_to():
    t = decl("dp", loss_close_to=("ref", 1e-4))
    ref = ok(metrics(LOSSES))
    assert check(t, ok(metrics([5.9, 5.7 * (1 + 5e-5), 5.5])), {"ref": ref}).status == PASSED
    v = check(t, ok(metrics([5.9, 5.7 * (1 + 5e-4), 5.5])), {"ref": ref})
    assert "beyond rtol" in v.failures[0]


def test_reference_problems():
    t = decl("trace", bitwise_equal_to="eager")
    v = check(t, ok(metrics(LOSSES)), {"eager": RunOutcome(skip_reason="needs a CUDA device")})
    assert v.status == SKIPPED and "'eager' was skipped" in v.skip_reason
    v = check(t, ok(metrics(LOSSES)), {"eager": RunOutcome(exit_codes=[1])})
    assert v.failures == ["reference test 'eager' has no results to compare with"]
    v = check(t, ok(metrics(LOSSES)), {})
    assert v.failures == ["reference test 'eager' did not run in this session"]


# ---------------------------------------------------------------------------
# Reading a run back (a dump folder written by the trainer's own MetricsLogger)
# ---------------------------------------------------------------------------


def _log(folder: Path, steps: range, total: int, losses: dict[int, float]) -> None:
    from graph_trainer.observability.metrics import MetricsLogger

    with MetricsLogger(folder, enable_tensorboard=True, log_freq=1, total_steps=total) as logger:
        for step in steps:
            logger.log_step(
                step,
                {
                    "loss": losses[step],
                    "tokens_per_s": 100.0 * step,
                    "peak_active_bytes": 1000 * step,
                    "peak_reserved_bytes": 2000 * step,
                    "estimated_peak_bytes": 1000 * step,
                    "trace_count": 1,
                    "trace_time_s": 0.25,
                },
            )
        logger.set_final({"status": "ok", "params_sha256": SHA_A, "grads_sha256": SHA_B})


def test_collect_run_reads_tensorboard_and_summary(tmp_path):
    losses = {1: 5.913122653961182, 2: 5.8, 3: 5.5358500480651855}
    _log(tmp_path, range(1, 4), 3, losses)
    m = collect_run(tmp_path)
    assert m.has_tensorboard and m.has_summary
    assert m.steps == m.tb_steps == [1, 2, 3]
    assert m.losses == [losses[1], losses[2], losses[3]]  # exact, from summary.json
    assert m.tb_losses == [as_float32(x) for x in m.losses]  # float32, from TensorBoard
    assert m.peak_active_gib == pytest.approx(3000 / 1024**3, rel=1e-6)
    assert m.peak_reserved_gib == pytest.approx(6000 / 1024**3, rel=1e-6)
    assert m.estimated_peak_gib == pytest.approx(3000 / 1024**3, rel=1e-6)
    assert m.peak_active_bytes == m.estimated_peak_bytes == 3000
    assert m.tokens_per_s == pytest.approx(250.0)  # steps 2 and 3: the first step includes tracing
    assert m.trace_time_s == 0.25 and m.trace_count == 1
    assert (m.params_sha256, m.grads_sha256) == (SHA_A, SHA_B)
    t = decl("a", steps=3, trace_count=1, estimate_matches_measured=True)
    assert check(t, ok(m)).status == PASSED


def test_collect_run_after_resume_keeps_one_value_per_step(tmp_path):
    first = {1: 6.0, 2: 5.9, 3: 99.0}  # step 3 of the first run is redone by the resumed run
    second = {3: 5.8, 4: 5.7}
    _log(tmp_path, range(1, 4), 4, first)
    _log(tmp_path, range(3, 5), 4, second)
    m = collect_run(tmp_path)
    assert m.steps == m.tb_steps == [1, 2, 3, 4]
    assert m.losses == [6.0, 5.9, 5.8, 5.7]
    assert m.tb_losses == [as_float32(x) for x in m.losses]


def test_collect_run_of_an_empty_folder(tmp_path):
    m = collect_run(tmp_path / "missing")
    assert not m.has_tensorboard and not m.has_summary and m.final_loss is None


# ---------------------------------------------------------------------------
# Declarations
# ---------------------------------------------------------------------------


def test_spec_validation():
    with pytest.raises(ValueError, match="runner sets it"):
        IntegrationTest(name="a", runs=(("--job.dump_folder", "x"),), suites=("quick",))
    with pytest.raises(ValueError, match="lower_snake_case"):
        IntegrationTest(name="Bad-Name", runs=(("--x",),), suites=("quick",))
    with pytest.raises(ValueError, match="suites"):
        IntegrationTest(name="a", runs=(("--x",),), suites=("nightly",))
    with pytest.raises(ValueError, match="not another declared test"):
        validate_tests([decl("a", bitwise_equal_to="b")])
    with pytest.raises(ValueError, match="duplicate"):
        validate_tests([decl("a"), decl("a")])


def test_dependencies_are_pulled_in_transitively():
    a, b = decl("a"), decl("b", bitwise_equal_to="a")
    c = decl("c", peak_ratio=PeakRatio("b"))
    assert [t.name for t in with_dependencies([c], [a, b, c])] == ["a", "b", "c"]


def test_declared_tests_cover_the_promises():
    names = {t.name for t in TESTS}
    for required in (
        "eager",
        "trace",
        "trace_optimizer",
        "trace_selective",
        "eager_selective",
        "trace_full",
        "eager_full",
        "budget_low",
        "budget_high",
        "dry_run_8b",
        "bad_config_unknown_key",
        "resume",
        "dp_shard_2",
    ):
        assert required in names
    quick = [t for t in TESTS if "quick" in t.suites]
    quick_names = {t.name for t in quick}
    assert all(ref in quick_names for t in quick for ref in t.expect.references())
    assert all("quick" not in t.suites for t in TESTS if t.nproc > 1)  # CI has no torchrun budget


@pytest.mark.parametrize("t", TESTS, ids=lambda t: t.name)
def test_declared_invocations_parse_as_the_trainer_expects(t, tmp_path):
    """Every declared command line is a valid config, or fails with the declared message, without running."""
    from graph_trainer.errors import UserError
    from graph_trainer.job_config.cli import load_config

    for args in t.runs:
        argv = run_tests.build_command(t, args, tmp_path / t.name, track_memory=True)
        argv = argv[argv.index("graph_trainer") + 1 :]
        if t.expect.exit_code == 2:
            with pytest.raises(UserError) as info:
                load_config(argv)
            for fragment in t.expect.stderr_contains:
                assert fragment.removeprefix("error: ") in str(info.value)
        else:
            cfg, _ = load_config(argv)
            assert cfg.metrics.enable_tensorboard and cfg.job.dump_folder == str(tmp_path / t.name)


# ---------------------------------------------------------------------------
# Peak-memory chart (matplotlib, the `plots` extra)
# ---------------------------------------------------------------------------


def _runs_with_memory() -> list[run_tests.TestRun]:
    full = metrics(LOSSES, peak_gib=0.012)
    full.estimated_peak_gib = 0.012
    return [
        run_tests.TestRun(decl("eager"), ok(metrics(LOSSES, peak_gib=0.03)), []),
        run_tests.TestRun(decl("trace_full"), ok(full), []),
    ]


def test_chart_is_a_png_matplotlib_reads_back(tmp_path):
    import_extra("matplotlib")
    import matplotlib.image

    line, name = run_tests.chart_line(tmp_path, _runs_with_memory())
    assert name == run_tests.CHART_FILE and line == f"chart: {tmp_path / run_tests.CHART_FILE}"
    pixels = matplotlib.image.imread(tmp_path / run_tests.CHART_FILE)  # PIL decodes it
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    colors = {tuple(round(c * 255) for c in p[:3]) for p in pixels.reshape(-1, pixels.shape[2]).tolist()}
    # Both series are drawn, in matplotlib's first two cycle colors (C0 blue, C1 orange).
    assert {(0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)} <= colors


def test_without_matplotlib_the_runner_says_how_to_get_the_chart_and_writes_the_rest(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # `import` of it raises ImportError
    runs = _runs_with_memory()
    for r in runs:
        r.verdict = check(r.test, r.outcome)
    assert run_tests.report(tmp_path, runs, {"wall_time_s": 1.0}) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert "chart: not written, matplotlib is missing (pip install 'graph_trainer[plots]' draws it)" in lines
    assert lines[-1] == "2 passed, 0 failed"
    assert json.loads((tmp_path / "results.json").read_text())["chart"] is None
    assert not (tmp_path / run_tests.CHART_FILE).exists()


def test_no_chart_when_no_test_logged_memory(tmp_path):
    runs = [run_tests.TestRun(decl("a"), ok(metrics(LOSSES, peak_gib=None)), [])]
    assert run_tests.chart_line(tmp_path, runs) == ("chart: none (no test logged peak memory)", None)


# ---------------------------------------------------------------------------
# Runner command line and reporting
# ---------------------------------------------------------------------------


def test_list_prints_tests_suites_and_commands(capsys):
    assert run_tests.main(["--list", "--suite", "full"]) == 0
    out = capsys.readouterr().out
    assert "dp_shard_2  [full]  requires: distributed" in out
    assert "torch.distributed.run --standalone --nnodes 1 --nproc_per_node 2 -m graph_trainer" in out
    assert "--job.dump_folder OUTPUT_DIR/trace" in out
    assert out.rstrip().endswith(f"{len(TESTS)} tests")


def test_test_selection_adds_references_and_rejects_unknown_names():
    selected = run_tests.select_tests(TESTS, "quick", ["trace_selective"])
    assert [t.name for t in selected] == ["eager", "eager_selective", "trace_selective"]
    with pytest.raises(run_tests.UsageError, match="did you mean 'trace'"):
        run_tests.select_tests(TESTS, "quick", ["trac"])


def test_output_dir_is_refused_when_non_empty(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    assert run_tests.main([str(tmp_path), "--test", "bad_config_ac_mode"]) == 2
    assert "not empty; pass --overwrite" in capsys.readouterr().err
    assert run_tests.main([str(tmp_path), "--test", "bad_config_ac_mode", "--overwrite"]) == 2
    assert "not written by run_tests.py" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").exists()


def test_runner_on_expected_failure_tests_end_to_end(tmp_path, capsys):
    """The CLI tests exit before any training, so the whole runner runs here in about a second."""
    out = tmp_path / "out"
    argv = [str(out), "--test", "bad_config_unknown_key", "--test", "bad_config_ac_mode", "--parallel", "2"]
    assert run_tests.main(argv) == 0
    text = capsys.readouterr().out
    assert text.rstrip().splitlines()[-1] == "2 passed, 0 failed"
    results = json.loads((out / "results.json").read_text())
    assert [t["status"] for t in results["tests"]] == ["passed", "passed"]
    assert results["tests"][0]["exit_codes"] == [2]
    assert "did you mean" in (out / "logs" / "bad_config_unknown_key.stderr.txt").read_text()
    # A second run into the same folder needs --overwrite, which empties it.
    assert run_tests.main(argv) == 2
    assert run_tests.main(argv + ["--overwrite"]) == 0


def test_failed_check_exits_1_and_shows_stderr_tail(tmp_path, capsys, monkeypatch):
    bad = IntegrationTest(
        name="must_fail",
        runs=(("--config", "llama3_debug.toml", "--training.stepz", "1"),),
        suites=("quick",),
        expect=Expect(exit_code=0, trains=False),
    )
    monkeypatch.setattr(run_tests, "load_tests", lambda: [bad])
    assert run_tests.main([str(tmp_path / "out"), "--test", "must_fail"]) == 1
    text = capsys.readouterr().out
    assert "FAILED must_fail: exit code 2, expected 0" in text
    assert "    error: unknown option '--training.stepz'" in text
    assert text.rstrip().splitlines()[-1] == "0 passed, 1 failed"


def test_counts_line_and_table():
    runs = [run_tests.TestRun(decl("a"), ok(metrics(LOSSES)), []), run_tests.TestRun(decl("b"), RunOutcome(), [])]
    runs[0].verdict = check(runs[0].test, runs[0].outcome)
    runs[1].verdict = check_test(runs[1].test, RunOutcome(skip_reason="needs cuda"), {})
    assert run_tests.counts_line(runs) == "1 passed, 0 failed, 1 skipped"
    table = run_tests.format_table(run_tests.table_rows(runs)).splitlines()
    assert table[0].split("  ")[0] == "test" and len(table) == 4
    assert "5.5000" in table[2] and "51.20" in table[2]  # final loss, 0.05 GiB in MiB


# ---------------------------------------------------------------------------
# End to end on real training
# ---------------------------------------------------------------------------


@pytest.mark.integration
def test_run_tests_end_to_end_on_one_tiny_training_run(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "run_tests.py"), str(out), "--test", "resume_reference", "--collect-peak-memory"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().splitlines()[-1] == "1 passed, 0 failed"
    (result,) = json.loads((out / "results.json").read_text())["tests"]
    assert result["status"] == "passed" and result["exit_codes"] == [0]
    m = result["metrics"]
    assert m["steps"] == m["tb_steps"] == [1, 2, 3, 4, 5, 6]
    assert m["peak_active_gib"] > 0 and m["tokens_per_s"] > 0 and m["trace_count"] == 1
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "peak_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
