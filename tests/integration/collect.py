"""Read a finished run back from its dump folder: TensorBoard scalars and summary.json.

TensorBoard is the source for everything a dashboard shows (loss curve, peak
memory, throughput, trace time): reading it back checks that the trainer logs
what it claims. summary.json is the source for exact comparisons: it stores each
float with its shortest round-trip repr, while TensorBoard stores float32.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Tag names are the trainer's public contract (graph_trainer.observability.metrics.TB_TAGS);
# they are spelled out here so that a renamed tag fails this suite.
TAG_LOSS = "loss_metrics/global_avg_loss"
TAG_ACTIVE = "memory/max_active(GiB)"
TAG_RESERVED = "memory/max_reserved(GiB)"
TAG_ESTIMATED = "memory/estimated_peak(GiB)"
TAG_TPS = "throughput(tps)"
TAG_TRACE_TIME = "compile/trace_time_s"
TAG_TRACE_COUNT = "trace/count"


def read_tensorboard(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag under `tb_dir` as [(step, value)] sorted by step; {} when there are no events.

    Several event files (a resumed run) are read in order; steps a later run
    rewrote (TensorBoard `purge_step`) keep only the latest value.
    """
    tb_dir = Path(tb_dir)
    if not tb_dir.is_dir() or not any(tb_dir.glob("events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0 = keep every event
    acc.Reload()
    out = {}
    for tag in acc.Tags().get("scalars", []):
        by_step = {e.step: float(e.value) for e in acc.Scalars(tag)}
        out[tag] = sorted(by_step.items())
    return out


def _number(value: Any) -> Any:
    """summary.json writes non-finite floats as the strings NaN / Infinity / -Infinity."""
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
        return float(value)
    return value


def read_summary(dump_folder: Path) -> dict[str, Any] | None:
    """The run's summary.json with non-finite floats restored, or None when absent or unreadable."""
    try:
        data = json.loads((Path(dump_folder) / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    data["steps"] = [{k: _number(v) for k, v in s.items()} for s in data.get("steps", []) if isinstance(s, dict)]
    data["final"] = {k: _number(v) for k, v in (data.get("final") or {}).items()}
    return data


def _values(scalars: dict[str, list[tuple[int, float]]], tag: str) -> list[float]:
    return [v for _, v in scalars.get(tag, [])]


def _max(values: list[float]) -> float | None:
    return max(values) if values else None


def _last(values: list[float]) -> float | None:
    return values[-1] if values else None


@dataclass
class RunMetrics:
    """What one test's run left behind, reduced to the figures the checks and the table use.

    `*_gib`, `tokens_per_s`, `trace_*` and `tb_losses` come from TensorBoard;
    `losses`, `*_bytes` and the digests come from summary.json (exact).
    """

    tb_steps: list[int] = field(default_factory=list)
    tb_losses: list[float] = field(default_factory=list)
    peak_active_gib: float | None = None
    peak_reserved_gib: float | None = None
    estimated_peak_gib: float | None = None
    tokens_per_s: float | None = None
    trace_time_s: float | None = None
    trace_count: int | None = None
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peak_active_bytes: int | None = None
    estimated_peak_bytes: int | None = None
    params_sha256: str | None = None
    grads_sha256: str | None = None
    status: str | None = None
    has_tensorboard: bool = False
    has_summary: bool = False

    @property
    def final_loss(self) -> float | None:
        """The last logged loss (exact when summary.json has it)."""
        return _last(self.losses) if self.losses else _last(self.tb_losses)

    def as_json(self) -> dict[str, Any]:
        """JSON-safe dict (non-finite floats as strings, like summary.json)."""

        def safe(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return repr(v)
            if isinstance(v, list):
                return [safe(x) for x in v]
            return v

        out = {k: safe(v) for k, v in self.__dict__.items()}
        out["final_loss"] = safe(self.final_loss)
        return out


def collect_run(dump_folder: Path) -> RunMetrics:
    """Read `dump_folder/tb` and `dump_folder/summary.json` into a `RunMetrics`."""
    dump_folder = Path(dump_folder)
    tb = read_tensorboard(dump_folder / "tb")
    summary = read_summary(dump_folder)
    m = RunMetrics(has_tensorboard=bool(tb), has_summary=summary is not None)
    m.tb_steps = [s for s, _ in tb.get(TAG_LOSS, [])]
    m.tb_losses = _values(tb, TAG_LOSS)
    m.peak_active_gib = _max(_values(tb, TAG_ACTIVE))
    m.peak_reserved_gib = _max(_values(tb, TAG_RESERVED))
    m.estimated_peak_gib = _max(_values(tb, TAG_ESTIMATED))
    tps = _values(tb, TAG_TPS)
    # The first step of a run includes tracing and warm-up; it is not throughput.
    steady = tps[1:] or tps
    m.tokens_per_s = sum(steady) / len(steady) if steady else None
    m.trace_time_s = _last(_values(tb, TAG_TRACE_TIME))
    count = _last(_values(tb, TAG_TRACE_COUNT))
    m.trace_count = int(count) if count is not None else None
    if summary is not None:
        steps = summary["steps"]
        m.steps = [s["step"] for s in steps if "loss" in s]
        m.losses = [float(s["loss"]) for s in steps if "loss" in s]
        m.peak_active_bytes = _max([s["peak_active_bytes"] for s in steps if "peak_active_bytes" in s])
        m.estimated_peak_bytes = _max([s["estimated_peak_bytes"] for s in steps if "estimated_peak_bytes" in s])
        final = summary["final"]
        m.params_sha256 = final.get("params_sha256")
        m.grads_sha256 = final.get("grads_sha256")
        m.status = final.get("status")
    return m
