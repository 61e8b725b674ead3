"""Profiling a run: torch.profiler Chrome traces and memory snapshots, every `profile_freq` steps.

Options (the `[profiling]` section, torchtitan's names):
- `enable_profiling`: step N (every N that `profile_freq` divides) runs under `torch.profiler` (CPU, and
  CUDA on a GPU), after one warm-up step when `profile_freq` > 1, and its Chrome trace is written to
  `{dump_folder}/{save_traces_folder}/iteration_{N}/rank{r}_trace.json` (open it in Perfetto or
  chrome://tracing).
- `enable_memory_snapshot`: on CUDA, the allocator records its history from the start
  (`torch.cuda.memory._record_memory_history`), and at step N a snapshot is dumped to
  `{dump_folder}/{save_memory_snapshot_folder}/iteration_{N}/rank{r}_memory_snapshot.pickle` (drag it
  onto https://pytorch.org/memory_viz). On CPU, which keeps no allocator history, step N's memory
  timeline is written there instead (`graph_trainer.observability.memory_timeline`).

Every file is written atomically; a failed write raises `WriteError` like the run's other writes.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch

from graph_trainer.observability.log import get_logger
from graph_trainer.runtime.fsutil import atomic_write, writing

logger = get_logger(__name__)

# Allocation events the CUDA allocator keeps (torchtitan keeps as many): a few steps of a large model.
_SNAPSHOT_MAX_ENTRIES = 100_000


class StepProfiler:
    """Owns the profiler and the memory history of one rank; the trainer calls `before_step` and `after_step`
    around every step (numbered from 1) and `close` at the end."""

    def __init__(
        self,
        dump_folder: Path,
        *,
        enable_profiling: bool,
        traces_folder: str,
        profile_freq: int,
        enable_memory_snapshot: bool,
        snapshot_folder: str,
        rank: int,
        device: torch.device,
    ) -> None:
        self.traces = Path(dump_folder) / traces_folder
        self.snapshots = Path(dump_folder) / snapshot_folder
        self.enable_profiling, self.enable_memory_snapshot = enable_profiling, enable_memory_snapshot
        self.freq, self.rank, self.device = profile_freq, rank, device
        self._profiler: torch.profiler.profile | None = None
        self._cuda_history = enable_memory_snapshot and device.type == "cuda"
        if self._cuda_history:
            torch.cuda.memory._record_memory_history(max_entries=_SNAPSHOT_MAX_ENTRIES)

    @property
    def folders(self) -> list[Path]:
        """Where this profiler writes (for the run's manifest)."""
        return [self.traces, self.snapshots]

    def _profiled(self, step: int) -> bool:
        return step % self.freq == 0

    def wants_timeline(self, step: int) -> bool:
        """Whether `step` should be measured op by op for the CPU memory timeline (`write_timeline`)."""
        return self.enable_memory_snapshot and not self._cuda_history and self._profiled(step)

    def before_step(self, step: int) -> None:
        """Start the profiler one step before a profiled step (its warm-up), or at it when every step is; at the
        profiled step, start recording. The trace then holds that step and nothing else."""
        if not self.enable_profiling:
            return
        if self._profiler is not None:
            self._profiler.step()  # the warm-up step is over: record this one
            return
        warmup = 1 if self.freq > 1 else 0
        if not self._profiled(step + warmup):
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with warnings.catch_warnings():  # "won't be using warmup": wanted when every step is profiled
            warnings.simplefilter("ignore")
            schedule = torch.profiler.schedule(wait=0, warmup=warmup, active=1, repeat=1)
        self._profiler = torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=True)
        self._profiler.start()

    def after_step(self, step: int) -> None:
        """At a profiled step: stop recording and write its trace (and the CUDA snapshot)."""
        if self._profiler is not None and self._profiled(step):
            profiler, self._profiler = self._profiler, None
            profiler.step()
            profiler.stop()
            self._write_trace(profiler, step)
        if self._cuda_history and self._profiled(step):
            path = self._iteration(self.snapshots, step) / f"rank{self.rank}_memory_snapshot.pickle"
            atomic_write(path, lambda f: f.write(_cuda_snapshot_bytes()))
            logger.info(f"memory snapshot of step {step}: {path}")

    def _iteration(self, folder: Path, step: int) -> Path:
        path = folder / f"iteration_{step}"
        with writing(path):
            path.mkdir(parents=True, exist_ok=True)
        return path

    def _write_trace(self, profiler: torch.profiler.profile, step: int) -> None:
        path = self._iteration(self.traces, step) / f"rank{self.rank}_trace.json"
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            with writing(path):
                profiler.export_chrome_trace(str(tmp))
                tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        logger.info(f"profiler trace of step {step}: {path}")

    def timeline_folder(self, step: int) -> Path:
        """Where the CPU memory timeline of `step` goes."""
        return self._iteration(self.snapshots, step)

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the profiler (a run that ended between warm-up and trace writes nothing) and the history."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self._cuda_history:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._cuda_history = False


def _cuda_snapshot_bytes() -> bytes:
    """The allocator's snapshot (its history included), pickled as `torch.cuda.memory._dump_snapshot` does."""
    return pickle.dumps(torch.cuda.memory._snapshot())


__all__ = ["StepProfiler"]
