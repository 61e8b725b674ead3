"""The real Trainer end to end: loss falls, modes agree bitwise, resume continues exactly, bad runs stop cleanly."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graph_trainer.errors import UserError
from graph_trainer.job_config.cli import load_config
from graph_trainer.trainer import Trainer, TrainingDiverged
from tests.tiny import TINY as TINY_RUN

REPO = Path(__file__).resolve().parents[1]
TINY = TINY_RUN


@pytest.fixture(autouse=True)
def restore_determinism():
    yield
    torch.use_deterministic_algorithms(False)


def run(tmp: Path, *overrides: str, steps: int = 5):
    cfg, _ = load_config(
        ["--config", "llama3_debug", *TINY, "--training.steps", str(steps), "--job.dump_folder", str(tmp), *overrides]
    )
    return Trainer(cfg).train()


@pytest.mark.integration  # whole trainer runs, over a few seconds
def test_eager_twenty_steps_on_embedded_corpus_loss_falls(tmp_path):
    result = run(
        tmp_path, "--compile.mode", "eager", "--training.local_batch_size", "4", "--optimizer.lr", "3e-3", steps=20
    )
    assert len(result.losses) == 20
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first - 0.5, result.losses
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["loss"] for s in summary["steps"]] == result.losses
    assert summary["final"]["status"] == "ok"


@pytest.mark.parametrize(
    "mode",
    [["--compile.mode", "trace"], ["--compile.mode", "trace", "--compile.trace_optimizer", "true"]],
    ids=["trace", "trace+optimizer"],
)
@pytest.mark.integration  # whole trainer runs, over a few seconds
def test_five_steps_traced_equal_eager_bitwise(tmp_path, mode):
    eager = run(tmp_path / "eager", "--compile.mode", "eager")
    traced = run(tmp_path / "traced", *mode)
    assert traced.losses == eager.losses
    assert traced.params_sha256 == eager.params_sha256
    assert traced.grads_sha256 == eager.grads_sha256
    assert traced.trace_count == 1


@pytest.mark.parametrize("extra, traces", [([], 1), (["--compile.dump_graphs", "true"], 2)], ids=["reused", "dumps"])
def test_a_run_traces_once_when_the_preflight_trace_fits(tmp_path, monkeypatch, caplog, extra, traces):
    """The first step runs the preflight's graph; with graph dumps (written only once the run folder is
    prepared) the step traces again. trace_count counts the traces of the step that runs: 1 either way."""
    import graph_trainer.tracer.executor as executor

    calls = []  # the preflight and the trainer both trace through GraphStep
    monkeypatch.setattr(
        executor, "trace_step", lambda *a, _trace=executor.trace_step, **k: calls.append(1) or _trace(*a, **k)
    )
    caplog.set_level(logging.INFO, logger="graph_trainer")
    result = run(tmp_path, *extra, steps=2)
    assert len(calls) == traces and result.trace_count == 1
    reused = any("reuses the trace made by the preflight" in m for m in caplog.messages)
    assert reused == (traces == 1)


@pytest.mark.integration  # whole trainer runs, over a few seconds
def test_resume_continues_bitwise(tmp_path):
    straight = run(tmp_path / "straight", steps=6)
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    first = run(tmp_path / "split", *ckpt, steps=3)
    second = run(tmp_path / "split", *ckpt, "--checkpoint.resume", steps=6)
    assert first.losses + second.losses == straight.losses
    assert second.params_sha256 == straight.params_sha256
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert [s["loss"] for s in summary["steps"]] == straight.losses


def test_resume_with_other_model_shape_names_tensor_and_keeps_checkpoint(tmp_path):
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    run(tmp_path, *ckpt, steps=2)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()}
    with pytest.raises(UserError, match=r"checkpoint tensor '.*' has shape"):
        run(tmp_path, *ckpt, "--checkpoint.resume", "--model.dim", "128", steps=4)
    after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()}
    assert before == after


def test_non_empty_dump_folder_is_not_overwritten(tmp_path):
    run(tmp_path, steps=1)
    summary = (tmp_path / "summary.json").read_bytes()
    with pytest.raises(UserError, match="already holds a run"):
        run(tmp_path, steps=1)
    assert (tmp_path / "summary.json").read_bytes() == summary
    run(tmp_path, "--job.overwrite", "true", steps=2)
    assert len(json.loads((tmp_path / "summary.json").read_text())["steps"]) == 2


@pytest.mark.integration  # whole trainer runs, over a few seconds
def test_divergence_saves_no_bad_checkpoint_and_the_last_good_one_resumes_finite(tmp_path):
    """Issue 8.3: the "last good" checkpoint after lr 1e10 held weights of ~4e9 and gave NaN on any resume."""
    ckpt = [
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "1",
        "--training.max_norm",
        "0",
        "--lr_scheduler.warmup_steps",
        "0",
    ]
    run(tmp_path, *ckpt, steps=2)
    with pytest.raises(TrainingDiverged, match=r"the last good checkpoint is .*step-00000002\.pt \(step 2\)"):
        run(tmp_path, *ckpt, "--checkpoint.resume", "--optimizer.lr", "1e10", steps=10)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final"]["status"] == "diverged"
    assert summary["final"]["final_step"] == 3  # step 3's update blew up; nothing was saved for it
    saved = sorted(p.name for p in (tmp_path / "checkpoint").glob("step-*.pt"))
    assert saved[-1] == "step-00000002.pt"
    weights = torch.load(tmp_path / "checkpoint" / saved[-1], weights_only=True)["model"]
    assert all(bool(w.isfinite().all()) and float(w.abs().max()) < 100 for w in weights.values())
    resumed = run(tmp_path, *ckpt, "--checkpoint.resume", "--optimizer.lr", "1e-4", steps=4)
    assert len(resumed.losses) == 2 and all(torch.isfinite(torch.tensor(resumed.losses)))


def test_divergence_from_the_first_step_saves_nothing(tmp_path):
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "1", "--training.max_norm", "0"]
    with pytest.raises(TrainingDiverged, match="no checkpoint was saved"):
        run(tmp_path, *ckpt, "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0", steps=10)
    assert not list((tmp_path / "checkpoint").glob("step-*.pt"))


def test_tokenizer_larger_than_model_vocab_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="vocab_size"):
        run(tmp_path, "--model.vocab_size", "100", steps=1)


@pytest.mark.integration  # whole trainer runs, over a few seconds
def test_cli_end_to_end_from_another_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "graph_trainer",
            "--config",
            "llama3_debug.toml",
            *TINY,
            "--training.steps",
            "2",
            "--job.dump_folder",
            str(tmp_path / "run"),
            "--metrics.enable_tensorboard",
            "true",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "parameters" in proc.stdout and "step 2/2" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(summary["steps"]) == 2 and summary["final"]["trace_count"] == 1
    assert any((tmp_path / "run" / "tb").iterdir())


def test_dump_graphs_writes_code_summary_and_saved_tensors(tmp_path):
    run(tmp_path, "--compile.dump_graphs", "true", "--activation_checkpoint.mode", "selective", steps=1)
    dump = tmp_path / "graphs" / "trace_1"
    code = (dump / "00_traced.py").read_text()
    assert "torch.ops.aten.mm.default" in code and "_scaled_dot_product_flash_attention_for_cpu" in code
    assert (dump / "04_after_remat.py").exists()
    summary = (dump / "summary.txt").read_text()
    assert "by phase: forward" in summary and "backward" in summary and "layers.0.attention.wq" in summary
    assert "estimated peak" in summary
    saved = (dump / "saved_tensors.txt").read_text()
    assert "saved activations:" in saved and "per layer:" in saved and "layers.0" in saved


@pytest.mark.integration  # whole trainer runs, over a few seconds
def test_bf16_autocast_traced_equal_eager(tmp_path):
    bf16 = ["--training.dtype", "bfloat16"]
    eager = run(tmp_path / "eager", *bf16, "--compile.mode", "eager", steps=3)
    traced = run(tmp_path / "traced", *bf16, steps=3)
    assert traced.losses == eager.losses
    assert traced.params_sha256 == eager.params_sha256
    assert traced.losses != run(tmp_path / "fp32", steps=3).losses  # autocast really changed the math


def test_divergence_guard_tolerates_healthy_norm_growth_and_stops_a_blow_up():
    """The parameter-norm bound is wide (10x between saves): a few-fold growth is healthy, orders of magnitude
    is not."""
    from graph_trainer.observability.divergence import MAX_NORM_GROWTH, DivergenceGuard, TrainingDiverged

    guard = DivergenceGuard()
    guard.start([torch.ones(4)], step=0)  # norm 2
    guard.check_step(1, loss=5.0, grad_norm=1.0)
    guard.check_before_save(1, loss=5.0, params=[torch.full((4,), 3.0)])  # 3x: healthy, becomes the reference
    with pytest.raises(TrainingDiverged, match="parameter norm exploded"):
        guard.check_before_save(2, loss=5.0, params=[torch.full((4,), 3.0 * MAX_NORM_GROWTH * 1.01)])
    with pytest.raises(TrainingDiverged, match="not finite"):
        guard.check_before_save(3, loss=5.0, params=[torch.tensor([float("inf")])])
    with pytest.raises(TrainingDiverged, match="loss exploded"):
        guard.check_before_save(4, loss=51.0, params=[torch.full((4,), 3.0)])
