"""Metrics component: TensorBoard tags, exact summary.json, console line, rank-0-only writes."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from graph_trainer.observability.metrics import TB_TAGS, MetricsLogger, format_step_line
from graph_trainer.observability.units import GIB

EXPECTED_TAGS = {
    "loss_metrics/global_avg_loss",
    "grad_norm",
    "lr",
    "throughput(tps)",
    "data/counted_fraction",
    "tflops",
    "mfu(%)",
    "memory/max_active(GiB)",
    "memory/max_reserved(GiB)",
    "memory/num_alloc_retries",
    "memory/num_ooms",
    "memory/estimated_peak(GiB)",
    "memory/saved_activations(GiB)",
    "memory/estimate_error(%)",
    "memory/rss_peak(GiB)",
    "memory/late_free(GiB)",
    "trace/count",
    "compile/trace_time_s",
    "compile/inductor_time_s",
    "time/step_s",
    "moe/max_tokens_per_expert",
    "moe/mean_tokens_per_expert",
    "moe/max_over_mean_load",
    "moe/dropped_tokens",
    "pipeline/bubble(%)",
}


def _f32(x: float) -> float:
    """A loss as the trainer produces it: a float32 scalar read with .item()."""
    return torch.tensor(x, dtype=torch.float32).item()


def _record(step: int) -> dict:
    return {
        "loss": _f32(7.0 / (step + 0.1234567)),
        "grad_norm": 1.0 + step / 3,
        "lr": 8e-4 * step,
        "step_time_s": 0.5,
        "tokens_per_s": 4321.0,
        "counted_fraction": 0.25,
        "tflops": 1.5,
        "mfu_pct": 12.5,
        "peak_active_bytes": 2 * GIB,
        "peak_reserved_bytes": 3 * GIB,
        "estimated_peak_bytes": GIB // 2,
        "saved_activation_bytes": GIB // 4,
        "estimate_error_pct": -75.0,
        "num_alloc_retries": 0,
        "num_ooms": 0,
        "rss_peak_bytes": 5 * GIB,
        "late_free_bytes": GIB // 4,
        "trace_count": 1,
        "trace_time_s": 0.6,
        "inductor_time_s": 12.5,
        "max_tokens_per_expert": 96.0,
        "mean_tokens_per_expert": 64.0,
        "max_over_mean": 1.5,
        "dropped_tokens": 3.0,
        "pp_bubble_pct": 12.5,
    }


def _scalars(tb_folder) -> EventAccumulator:
    acc = EventAccumulator(str(tb_folder), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def test_tensorboard_tags_are_the_published_names_and_values(tmp_path):
    assert set(TB_TAGS.values()) == EXPECTED_TAGS
    with MetricsLogger(tmp_path, enable_tensorboard=True, log_freq=2, total_steps=3) as m:
        for step in (1, 2, 3):
            m.log_step(step, _record(step))
    acc = _scalars(tmp_path / "tb")
    assert set(acc.Tags()["scalars"]) == EXPECTED_TAGS
    loss = acc.Scalars("loss_metrics/global_avg_loss")
    assert [e.step for e in loss] == [1, 2, 3]  # every step, not only logged ones
    assert [e.value for e in loss] == [_record(s)["loss"] for s in (1, 2, 3)]  # float32 survives exactly
    assert acc.Scalars("memory/max_active(GiB)")[0].value == 2.0
    assert acc.Scalars("memory/max_reserved(GiB)")[0].value == 3.0
    assert acc.Scalars("memory/estimated_peak(GiB)")[0].value == 0.5
    assert acc.Scalars("memory/saved_activations(GiB)")[0].value == 0.25
    assert acc.Scalars("memory/rss_peak(GiB)")[0].value == 5.0
    assert acc.Scalars("trace/count")[-1].value == 1.0
    assert acc.Scalars("mfu(%)")[-1].value == 12.5
    assert acc.Scalars("pipeline/bubble(%)")[-1].value == 12.5


def test_summary_json_has_every_step_with_exact_losses(tmp_path):
    m = MetricsLogger(tmp_path, enable_tensorboard=False, log_freq=5, total_steps=7, config_toml="[job]\nname = 'x'\n")
    for step in range(1, 6):
        m.log_step(step, {"loss": _f32(10.0 / step + 1e-3), "lr": 1e-3, "step_time_s": 0.1})
    mid = json.loads((tmp_path / "summary.json").read_text())  # valid mid-run, after a logged step
    assert [s["step"] for s in mid["steps"]] == [1, 2, 3, 4, 5]
    for step in (6, 7):
        m.log_step(step, {"loss": _f32(10.0 / step + 1e-3), "grad_norm": None})
    m.set_final({"status": "ok", "final_loss": _f32(10.0 / 7 + 1e-3), "param_sha256": "ab" * 32})
    m.close()

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["schema_version"] == 1
    assert summary["config"] == "[job]\nname = 'x'\n"
    assert [s["step"] for s in summary["steps"]] == list(range(1, 8))
    for s in summary["steps"]:
        assert s["loss"] == _f32(10.0 / s["step"] + 1e-3)  # bitwise: no rounding on the way through JSON
        assert torch.equal(torch.tensor(s["loss"], dtype=torch.float32).double(), torch.tensor(s["loss"]))
    assert "grad_norm" not in summary["steps"][-1]  # None means "not measured"
    assert summary["final"] == {"status": "ok", "final_loss": _f32(10.0 / 7 + 1e-3), "param_sha256": "ab" * 32}
    assert not [p for p in tmp_path.iterdir() if p.name != "summary.json"]  # no temp files, no tb/


def test_tensor_loss_is_stored_exactly(tmp_path):
    loss = torch.tensor(2.718281828, dtype=torch.float32)
    with MetricsLogger(tmp_path, enable_tensorboard=False, log_freq=1, total_steps=1) as m:
        m.log_step(1, {"loss": loss})
    stored = json.loads((tmp_path / "summary.json").read_text())["steps"][0]["loss"]
    assert torch.equal(torch.tensor(stored, dtype=torch.float32), loss)


def test_nan_loss_keeps_summary_strict_json(tmp_path):
    with MetricsLogger(tmp_path, enable_tensorboard=False, log_freq=1, total_steps=2) as m:
        m.log_step(1, {"loss": float("nan"), "grad_norm": float("inf")})
        m.set_final({"status": "nan"})

    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=reject)
    assert summary["steps"][0]["loss"] == "NaN" and summary["steps"][0]["grad_norm"] == "Infinity"
    assert summary["final"]["status"] == "nan"


def test_console_line_format():
    record = _record(5) | {"loss": 5.1234, "grad_norm": 1.23, "lr": 8e-4, "step_time_s": 0.95}
    line = format_step_line(5, 20, record, 0.95)
    assert line.startswith(
        "step  5/20  loss  5.1234  grad_norm   1.23  lr 8.0e-04  tok/s   4,321  counted 25.0%  mfu 12.5%"
    )
    assert "step  0.95s" in line
    assert "mem  2.00 GiB (est 0.50)" in line
    assert "traces 1 (0.6s)" in line
    assert line.endswith("[ 25% eta 0:00:14]")  # 15 steps left x 0.95 s
    # Consecutive lines align: same field starts at the same column.
    later = format_step_line(15, 20, _record(15) | {"loss": 12.5, "grad_norm": 1.0}, 0.95)
    assert line.index("grad_norm") == later.index("grad_norm")
    assert line.index("lr ") == later.index("lr ")
    assert format_step_line(20, 20, {"loss": 1.0}, 0.95) == "step 20/20  loss  1.0000  [100%]"
    estimated_only = format_step_line(1, 3, {"loss": 1.0, "estimated_peak_bytes": GIB})
    assert estimated_only == "step 1/3  loss  1.0000  mem est  1.00 GiB  [ 33%]"


def test_console_prints_every_log_freq_and_last_step(tmp_path, capsys):
    with MetricsLogger(tmp_path, enable_tensorboard=False, log_freq=5, total_steps=12) as m:
        # The first step includes tracing; the ETA must use the later, steady steps.
        for step in range(1, 13):
            m.log_step(step, {"loss": 1.0, "step_time_s": 30.0 if step == 1 else 1.0})
    lines = capsys.readouterr().out.splitlines()
    assert [re.match(r"step\s+(\d+)/12", ln).group(1) for ln in lines] == ["5", "10", "12"]
    assert lines[0].endswith("[ 42% eta 0:00:07]")
    assert lines[-1].endswith("[100%]")


def test_only_rank_zero_writes(tmp_path, capsys):
    folder = tmp_path / "run"
    with MetricsLogger(folder, enable_tensorboard=True, log_freq=1, total_steps=2, rank=1) as m:
        m.log_step(1, _record(1))
        m.log_step(2, _record(2))
        m.set_final({"status": "ok"})
    assert not folder.exists()
    assert capsys.readouterr().out == ""


def test_unknown_record_key_is_rejected(tmp_path):
    with MetricsLogger(tmp_path, enable_tensorboard=False, log_freq=1, total_steps=2) as m:
        with pytest.raises(KeyError, match="peak_bytes"):
            m.log_step(1, {"loss": 1.0, "peak_bytes": 3})


def test_resumed_run_continues_the_curve(tmp_path):
    with MetricsLogger(tmp_path, enable_tensorboard=True, log_freq=1, total_steps=6) as m:
        for step in range(1, 6):  # "crashed" after step 5; last checkpoint at step 3
            m.log_step(step, {"loss": float(step)})
    with MetricsLogger(tmp_path, enable_tensorboard=True, log_freq=1, total_steps=6) as m:
        for step in range(4, 7):
            m.log_step(step, {"loss": 10.0 * step})
    summary = json.loads((tmp_path / "summary.json").read_text())
    curve = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    assert [(s["step"], s["loss"]) for s in summary["steps"]] == curve
    loss = _scalars(tmp_path / "tb").Scalars("loss_metrics/global_avg_loss")
    assert [(e.step, e.value) for e in loss] == curve

    # A fresh run (from step 1) in the same folder replaces everything.
    with MetricsLogger(tmp_path, enable_tensorboard=False, log_freq=1, total_steps=1) as m:
        m.log_step(1, {"loss": 0.5})
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == [{"step": 1, "loss": 0.5}]


def test_zero_step_run_still_writes_summary(tmp_path):
    with MetricsLogger(tmp_path, enable_tensorboard=True, log_freq=1, total_steps=0) as m:
        m.set_final({"status": "ok", "steps_run": 0})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == [] and summary["final"]["status"] == "ok"
