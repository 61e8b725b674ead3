"""Peak memory of a training step, measured at run time.

Three sources, one front (`MemoryMonitor`):
- CUDA: the caching allocator's own counters (`cuda_memory_stats`); nothing here
  touches CUDA unless the device is a CUDA device and CUDA is available.
- CPU: `LiveTensorTracker`, a dispatch mode that counts live tensor storage bytes
  exactly (CPU has no allocator statistics). Its figure is what
  `graph_trainer.tracer.memory_estimate` predicts statically, to the byte.
- Any device: the process RSS high-water mark (`rss_peak_bytes`).
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_iter

from graph_trainer.observability.units import KIB

# ---------------------------------------------------------------------------
# What the CUDA caching allocator counts (used by the static estimate; pure functions, no CUDA needed)

CUDA_BLOCK_BYTES = 512  # c10's kMinBlockSize: every allocation is rounded up to a multiple of it
CUBLAS_WORKSPACE_SM90_BYTES = 4096 * 8 * KIB  # torch's default on Hopper (":4096:8")
CUBLAS_WORKSPACE_DEFAULT_BYTES = 4096 * 2 * KIB + 16 * 8 * KIB  # elsewhere (":4096:2:16:8")


def allocated_bytes(nbytes: int, device_type: str) -> int:
    """Bytes one allocation of `nbytes` occupies in the device's allocator.

    CUDA's caching allocator rounds each request up to a multiple of 512 bytes
    (its active-memory counters count the rounded size; a 0-byte tensor takes no
    block). Large requests come from 2 MiB-rounded segments, but the block
    handed out is still the 512-rounded request unless the free remainder is
    under 1 MiB, which depends on the allocation history and is not modelled.
    CPU (and meta/fake) sizes are counted as requested.
    """
    if device_type != "cuda" or nbytes == 0:
        return nbytes
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def cublas_workspace_bytes(config: str | None, compute_capability: tuple[int, int] | None) -> int:
    """The cuBLAS workspace torch allocates (through the caching allocator) for a stream's first matmul.

    `config` is CUBLAS_WORKSPACE_CONFIG (":SIZE_KiB:COUNT" pairs, e.g. ":4096:8" =
    32 MiB; set without a pair it means 0, as in torch). Unset, torch uses 32 MiB on
    sm90 (H100/H200) and 8.125 MiB elsewhere. Unknown capability (planning without a GPU) is taken as
    sm90, the GPUs this
    project's big configs target. It stays allocated for the process's life, so
    it counts in every step's active peak.
    """
    if config is not None:  # parsed as torch does: every ":SIZE:COUNT" match, nothing else
        return sum(int(size) * KIB * int(count) for size, count in re.findall(r":([0-9]+):([0-9]+)", config))
    if compute_capability is None or compute_capability == (9, 0):
        return CUBLAS_WORKSPACE_SM90_BYTES
    return CUBLAS_WORKSPACE_DEFAULT_BYTES


def process_cublas_workspace_bytes(device: torch.device) -> int:
    """`cublas_workspace_bytes` for this process's environment and `device` (sm90 assumed without CUDA)."""
    capability = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
    return cublas_workspace_bytes(os.environ.get("CUBLAS_WORKSPACE_CONFIG"), capability)


def _storage_of(t: torch.Tensor, count_fake: bool = False) -> torch.UntypedStorage | None:
    """The tensor's storage if it holds real memory (not meta, fake, sparse or a wrapper subclass).

    With `count_fake`, a fake tensor's storage counts as the memory it stands for.
    """
    if t.device.type == "meta" or t.layout != torch.strided:
        return None
    if (isinstance(t, FakeTensor) and not count_fake) or is_traceable_wrapper_subclass(t):
        # Fake tensors hold no memory; wrappers (DTensor) hold it in their inner tensors.
        return None
    return t.untyped_storage()


def _real_alias(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The fake argument a functional collective returns when it runs for real (`wait_tensor` its input, an `_out`
    collective its `out=` tensor), where its fake kernel returns a new tensor; None for any other op."""
    if getattr(func, "namespace", None) != "_c10d_functional":
        return None
    if func is torch.ops._c10d_functional.wait_tensor.default:
        alias = args[0]
    else:
        schema = func._schema.arguments
        written = [i for i, a in enumerate(schema) if a.alias_info is not None and a.alias_info.is_write]
        if len(written) != 1:
            return None
        i = written[0]  # the written argument, passed by keyword (`out=`) or by position
        alias = kwargs[schema[i].name] if schema[i].name in kwargs else (args[i] if i < len(args) else None)
    return alias if isinstance(alias, FakeTensor) else None


class LiveTensorTracker(TorchDispatchMode):
    """Exact peak of live tensor storage bytes while the mode is active.

    Each untyped storage counts once (views share it): it is added the first time
    it is an op's output and subtracted when the storage itself is freed (a
    `weakref.finalize` on the `UntypedStorage`, whose Python object torch keeps
    alive exactly as long as the C++ storage). Storages that existed before the
    step (parameters, optimizer state, the batch) must be registered with
    `track_existing`, otherwise they are not counted: an op that writes into or
    views an unregistered tensor adds nothing.

    It sees every op that reaches the dispatcher from this thread, including the
    autograd backward (on CPU the engine runs on the calling thread and carries
    the mode along). It does not see scratch memory allocated inside one kernel.

    A storage whose last reference another thread drops (gloo's worker lets go
    of a collective's buffer after the step's thread has moved on) is freed late:
    it counts as live until then, as the memory really is held, and its bytes are
    added to `late_free_bytes`. The static estimate frees it at its last use, so
    a step's measured peak can exceed the estimate by at most that much.

    With `count_fake=True` it counts fake tensors as the memory they stand for:
    an eager step run on fake tensors then gets the peak the real step would have,
    without allocating it (`graph_trainer.plan.planner.eager_step_peak`).

    Usage:
        tracker = LiveTensorTracker()
        tracker.track_existing(params + buffers + batch)
        with tracker:
            step()
        tracker.peak_bytes
    """

    def __init__(self, count_fake: bool = False) -> None:
        super().__init__()
        self.count_fake = count_fake
        self._thread = threading.get_ident()  # the step's thread; frees on others are late
        self.late_free_bytes = 0
        # storage key (address of the StorageImpl) -> (nbytes, finalizer, birth: the count of storages seen by then)
        self._live: dict[int, tuple[int, weakref.finalize, int]] = {}
        self._births = 0
        self._peak_birth = 0  # the birth count when the peak was reached
        self.current_bytes = 0
        self.peak_bytes = 0

    def track_existing(self, tensors: Iterable[Any]) -> None:
        """Count the storages of `tensors` (any pytree of them) as live from now until they are freed."""
        for t in tree_iter(tensors):
            if isinstance(t, torch.Tensor):
                s = _storage_of(t, self.count_fake)
                if s is not None:
                    self._add(s)

    def reset(self) -> None:
        """Restart the peak from the bytes live now (storages stay tracked)."""
        self.peak_bytes = self.current_bytes
        self._peak_birth = self._births

    def bytes_at_peak(self, tensors: Iterable[Any]) -> int:
        """Bytes of `tensors` (alive now) that were already alive at the peak, each storage once.

        A storage alive now and born before the peak was alive at the peak; e.g. the
        gradients a step returns, of which only some exist at a mid-backward peak.
        """
        keys = {
            s._cdata
            for t in tree_iter(tensors)
            if isinstance(t, torch.Tensor)
            for s in [_storage_of(t, self.count_fake)]
            if s is not None
        }
        return sum(
            nbytes
            for key in keys
            if key in self._live
            for nbytes, _, birth in [self._live[key]]
            if birth <= self._peak_birth
        )

    def forget(self) -> None:
        """Stop tracking every storage; current and peak go to 0."""
        for _, fin, _ in self._live.values():
            fin.detach()
        self._live.clear()
        self.current_bytes = 0
        self.peak_bytes = 0

    def _size(self, s: torch.UntypedStorage) -> int:
        """Bytes `s` counts for: its own (a subclass may count what a device's allocator makes of it)."""
        return s.nbytes()

    def _add(self, s: torch.UntypedStorage) -> None:
        key = s._cdata
        nbytes = self._size(s)
        entry = self._live.get(key)
        if entry is not None:
            if entry[0] != nbytes:  # resized in place (resize_)
                self.current_bytes += nbytes - entry[0]
                self._live[key] = (nbytes, *entry[1:])
                self._update_peak()
            return
        fin = weakref.finalize(s, self._free, key)
        fin.atexit = False
        self._births += 1
        self._live[key] = (nbytes, fin, self._births)
        self.current_bytes += nbytes
        self._update_peak()

    def _update_peak(self) -> None:
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._peak_birth = self._births

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current_bytes -= entry[0]
            if threading.get_ident() != self._thread:
                self.late_free_bytes += entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.count_fake and (alias := _real_alias(func, args, kwargs or {})) is not None:
            # A collective's fake kernel returns a new tensor where the real op returns its `out=` tensor or its
            # input: the plan's run goes on with that one, holding what the real run holds (nothing new).
            return alias
        input_keys: set[int] | None = None
        for t in tree_iter(out):
            if not isinstance(t, torch.Tensor):
                continue
            s = _storage_of(t, self.count_fake)
            if s is None:
                continue
            if s._cdata not in self._live:
                # An untracked storage that is also an input was not allocated by
                # this op (an in-place op or a view of an unregistered tensor).
                if input_keys is None:
                    input_keys = {
                        a.untyped_storage()._cdata
                        for a in tree_iter((args, kwargs))
                        if isinstance(a, torch.Tensor) and _storage_of(a, self.count_fake) is not None
                    }
                if s._cdata in input_keys:
                    continue
            self._add(s)
        return out


class OpRecorder(LiveTensorTracker):
    """A `LiveTensorTracker` that also records, after every op, the op and the live bytes then (`ops`).

    The measured side of the memory timeline (`graph_trainer.observability.memory_timeline`): a traced graph
    run op by op dispatches its call_function nodes in graph order, one op each.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.ops.append((func, self.current_bytes))
        return out


ALLOC, FREE = "alloc", "free"
MemoryEvent = tuple[str, Any, int]  # (ALLOC, key, nbytes) or (FREE, key, 0), in the order they happen


class AllocationRecorder(LiveTensorTracker):
    """A `LiveTensorTracker` that also records the order of its storages' births and deaths (`events`).

    Each storage it counts adds (ALLOC, key, nbytes) when first seen (`track_existing` included) and
    (FREE, key, 0) when freed; a storage resized in place adds a FREE then an ALLOC of its new size under the
    same key, as a device allocator reallocates it. Keys are storage addresses, so one may come back after its
    FREE. What it reports otherwise is the tracker's, unchanged. The sequence is what a caching allocator
    would be asked for (`graph_trainer.plan.caching_allocator.replay`).
    """

    def __init__(self, count_fake: bool = False) -> None:
        super().__init__(count_fake)
        self.events: list[MemoryEvent] = []

    def _add(self, s: torch.UntypedStorage) -> None:
        key = s._cdata
        before = self._live.get(key)
        super()._add(s)
        nbytes = self._live[key][0]
        if before is None:
            self.events.append((ALLOC, key, nbytes))
        elif before[0] != nbytes:
            self.events += [(FREE, key, 0), (ALLOC, key, nbytes)]

    def _free(self, key: int) -> None:
        if key in self._live:
            self.events.append((FREE, key, 0))
        super()._free(key)


# ---------------------------------------------------------------------------
# CUDA allocator statistics (no CUDA call unless the device is CUDA and CUDA exists)


def _is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()


def cuda_memory_stats(device: torch.device | str) -> dict[str, int]:
    """Peak allocator figures since the last `reset_peak(device)`; {} unless `device` is an available CUDA device.

    Keys: peak_active_bytes (`active_bytes.all.peak`), peak_allocated_bytes
    (`max_memory_allocated`), peak_reserved_bytes (`max_memory_reserved`),
    num_alloc_retries, num_ooms (both cumulative since process start).
    """
    if not _is_cuda(device):
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "peak_active_bytes": int(stats.get("active_bytes.all.peak", 0)),
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
    }


def reset_peak(device: torch.device | str) -> None:
    """Reset the CUDA allocator's peak counters for `device`; a no-op off CUDA."""
    if _is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def rss_peak_bytes() -> int:
    """The process's resident-set high-water mark since start, in bytes (it never goes down)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * KIB  # Linux reports KiB


# ---------------------------------------------------------------------------
# Front used by the trainer


@dataclass
class StepMemory:
    """Memory figures of one step, in bytes; None where this device/mode cannot measure them."""

    peak_active_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    rss_peak_bytes: int | None = None
    # CPU tracker: bytes another thread freed after the step let go (LiveTensorTracker); None when 0.
    late_free_bytes: int | None = None

    def as_record(self) -> dict[str, int]:
        """The figures that were measured, keyed as in `graph_trainer.observability.metrics.TB_TAGS`."""
        return {k: v for k, v in vars(self).items() if v is not None}


class MemoryMonitor:
    """Measures each step's peak memory on `device`.

    CUDA: allocator peaks (reset at each step's start). CPU with `track=True`:
    exact live-tensor bytes from `LiveTensorTracker` (active = reserved; it slows
    the step down, see docs/passes_and_memory.md); with `track=False` only RSS is reported.
    """

    def __init__(self, device: torch.device | str, track: bool = True) -> None:
        self.device = torch.device(device)
        self.track = track
        self.last: StepMemory | None = None
        self.last_ops: list[tuple[Any, int]] | None = None  # (op, live bytes after it) of a recorded step

    @contextlib.contextmanager
    def measure_step(self, existing: Iterable[Any] = (), *, record_ops: bool = False) -> Iterator[StepMemory]:
        """Context manager around one step; yields a `StepMemory` filled in on exit (also kept as `.last`).

        `existing`: tensors alive before the step (parameters, buffers, optimizer
        state, batch) that count toward the CPU peak; ignored on CUDA, where the
        allocator already knows them. `record_ops` (CPU): track this step even without
        `track`, and keep the live bytes after each op in `last_ops`.
        """
        result = StepMemory()
        self.last_ops = None
        if self.device.type == "cuda":
            reset_peak(self.device)
            yield result
            stats = cuda_memory_stats(self.device)
            result.peak_active_bytes = stats.get("peak_active_bytes")
            result.peak_reserved_bytes = stats.get("peak_reserved_bytes")
            result.num_alloc_retries = stats.get("num_alloc_retries")
            result.num_ooms = stats.get("num_ooms")
        elif self.track or record_ops:
            tracker = OpRecorder() if record_ops else LiveTensorTracker()
            tracker.track_existing(existing)
            try:
                with tracker:
                    yield result
                result.peak_active_bytes = result.peak_reserved_bytes = tracker.peak_bytes
                result.late_free_bytes = tracker.late_free_bytes or None
                self.last_ops = tracker.ops if record_ops else None
            finally:
                tracker.forget()  # drop finalizers so no callback outlives the step
        else:
            yield result
        result.rss_peak_bytes = rss_peak_bytes()
        self.last = result
