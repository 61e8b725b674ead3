"""Metrics: the console line, TensorBoard scalars and `summary.json` for one run.

The trainer measures (loss, timings, memory from `graph_trainer.observability.memory`) and hands
one plain record per step to `MetricsLogger.log_step`; this module only formats
and stores. Only rank 0 writes anything.

Outputs under `dump_folder`:
- `tb/`: TensorBoard event files, one scalar per record key under the fixed tag
  names in `TB_TAGS` (dashboards rely on them), written every step.
- `summary.json`: every step's record, exact (floats are written with Python's
  shortest round-trip repr, so a float32 loss read back is bitwise the same),
  rewritten atomically at each logged step; each evaluation's record under `validation`.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import threading
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from graph_trainer.errors import ConfigError
from graph_trainer.observability.units import GIB
from graph_trainer.runtime.fsutil import WriteError, atomic_write_text, writing

SCHEMA_VERSION = 1
SUMMARY_FILE = "summary.json"
TB_SUBDIR = "tb"

# Record key -> TensorBoard tag. The tag names are a public contract.
TB_TAGS: Mapping[str, str] = MappingProxyType(
    {
        "loss": "loss_metrics/global_avg_loss",
        "grad_norm": "grad_norm",
        "lr": "lr",
        "tokens_per_s": "throughput(tps)",
        "counted_fraction": "data/counted_fraction",  # instruction data: the labels the loss counts, this rank's
        "tflops": "tflops",
        "mfu_pct": "mfu(%)",
        "peak_active_bytes": "memory/max_active(GiB)",
        "peak_reserved_bytes": "memory/max_reserved(GiB)",
        "num_alloc_retries": "memory/num_alloc_retries",
        "num_ooms": "memory/num_ooms",
        "estimated_peak_bytes": "memory/estimated_peak(GiB)",
        "saved_activation_bytes": "memory/saved_activations(GiB)",
        "estimate_error_pct": "memory/estimate_error(%)",
        "rss_peak_bytes": "memory/rss_peak(GiB)",
        "late_free_bytes": "memory/late_free(GiB)",
        "trace_count": "trace/count",
        "trace_time_s": "compile/trace_time_s",
        "inductor_time_s": "compile/inductor_time_s",
        "step_time_s": "time/step_s",
        # A mixture of experts' load in the last step (models.deepseek_v3.model.expert_load), worst MoE layer.
        "max_tokens_per_expert": "moe/max_tokens_per_expert",
        "mean_tokens_per_expert": "moe/mean_tokens_per_expert",
        "max_over_mean": "moe/max_over_mean_load",
        "dropped_tokens": "moe/dropped_tokens",  # expert parallelism's rows over capacity, summed over ranks
        # Pipeline parallelism: the share of the schedule's time a rank spent outside its stages' graphs (waiting
        # for its neighbours, sending), the largest over the ranks.
        "pp_bubble_pct": "pipeline/bubble(%)",
    }
)
RECORD_KEYS = frozenset(TB_TAGS)
# Validation record key -> TensorBoard tag (torchtitan's validation_metrics/ names), also a public contract.
# Keys not listed (e.g. `batch_losses`) go to summary.json only.
VALIDATION_TB_TAGS: Mapping[str, str] = MappingProxyType(
    {
        "loss": "validation_metrics/loss",
        "perplexity": "validation_metrics/perplexity",
        "peak_active_bytes": "validation_memory/max_active(GiB)",
        "estimated_peak_bytes": "validation_memory/estimated_peak(GiB)",
        "time_s": "validation_metrics/time_s",
    }
)

# JSON has no NaN/Infinity; strict parsers reject Python's extension, so
# non-finite floats are stored as these strings (`float(s)` reads them back).
_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _plain_number(key: str, value: Any) -> int | float:
    """A record value as a Python int/float; a 0-d tensor is read exactly with `.item()`."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metrics record '{key}' must be a number, got {type(value).__name__}")


def _jsonable(value: Any) -> Any:
    """Recursively make `value` strict-JSON-safe without rounding any float."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return _NON_FINITE[repr(value)]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_step_line(
    step: int, total_steps: int, record: Mapping[str, Any], mean_step_time_s: float | None = None
) -> str:
    """One compact console line for a step; fields absent from `record` are left out.

    Fields keep fixed widths so consecutive lines align; the trailing bracket shows
    progress and, given a mean step time, the estimated time left.
    """
    width = len(str(total_steps))
    parts = [f"step {step:>{width}}/{total_steps}"]
    if "loss" in record:
        parts.append(f"loss {float(record['loss']):7.4f}")
    if "grad_norm" in record:
        parts.append(f"grad_norm {float(record['grad_norm']):6.2f}")
    if "lr" in record:
        parts.append(f"lr {float(record['lr']):.1e}")
    if "tokens_per_s" in record:
        parts.append(f"tok/s {float(record['tokens_per_s']):>7,.0f}")
    if "counted_fraction" in record:
        parts.append(f"counted {100 * float(record['counted_fraction']):4.1f}%")
    if "mfu_pct" in record:
        parts.append(f"mfu {float(record['mfu_pct']):4.1f}%")
    if "step_time_s" in record:
        parts.append(f"step {float(record['step_time_s']):5.2f}s")
    active, estimated = record.get("peak_active_bytes"), record.get("estimated_peak_bytes")
    if active is not None:
        mem = f"mem {float(active) / GIB:5.2f} GiB"
        if estimated is not None:
            mem += f" (est {float(estimated) / GIB:.2f})"
        parts.append(mem)
    elif estimated is not None:
        parts.append(f"mem est {float(estimated) / GIB:5.2f} GiB")
    if "trace_count" in record:
        # Traces so far and the time they took: a count that grows means retracing.
        parts.append(f"traces {int(record['trace_count'])} ({float(record.get('trace_time_s', 0.0)):.1f}s)")
    progress = f"[{100.0 * step / max(total_steps, 1):3.0f}%"
    if mean_step_time_s is not None and step < total_steps:
        progress += f" eta {_format_duration(mean_step_time_s * (total_steps - step))}"
    parts.append(progress + "]")
    return "  ".join(parts)


def format_validation_line(step: int, record: Mapping[str, Any]) -> str:
    """One console line for an evaluation: loss, perplexity, memory (measured, estimated) and time."""
    parts = [f"validation after step {step}", f"loss {float(record['loss']):7.4f}"]
    parts.append(f"perplexity {float(record['perplexity']):9.3f}")
    active, estimated = record.get("peak_active_bytes"), record.get("estimated_peak_bytes")
    if active is not None:
        parts.append(
            f"mem {float(active) / GIB:5.2f} GiB" + (f" (est {float(estimated) / GIB:.2f})" if estimated else "")
        )
    elif estimated is not None:
        parts.append(f"mem est {float(estimated) / GIB:5.2f} GiB")
    if "time_s" in record:
        parts.append(f"{float(record['time_s']):.2f}s")
    return "  ".join(parts)


def _quiet_event_writer_thread() -> None:
    """TensorBoard's event-writer thread hands a failed write (a full disk) to the next call of the thread that
    logs, where the run reports it in one line; without this hook Python also prints the thread's traceback."""
    previous = threading.excepthook
    if getattr(previous, "quiets_event_writer", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            return
        previous(args)

    hook.quiets_event_writer = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class MetricsLogger:
    """Owns the console output, the TensorBoard writer and `summary.json` of one run.

    Steps already in an existing `summary.json` before the first step this run
    logs are kept (a resumed run continues the same curve); later ones are
    replaced. TensorBoard hides the replaced events the same way (`purge_step`).
    """

    def __init__(
        self,
        dump_folder: Path,
        *,
        enable_tensorboard: bool,
        log_freq: int,
        total_steps: int,
        rank: int = 0,
        config_toml: str | None = None,
    ) -> None:
        if log_freq < 1:
            raise ConfigError(f"metrics.log_freq must be >= 1, got {log_freq}; set it to a positive step count")
        if total_steps < 0:
            raise ConfigError(f"training.steps must be >= 0, got {total_steps}")
        self.dump_folder = Path(dump_folder)
        self.log_freq = log_freq
        self.total_steps = total_steps
        self.enabled = rank == 0
        self.enable_tensorboard = enable_tensorboard and self.enabled
        self._config_toml = config_toml
        self._steps: list[dict[str, Any]] = []
        self._validation: list[dict[str, Any]] = []
        self._final: dict[str, Any] = {}
        self._step_times: list[float] = []  # this run only, for the ETA
        self._started = False
        self._writer = None
        self._closed = False
        self._writer_cls = None
        if not self.enabled:
            return
        if self.enable_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ConfigError(
                    f"metrics.enable_tensorboard needs the tensorboard package ({e}); "
                    "pip install tensorboard or set metrics.enable_tensorboard = false"
                ) from None
            self._writer_cls = SummaryWriter
        self.dump_folder.mkdir(parents=True, exist_ok=True)
        self._steps = self._read_previous("steps")
        self._validation = self._read_previous("validation")

    @property
    def summary_path(self) -> Path:
        """Where `summary.json` is written."""
        return self.dump_folder / SUMMARY_FILE

    @property
    def tb_folder(self) -> Path:
        """Where the TensorBoard event files are written."""
        return self.dump_folder / TB_SUBDIR

    def _previous_summary(self) -> dict[str, Any]:
        """An existing summary.json of this schema, or {}."""
        try:
            previous = json.loads(self.summary_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        ok = isinstance(previous, dict) and previous.get("schema_version") == SCHEMA_VERSION
        return previous if ok else {}

    def _read_previous(self, key: str) -> list[dict[str, Any]]:
        """The records under `key` ("steps", "validation") of an existing summary.json of this schema."""
        records = self._previous_summary().get(key, [])
        return [s for s in records if isinstance(s, dict) and isinstance(s.get("step"), int)]

    def previous_final(self) -> dict[str, Any]:
        """The final record of an existing summary.json of this schema ({} when it has none)."""
        final = self._previous_summary().get("final")
        return final if isinstance(final, dict) else {}

    def logged_steps(self) -> list[dict[str, Any]]:
        """The step records this logger holds (those of an existing summary.json, then this run's)."""
        return list(self._steps)

    def _start(self, first_step: int) -> None:
        """On the first logged step: drop stale steps and open the writer, both from `first_step` on."""
        self._started = True
        self._steps = [s for s in self._steps if s["step"] < first_step]
        self._validation = [s for s in self._validation if s["step"] < first_step]
        if self._writer_cls is not None:
            # purge_step hides events >= first_step left by an earlier run in tb/.
            _quiet_event_writer_thread()
            with writing(self.tb_folder):
                self._writer = self._writer_cls(log_dir=str(self.tb_folder), purge_step=first_step)

    def log_step(self, step: int, record: Mapping[str, Any]) -> None:
        """Record one step: TensorBoard every step; console and summary.json every `log_freq` steps and on the last."""
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log_step called after close()")
        unknown = set(record) - RECORD_KEYS
        if unknown:
            raise KeyError(f"unknown metrics record keys {sorted(unknown)}; known: {sorted(RECORD_KEYS)}")
        if "loss" not in record:
            raise KeyError("metrics record must contain 'loss'")
        values = {k: _plain_number(k, v) for k, v in record.items() if v is not None}
        if not self._started:
            self._start(step)
        self._steps.append({"step": step, **values})
        if "step_time_s" in values:
            self._step_times.append(values["step_time_s"])
        if self._writer is not None:
            # Events are written by TensorBoard's thread; a failed write surfaces here or at the flush.
            with writing(self.tb_folder):
                for key, value in values.items():
                    scalar = value / GIB if key.endswith("_bytes") else value
                    self._writer.add_scalar(TB_TAGS[key], scalar, global_step=step)
        if step % self.log_freq == 0 or step >= self.total_steps:
            print(format_step_line(step, self.total_steps, values, self._mean_step_time()), flush=True)
            if self._writer is not None:
                with writing(self.tb_folder):
                    self._writer.flush()
            self._write_summary()

    def log_validation(self, step: int, record: Mapping[str, Any]) -> None:
        """Record one evaluation after training step `step`: console, TensorBoard and summary.json, at once."""
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log_validation called after close()")
        if not self._started:
            self._start(step)
        values = {k: _jsonable(v) for k, v in record.items() if v is not None}
        self._validation.append({"step": step, **values})
        if self._writer is not None:
            for key, tag in VALIDATION_TB_TAGS.items():
                if record.get(key) is not None:
                    value = _plain_number(key, record[key])
                    self._writer.add_scalar(tag, value / GIB if key.endswith("_bytes") else value, global_step=step)
            self._writer.flush()
        print(format_validation_line(step, values), flush=True)
        self._write_summary()

    def _mean_step_time(self) -> float | None:
        # The first step of a run includes tracing, so it would inflate the ETA.
        times = self._step_times[1:] or self._step_times
        return sum(times) / len(times) if times else None

    def set_final(self, final: Mapping[str, Any]) -> None:
        """Merge end-of-run facts (final loss, status, param hash, wall time, ...) into summary.json now."""
        if not self.enabled:
            return
        self._final.update(final)
        self._write_summary()

    def write_summary(self) -> None:
        """Write summary.json now with every step logged so far, whatever `log_freq` (before a checkpoint)."""
        if self.enabled:
            self._write_summary()

    def record_failure(self, final: Mapping[str, Any]) -> WriteError | None:
        """`set_final` for a run that stops because a write failed: returns the error if summary.json could not
        be written either (the disk is still full), instead of raising it over the first one."""
        try:
            self.set_final(final)
        except WriteError as e:
            return e
        return None

    def _write_summary(self) -> None:
        summary = {
            "schema_version": SCHEMA_VERSION,
            "config": self._config_toml,
            "steps": self._steps,
            "validation": self._validation,
            "final": self._final,
        }
        atomic_write_text(self.summary_path, json.dumps(_jsonable(summary), indent=1, allow_nan=False) + "\n")

    def close(self) -> None:
        """Write summary.json and flush/close TensorBoard; safe to call twice."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        try:
            self._write_summary()
        finally:
            if self._writer is not None:
                writer, self._writer = self._writer, None
                with writing(self.tb_folder):
                    writer.close()  # flushes first

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        # The run is already failing (and said so in summary.json): a second failed write must not hide the first.
        with contextlib.suppress(WriteError):
            self.close()
