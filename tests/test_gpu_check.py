"""benchmarks/gpu_check.py: the one GPU check. Its parts run here on CPU at --small sizes, through the same code
(each part in its own process, the table, the JSON through benchmarks.results.save); the real sizes need CUDA."""

from __future__ import annotations

import json
import math
import os
import sys
import time

import pytest
import torch

from benchmarks import gpu_check
from graph_trainer.job_config.cli import load_config


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a CUDA device")
def test_without_cuda_it_says_so_in_one_line_and_runs_nothing(tmp_path, capsys):
    assert gpu_check.main(["--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1 and "no CUDA device" in out
    assert not list(tmp_path.iterdir())


@pytest.mark.integration  # four processes: about a minute of CPU
def test_the_small_check_runs_every_part_and_saves_its_one_table(tmp_path, capsys):
    """pytest -m gpu, eager and traced step times with their ratio, the traced step's memory against the estimate
    and the simulator, and a bf16 fine-tune step from a 6-layer folder transformers wrote."""
    assert gpu_check.main(["--small", "--results-dir", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["command"] == f"python -m benchmarks.gpu_check --small --results-dir {tmp_path}"
    table = record["tables"]["gpu_check"]
    assert table in capsys.readouterr().out
    data = record["data"]
    cuda = torch.cuda.is_available()
    assert {k: data["pytest"][k] for k in ("passed", "failed", "errors", "skipped")} == {
        "passed": int(cuda), "failed": 0, "errors": 0, "skipped": int(not cuda)
    }  # fmt: skip
    runs = {(r["mode"], r["ac"]): r for r in data["runs"]}
    assert set(runs) == {("eager", "none"), ("trace", "none")}
    eager, traced = runs["eager", "none"], runs["trace", "none"]
    assert (
        f"| step time | trace, ac none | {traced['step_s']:.3f} | {traced['step_s'] / eager['step_s']:.2f}x |" in table
    )
    if not cuda:
        # The CPU tracker's peak is exact, and so are the estimate and the simulator's live bytes (the same step).
        assert traced["estimated_peak_bytes"] == traced["peak_active_bytes"] == traced["sim_requested_bytes"]
    assert traced["sim_reserved_bytes"] >= traced["sim_allocated_bytes"] >= traced["sim_requested_bytes"] > 0
    finetune = data["finetune"]
    assert finetune["blocks"] == 6 and finetune["loaded_as_written"], finetune
    assert finetune["writer"].startswith("transformers") and math.isfinite(finetune["loss"])
    assert finetune["tokens_per_s"] > 0 and finetune["peak_active_bytes"] > 0


def test_the_gpu_sizes_run_every_mode_and_ac_mode_within_a_third_of_a_lease_less_than_nine_minutes():
    config_ac = load_config(["--config", gpu_check.GPU.config])[0].activation_checkpoint.mode
    runs = gpu_check.planned_runs(gpu_check.GPU, config_ac)
    keys = [key for key, _, _ in runs]
    memory_only = [("trace", "none"), ("trace", "full"), ("trace", "budget")]
    assert keys == [(m, "selective") for m in gpu_check.MODES] + memory_only
    # The budget row runs no simulator: it would solve the plan a second time.
    assert [key for key, _, spec in runs if spec["simulate"]] == [("trace", ac) for ac in ("selective", "none", "full")]
    caps = sum(cap for _, cap, _ in runs) + gpu_check.GPU.caps_s["pytest"] + gpu_check.GPU.caps_s["finetune"]
    # A lease is 15 minutes of device time, a start one to two of them: the check leaves room to rerun a part.
    assert caps <= gpu_check.GPU.budget_s <= 500
    # The budget row asks for a budget the 1B can reach (the default 0.5 is refused on CUDA: "0.734 or more").
    assert gpu_check.GPU.budget == ("--activation_checkpoint.memory_budget", "0.8")


def test_a_child_trainer_keeps_the_callers_pythonpath_after_the_checkout(monkeypatch, tmp_path):
    from tests.extras import child_pythonpath

    monkeypatch.setenv("PYTHONPATH", "/tmp/site")  # where the GPU image's carried wheels were installed
    assert child_pythonpath(tmp_path).split(os.pathsep) == [str(tmp_path), "/tmp/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert child_pythonpath(tmp_path) == str(tmp_path)


def test_a_spent_budget_starts_nothing_and_a_part_past_its_cap_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "ran"
    touch = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    row = gpu_check.run_part(gpu_check.Budget(0), 60, touch, gpu_check.read_worker)
    assert row["error"] == "not run: the check's 0 s budget is spent" and not marker.exists()
    # A part whose child outlives it (as Inductor's compile workers would): both end at the cap.
    child = f"import time; time.sleep(2); open({str(marker)!r}, 'w')"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    start = time.monotonic()
    row = gpu_check.run_part(gpu_check.Budget(100), 1, [sys.executable, "-c", parent], gpu_check.read_worker)
    assert row["error"] == "timed out after 1 s" and time.monotonic() - start < 10
    time.sleep(2.5)
    assert not marker.exists()


def test_pytest_counts_read_each_outcome(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="t" name="ok"/><testcase classname="t" name="ok2"/>'
        '<testcase classname="t" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="t" name="broken"><error message="y"/></testcase>'
        '<testcase classname="t" name="later"><skipped message="z"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert gpu_check.pytest_counts(xml) == {
        "passed": 2, "failed": 1, "errors": 1, "skipped": 1, "failed_tests": ["t::bad", "t::broken"]
    }  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_allocator_peak_the_check_reads_counts_a_step_s_tensors():
    from graph_trainer.observability.memory import reset_peak

    device = torch.device("cuda")
    reset_peak(device)
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    assert gpu_check._allocator_peaks(device)["peak_allocated_bytes"] >= x.numel()
