"""What a trace baked in, and the per-step check that it still holds.

`make_fx` runs the model's Python once: every Python value the forward reads is frozen into the graph.
A float attribute (a temperature, a scale), an int, a string, a module's `training` flag, which
parameters require grad, the default dtype or autocast: change one between steps and the graph keeps
computing with the value it saw. A `TraceGuard` records those values while the step is traced and
compares them with the live ones before every step, as the batch signature is compared; a difference is
a reason to retrace (or, with `compile.on_shape_change = "error"`, to stop), and the reason names it.

What is recorded, and why:
- Module attributes the traced code actually READ, found by a `__getattribute__` hook installed on the
  model's module classes for the duration of the trace (and removed after it): only what the code read
  can have shaped the graph, and checking only that keeps the per-step check a few tuple compares.
  Values of bool/int/float/str/None, torch.dtype/device, enums, and tuples/lists/dicts of those are
  guarded; other objects (a config object, a tensor, a function) are references, not values, and
  nn.Module's own bookkeeping (hooks dicts, `_parameters`, ...) is not the model's state.
- The names of the trainable parameters (`requires_grad=True`): the graph returns one gradient for each.
- Each parameter's and buffer's name, dtype and shape (`tensor_meta`): the graph's inputs were traced with
  them. `model.double()` keeps the tensors and swaps their data; a state dict loaded with `assign=True`
  replaces them (the step then reads the new ones, `GraphStep` rebinds: docs/tracer_api.md).
- Global state a trace specializes on (`global_state`).

Not guarded: a value read from some other object (`self.config.eps` reads `eps` from a config, not from
a module), a closure or a global variable of the user's code. Those stay the user's to keep fixed
(docs/tracer_api.md says so).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

# A value of one of these types is copied into the graph when traced code reads it.
VALUE_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device, enum.Enum)
# nn.Module's own attributes (hook dicts, parameter and buffer tables, class-level flags): not the model's state.
# `training` is the exception: forward code branches on it (dropout, batch norm).
_BOOKKEEPING = (frozenset(vars(nn.Module())) | frozenset(dir(nn.Module))) - {"training"}
# How many changed attributes a reason names before "and N more" (train()/eval() flips every module).
_NAMED = 3
TensorMeta = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]


def _is_value(value: Any) -> bool:
    """Whether `value` is baked into a graph by value: a Python scalar or string, or a container of them."""
    if isinstance(value, VALUE_TYPES):
        return True
    if isinstance(value, (tuple, list)):
        return all(_is_value(v) for v in value)
    if isinstance(value, dict):
        return all(_is_value(k) and _is_value(v) for k, v in value.items())
    return False


def global_state(device_type: str) -> tuple[tuple[str, Any], ...]:
    """The process-wide settings a trace of a step on `device_type` specializes on, as (name, value) pairs.

    - default dtype: factory calls without a dtype (`torch.ones(n)`, `torch.tensor(0.5)`) are traced with it;
    - autocast (on the CPU and on `device_type`): make_fx records the casts autocast inserts;
    - deterministic algorithms: the trace warns (or not) about thread-order accumulation by it, and composite
      ops may choose their decomposition by it;
    - the SDPA backends allowed: `scaled_dot_product_attention` picks its kernel (flash, math, ...) when traced;
    - float32 matmul precision: a compiled graph (Inductor) bakes it into its kernels.

    Grad mode is not here: the step is traced with autograd on (it cannot trace without) and the graph runs
    under no_grad whatever the caller's mode, so the caller's mode changes nothing.
    """
    backends = torch.backends.cuda
    state = [
        ("torch.get_default_dtype()", torch.get_default_dtype()),
        ("torch.are_deterministic_algorithms_enabled()", torch.are_deterministic_algorithms_enabled()),
        (
            "torch.is_deterministic_algorithms_warn_only_enabled()",
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision()),
        ("torch.backends.cuda.flash_sdp_enabled()", backends.flash_sdp_enabled()),
        ("torch.backends.cuda.mem_efficient_sdp_enabled()", backends.mem_efficient_sdp_enabled()),
        ("torch.backends.cuda.math_sdp_enabled()", backends.math_sdp_enabled()),
        ("torch.backends.cuda.cudnn_sdp_enabled()", backends.cudnn_sdp_enabled()),
    ]
    for device in dict.fromkeys(("cpu", device_type)):
        state.append((f"autocast({device!r}) enabled", torch.is_autocast_enabled(device)))
        state.append((f"autocast({device!r}) dtype", torch.get_autocast_dtype(device)))
    return tuple(state)


class ModuleReads:
    """The value attributes traced code reads from a model's modules: (module, name) -> (its FQN, the value).

    The first read of each counts: a later write by the traced code itself does not hide what the graph baked.
    """

    def __init__(self, model: nn.Module, ignore: frozenset[str] = frozenset()):
        self.fqns = {id(m): fqn for fqn, m in model.named_modules()}
        self.values: dict[tuple[int, str], tuple[nn.Module, str, Any]] = {}
        self.ignored = _BOOKKEEPING | ignore

    def record(self, module: nn.Module, name: str, value: Any) -> None:
        key = (id(module), name)
        if key not in self.values and id(module) in self.fqns and name not in self.ignored and _is_value(value):
            self.values[key] = (module, name, copy.deepcopy(value))  # a list read now may be mutated later


@contextlib.contextmanager
def recording_reads(model: nn.Module, ignore: frozenset[str] = frozenset()) -> Iterator[ModuleReads]:
    """Record the value attributes read from `model`'s modules while the block runs (see `ModuleReads`), but
    those named in `ignore` (attributes the caller pins itself while the graph runs).

    A `__getattribute__` is set on each module class of the model for the duration and then removed (or the
    class's own put back); it passes every lookup through unchanged. Lookups nn.Module answers itself
    (parameters, buffers, submodules, through `__getattr__`) are not seen: those are graph inputs.
    """
    reads = ModuleReads(model, ignore)
    classes = list(dict.fromkeys(type(m) for m in model.modules()))
    # Resolve every class's lookup before installing any: a subclass must not call its base's hook.
    originals = [(cls, cls.__dict__.get("__getattribute__"), cls.__getattribute__) for cls in classes]
    for cls, _, lookup in originals:
        cls.__getattribute__ = _recording_lookup(lookup, reads)
    try:
        yield reads
    finally:
        for cls, own, _ in originals:
            if own is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = own


def _recording_lookup(lookup, reads: ModuleReads):
    def __getattribute__(self, name):
        value = lookup(self, name)
        reads.record(self, name, value)
        return value

    return __getattribute__


@dataclasses.dataclass(frozen=True)
class TraceGuard:
    """What a trace baked in (see the module doc); `stale(model)` says what changed since, or None.

    The per-step check reads each recorded attribute (a C-level map of getattr over two tuples) and compares
    values and types in two tuple compares (1 == 1.0 == True, but an int, a float and a bool trace differently),
    then the global state, then the trainable parameters' names.
    """

    modules: tuple[nn.Module, ...]
    fqns: tuple[str, ...]
    names: tuple[str, ...]
    values: tuple[Any, ...]
    types: tuple[type, ...]
    device_type: str
    state: tuple[tuple[str, Any], ...]
    trainable: tuple[str, ...] | None  # None: the graph returns no gradient (an evaluation graph)
    tensors: TensorMeta = ()  # the parameters' and buffers' (name, dtype, shape) the graph was traced with

    @classmethod
    def capture(
        cls, reads: ModuleReads, device_type: str, trainable: tuple[str, ...] | None, tensors: TensorMeta = ()
    ) -> TraceGuard:
        """The guard of a trace that read `reads`, made now (the global state is read at the trace's end)."""
        entries = list(reads.values.values())
        return cls(
            modules=tuple(m for m, _, _ in entries),
            fqns=tuple(reads.fqns[id(m)] for m, _, _ in entries),
            names=tuple(n for _, n, _ in entries),
            values=tuple(v for _, _, v in entries),
            types=tuple(type(v) for _, _, v in entries),
            device_type=device_type,
            state=global_state(device_type),
            trainable=trainable,
            tensors=tensors,
        )

    def rebound(self, model: nn.Module) -> TraceGuard | None:
        """This guard on `model`'s modules of the same names (a trace made on a copy, e.g. the preflight's meta
        model, then run on the live one); None when `model` lacks one of them."""
        modules = dict(model.named_modules())
        if not all(fqn in modules for fqn in self.fqns):
            return None
        return dataclasses.replace(self, modules=tuple(modules[fqn] for fqn in self.fqns))

    def stale(self, trainable: tuple[str, ...] | None, tensors: TensorMeta | None = None) -> str | None:
        """Why the graph no longer computes what eager would, given the live trainable names and, when given, the
        live parameters' and buffers' `tensor_meta`; None if it does."""
        try:
            current = tuple(map(getattr, self.modules, self.names))
        except AttributeError:
            current = tuple(getattr(m, n, _Deleted) for m, n in zip(self.modules, self.names, strict=True))
        if current != self.values or tuple(map(type, current)) != self.types:
            return self._attributes_changed(current)
        state = global_state(self.device_type)
        if state != self.state:
            return "; ".join(
                f"{name} {old!r} -> {new!r}"
                for (name, old), (_, new) in zip(self.state, state, strict=True)
                if old != new
            )
        if self.trainable is not None and trainable != self.trainable:
            return _trainable_changed(self.trainable, trainable)
        if tensors is not None and self.tensors and tensors != self.tensors:
            return _tensors_changed(self.tensors, tensors)
        return None

    def _attributes_changed(self, current: tuple[Any, ...]) -> str:
        changed = [
            f"{path} {old!r} -> {new!r}"
            for path, old, new, kind in zip(
                map(_path, self.fqns, self.names), self.values, current, self.types, strict=True
            )
            if not (type(new) is kind and new == old)
        ]
        more = f" and {len(changed) - _NAMED} more" if len(changed) > _NAMED else ""
        return "module attribute " + "; ".join(changed[:_NAMED]) + more


class _Deleted:
    """Stands for an attribute deleted since the trace."""


def _path(fqn: str, name: str) -> str:
    return f"{fqn}.{name}" if fqn else name


def tensor_meta(named: Iterable[tuple[str, torch.Tensor]]) -> TensorMeta:
    """(name, dtype, shape) of each named tensor: what a graph input was traced as (its device is the trace's)."""
    return tuple((name, t.dtype, tuple(t.shape)) for name, t in named)


def _tensors_changed(old: TensorMeta, new: TensorMeta) -> str:
    if [n for n, _, _ in old] != [n for n, _, _ in new]:
        gone = [n for n, _, _ in old if n not in {m for m, _, _ in new}]
        added = [n for n, _, _ in new if n not in {m for m, _, _ in old}]
        what = [f"new: {', '.join(added[:_NAMED])}"] * bool(added) + [f"gone: {', '.join(gone[:_NAMED])}"] * bool(gone)
        return "the model's parameters or buffers changed (" + "; ".join(what or ["order"]) + ")"
    changed = [
        f"{name} {_dtype(a)} {list(sa)} -> {_dtype(b)} {list(sb)}"
        for (name, a, sa), (_, b, sb) in zip(old, new, strict=True)
        if (a, sa) != (b, sb)
    ]
    more = f" and {len(changed) - _NAMED} more" if len(changed) > _NAMED else ""
    return "tensor " + "; ".join(changed[:_NAMED]) + more


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _trainable_changed(old: tuple[str, ...], new: tuple[str, ...] | None) -> str:
    gained = [n for n in new or () if n not in old]
    lost = [n for n in old if n not in (new or ())]
    parts = [f"now trainable: {', '.join(gained)}"] * bool(gained) + [f"now frozen: {', '.join(lost)}"] * bool(lost)
    return "the set of parameters with requires_grad=True changed (" + "; ".join(parts or ["order"]) + ")"


__all__ = ["ModuleReads", "TensorMeta", "TraceGuard", "VALUE_TYPES", "global_state", "recording_reads", "tensor_meta"]
