"""`activation_checkpoint.memory_budget`, read in one place: a fraction of the no-AC activation memory, or a size
with its unit for the whole step's per-rank peak.

- A number in (0, 1]: that fraction of the no-AC graph's activation memory (its estimated peak minus the graph
  inputs: parameters, buffers, batch and optimizer state, which no save-or-recompute choice changes).
- A size with its unit, such as "40GiB" or "800MB": the whole step's per-rank peak, everything included
  (parameters, gradients, optimizer state, collectives' buffers, the loss), as the plan and the dry run print it.
  Binary units (KiB, MiB, GiB, TiB) are powers of 1024 and decimal ones (KB, MB, GB, TB) powers of 1000, as
  their names say; a bare "G" is refused, since it could mean either.

For now a size budget needs no Inductor (`check_memory_budget`), whose compiled graph's buffers lie outside the
graph the policy plans. The policy counts what is alive beside that graph (the eager AdamW update's state; with
gradient accumulation, the step's other micro-batches) and the eager update's own peak after it; with accumulation
the update graph after the micro-steps is held to the budget by the preflight, on the whole step's plan.

A bare number above 1 once meant GiB of activation memory; it is refused with the unit to add, because the same
number now read as the whole step's peak would plan something else without a word.
"""

from __future__ import annotations

import dataclasses
import math
import re

from graph_trainer.errors import ConfigError
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.units import GIB

KEY = "activation_checkpoint.memory_budget"
UNITS = {
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_EXAMPLE = "'40GiB' for the whole step's per-rank peak, or a fraction in (0, 1] of the no-AC activation memory"


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """One of the two: `fraction` of the no-AC activation memory, or the whole step's `peak_bytes`."""

    fraction: float | None = None
    peak_bytes: int | None = None

    def target(self, *, input_bytes: int, no_ac_peak: int) -> float:
        """The whole step's peak this budget allows, in bytes, given the no-AC graph's inputs and peak."""
        if self.peak_bytes is not None:
            return float(self.peak_bytes)
        return input_bytes + self.fraction * (no_ac_peak - input_bytes)

    def smallest(self, peak: int, *, input_bytes: int, no_ac_peak: int) -> str:
        """The smallest budget, in the user's own unit, that a plan peaking at `peak` bytes fits (rounded up)."""
        if self.peak_bytes is not None:
            return f"{math.ceil(peak / GIB * 1000) / 1000}GiB"
        activations = max(no_ac_peak - input_bytes, 1)
        return str(math.ceil((peak - input_bytes) / activations * 1000) / 1000)


def parse_memory_budget(value: str | float) -> MemoryBudget:
    """`value` as the config holds it ("40GiB", "0.5" or 0.5) read as a budget.

    Raises:
        ConfigError: not a fraction in (0, 1] nor a positive size with a known unit (the message says what to give).
    """
    if isinstance(value, bool):  # a bool is an int to Python, never a budget
        raise ConfigError(f"{KEY} must be a size or a fraction, got {value!r}: give {_EXAMPLE}")
    match = _SIZE.match(value) if isinstance(value, str) else None
    if isinstance(value, str) and match is None:
        raise ConfigError(f"{KEY} {value!r} is not a size or a fraction: give {_EXAMPLE}")
    number = float(match.group(1)) if match else float(value)
    unit = match.group(2).lower() if match else ""
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{KEY} must be > 0, got {value!r}: give {_EXAMPLE}")
    if not unit:
        if number > 1:
            raise ConfigError(
                f"{KEY} {value!r} has no unit and is above 1: give the whole step's per-rank peak with its unit "
                f"(e.g. '{number:g}GiB'; a bare number above 1 once meant GiB of activations only) or a fraction <= 1"
            )
        return MemoryBudget(fraction=number)
    if unit not in UNITS:
        raise ConfigError(
            f"{KEY} {value!r} has an unknown unit {match.group(2)!r}: use one of B, KiB, MiB, GiB, TiB (powers of "
            "1024) or KB, MB, GB, TB (powers of 1000)"
        )
    return MemoryBudget(peak_bytes=int(number * UNITS[unit]))


def check_memory_budget(cfg: JobConfig) -> None:
    """Refuse a whole-step size budget where the policy cannot see the whole step. (FSDP's prefetch, which moves
    gathers after the budget is decided, and gradient accumulation, whose micro-batches and update graph lie beside
    the graph planned, are allowed: the policy keeps room for the one and the others, `passes/budget.py`, and the
    preflight holds the whole step's plan to the budget, `plan/preflight.py`.)

    Raises:
        ConfigError: a size budget with `compile.backend inductor` (a compiled graph's buffers lie outside what
            the policy plans).
    """
    ac = cfg.activation_checkpoint
    budget = parse_memory_budget(ac.memory_budget)
    if ac.mode != "budget" or budget.peak_bytes is None:
        return
    if cfg.compile.backend == "inductor":
        raise ConfigError(
            f"{KEY} {ac.memory_budget!r} is a whole-step peak, but Inductor (the compiled graph's buffers) lies "
            "outside the graph the memory policy plans: set --compile.backend none, or give a fraction <= 1 of the "
            "no-AC activation memory"
        )
