"""Validation: the loss on held-out batches every `validation.freq` steps, through the job's evaluation step.

Each evaluation reads the same `validation.steps` batches on every data-parallel rank (the held-out loader is
rewound first), runs the evaluation step (`Job.build_eval_step`: forward and loss, no gradients, traced as its
own graph unless `compile.mode eager`), averages the batches' losses (equal token counts, so the mean of the
means is the mean over tokens) and then over the data-parallel ranks. Perplexity is exp(loss).

Memory is reported as for the training step. Measured: the peak of live tensors on CPU (every tensor alive
during the evaluation counted: the weights, the batch, and what stays alive between training steps, the
gradients and the optimizer state), the allocator's active peak on CUDA. Estimated: the evaluation graph's
static peak (weights, batch and its own tensors) plus those resident bytes, so on CPU the two agree to the byte.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import torch

from graph_trainer.data.packing import PackedLoader
from graph_trainer.distributed.mesh import Mesh
from graph_trainer.observability.memory import MemoryMonitor, allocated_bytes
from graph_trainer.step import EvalStep


def perplexity(loss: float) -> float:
    """exp(loss); inf where that overflows a float."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def storage_bytes(tensors: Iterable[torch.Tensor], device_type: str) -> int:
    """Bytes of the distinct storages of `tensors`, as the device's allocator counts them."""
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(allocated_bytes(n, device_type) for n in sizes.values())


class Validator:
    """Runs the evaluations of one job (see the module docstring); `run()` returns one validation record."""

    def __init__(
        self,
        loader: PackedLoader,
        step: EvalStep,
        mesh: Mesh,
        memory: MemoryMonitor,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        steps: int,
        freq: int,
    ) -> None:
        self.loader, self.step, self.mesh, self.memory = loader, step, mesh, memory
        self.model, self.optimizer, self.steps, self.freq = model, optimizer, steps, freq
        self.records: list[dict[str, Any]] = []  # every evaluation's record, in order

    def due(self, step: int, total_steps: int) -> bool:
        """Whether training step `step` is followed by an evaluation: every `freq` steps, and after the last."""
        return step % self.freq == 0 or step == total_steps

    def _weights(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def _resident(self) -> list[torch.Tensor]:
        """Tensors a training step leaves alive that the evaluation does not read: gradients, optimizer state."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [*grads, *state]

    def run(self) -> dict[str, Any]:
        """Evaluate `steps` held-out batches: the record of loss, perplexity, memory and time."""
        device = self.mesh.device
        self.loader.rewind()
        resident = self._resident()
        losses, peaks = [], []
        start = time.perf_counter()
        for _ in range(self.steps):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(self.loader).items()}
            with self.memory.measure_step([*self._weights(), *batch.values(), *resident]) as mem:
                losses.append(self.step(batch))
            peaks.append(mem.peak_active_bytes)
        # Equal-sized batches on every rank: the mean of the means is the mean over every token.
        loss = self.mesh.global_average(torch.stack(losses).mean()).item()
        record: dict[str, Any] = {
            "loss": loss,
            "perplexity": perplexity(loss),
            "time_s": time.perf_counter() - start,
            "batch_losses": [x.item() for x in losses],
        }
        if None not in peaks:
            record["peak_active_bytes"] = max(peaks)
        report = self.step.report()
        if report.estimated_peak_bytes is not None:
            record["estimated_peak_bytes"] = report.estimated_peak_bytes + storage_bytes(resident, device.type)
        if report.trace_count is not None:
            record["trace_count"] = report.trace_count
        self.records.append(record)
        return record


__all__ = ["Validator", "perplexity", "storage_bytes"]
