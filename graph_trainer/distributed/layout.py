"""What a layout's degrees mean, read off the registered parallelisms (`parallelize.PARALLELISMS`).

A layout is the degree of every parallelism by its option name: the mesh's dimensions (`mesh.DIMS`, each a
factor of the world) and the carved ones (a parallelism with `carved_from`, whose degree divides another's, as
ep divides dp_shard). The layout search (`graph_trainer/layouts/search.py`) asks this module, never a
parallelism by name, what a layout's ranks, data-parallel degree, sharded state, references and options are; a
new parallelism answers by declaring the facts of `Parallelism`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from typing import Any

from graph_trainer.distributed.mesh import DATA_PARALLEL, DIMS
from graph_trainer.distributed.parallelism import Parallelism, ScheduleModel
from graph_trainer.distributed.parallelize import PARALLELISMS

Degrees = Mapping[str, int]


def _by_dim() -> dict[str, type[Parallelism]]:
    return {p.mesh_dim: p for p in PARALLELISMS if p.mesh_dim}


def carved() -> tuple[str, ...]:
    """The degree options that divide another dimension instead of multiplying the world (ep)."""
    return tuple(p.mesh_dim for p in PARALLELISMS if p.carved_from)


def searched_dims() -> tuple[str, ...]:
    """The mesh's dimensions the search offers, outermost first: those whose parallelism's cost it models."""
    by_dim = _by_dim()
    return tuple(d for d in DIMS if d not in by_dim or by_dim[d].searched)


def not_searched(options: Any) -> str | None:
    """Why the search cannot start from the user's [parallelism] `options`: a degree above 1 of a dimension it does
    not search (its candidates would all keep it), or None."""
    left_out = [d for d in DIMS if d not in searched_dims() and getattr(options, d, 1) > 1]
    if not left_out:
        return None
    d = left_out[0]
    return f"the layout search does not search parallelism.{d} yet (its cost is not modelled); drop --parallelism.{d}"


def planned_apart(degrees: Degrees) -> list[int] | None:
    """The ranks of a job of `degrees` to plan apart, when a parallelism it uses `plans_apart` (their plans differ:
    `Parallelism.planned_ranks`), or None (rank 0's plan is every rank's)."""
    for p in PARALLELISMS:
        if p.plans_apart and degrees.get(p.mesh_dim, 1) > 1:
            return p.planned_ranks(world_size(degrees), degrees[p.mesh_dim])
    return None


def degree_options() -> tuple[str, ...]:
    """Every degree a searched layout sets: the mesh's searched dimensions, outermost first, then the carved ones
    (a dimension the search leaves out, such as pp, stays at the user's value: 1 unless asked)."""
    return (*searched_dims(), *carved())


def canonical(degrees: Degrees) -> tuple[tuple[str, int], ...]:
    """`degrees` as a hashable layout: every mesh dimension it gives, outermost first, then the carved ones
    above 1."""
    mesh = [(d, degrees[d]) for d in DIMS if d in degrees]
    return (*mesh, *((d, degrees[d]) for d in carved() if degrees.get(d, 1) > 1))


def world_size(degrees: Degrees) -> int:
    """The ranks of a layout: the product of its mesh dimensions."""
    return math.prod(degrees.get(d, 1) for d in DIMS)


def data_parallel(degrees: Degrees) -> int:
    """The data-parallel degree: the ranks that read different sequences."""
    return math.prod(degrees.get(d, 1) for d in DATA_PARALLEL)


def state_divisor(degrees: Degrees) -> int:
    """What a rank's parameters, gradients and optimizer state are divided by (FSDP's and TP's degrees)."""
    return math.prod(degrees.get(p.mesh_dim, 1) for p in PARALLELISMS if p.shards_state)


def words(degrees: Degrees) -> str:
    """'dp_shard 4 x tp 2 (ep 2)': the degrees above 1, the carved ones in brackets; 'one process' when none."""
    text = " x ".join(f"{d} {degrees[d]}" for d in DIMS if degrees.get(d, 1) > 1) or "one process"
    return text + "".join(f" ({d} {degrees[d]})" for d in carved() if degrees.get(d, 1) > 1)


def spans_nodes(degrees: Degrees, gpus_per_node: int) -> str | None:
    """Why the layout puts a ring that must stay in a node across nodes (None when it does not)."""
    return next(
        (
            f"{p.mesh_dim} {degrees[p.mesh_dim]} spans nodes"
            for p in PARALLELISMS
            if p.within_node and degrees.get(p.mesh_dim, 1) > gpus_per_node
        ),
        None,
    )


def carved_choices(model_args: Any, degrees: Degrees) -> list[dict[str, int]]:
    """Every combination of carved degrees worth searching on the mesh degrees `degrees` (those at 1 left out)."""
    parts = [p for p in PARALLELISMS if p.carved_from]
    values = [p.search_degrees(model_args, degrees.get(p.carved_from, 1)) for p in parts]
    return [{p.mesh_dim: n for p, n in zip(parts, combo, strict=True) if n > 1} for combo in itertools.product(*values)]


def option_choices(
    degrees: Degrees, accumulation: int, offered: Mapping[str, tuple[Any, ...]]
) -> Iterator[dict[str, Any]]:
    """Every combination of the parallelisms' options the search crosses at `degrees` (`search_options`)."""
    options: dict[str, tuple[Any, ...]] = {}
    for p in PARALLELISMS:
        options.update(p.search_options(degrees, accumulation, offered))
    for combo in itertools.product(*options.values()):
        yield dict(zip(options, combo, strict=True))


def searched_options() -> frozenset[str]:
    """Every [parallelism] option the search may set (`Parallelism.searched_options`)."""
    return frozenset(o for p in PARALLELISMS for o in p.searched_options)


def step_options() -> frozenset[str]:
    """The options of a whole step rather than of one micro-batch's plan (FSDP's gradient sync)."""
    return frozenset(o for p in PARALLELISMS for o in p.step_options)


def describe_options(options: Mapping[str, Any]) -> tuple[str, str]:
    """(shape words, batch mark) of a candidate's options, as each parallelism describes its own."""
    described = [p.describe_options(options) for p in PARALLELISMS]
    return "".join(w for w, _ in described), "".join(m for _, m in described)


def bf16_settings(degrees: Degrees) -> dict[str, str]:
    """The [training] options of a bf16 step at `degrees`: a parallelism's own (FSDP's bf16 gathers), else autocast."""
    return next((s for p in PARALLELISMS if (s := p.bf16_settings(degrees)) is not None), {"dtype": "bfloat16"})


def reference(degrees: Degrees) -> tuple[tuple, dict[str, int]]:
    """(key, degrees) of the screen's reference for a layout: the parallelisms left out of the screen at 1, a
    staged one (`screened_as = "staged"`) at 1 but keyed by its degree, and a sharding one (`"sharded"`) keyed only
    by being on; the reference of a key is its layout of the smallest `sharded_degree`. Keying the stages keeps a
    pipeline's references (whose small dp_shard the pipeline's share of the state lets through pruning, and whose
    one-process plan can peak in the update) from standing for the layouts without one."""
    key, ref = [], {}
    for d in degree_options():
        n, how = degrees.get(d, 1), _screened_as(d)
        ref[d] = 1 if how in ("left_out", "staged") else n
        if how != "left_out":
            key.append((d, n > 1 if how == "sharded" else n))
    return tuple(key), ref


def sharded_degree(degrees: Degrees) -> int:
    """The product of the degrees whose sharded state the screen scales (FSDP's)."""
    return math.prod(degrees.get(d, 1) for d in degree_options() if _screened_as(d) == "sharded")


def reference_comm(degrees: Degrees, gradient_bytes: int) -> dict[str, int]:
    """The collectives the screen adds to a reference plan for the parallelisms it left out (replication's
    all-reduce), for a rank holding `gradient_bytes` of gradients."""
    out: dict[str, int] = {}
    for p in PARALLELISMS:
        if p.screened_as == "left_out":
            out.update(p.reference_comm(degrees, gradient_bytes))
    return out


def schedule_model(
    degrees: Degrees, options: Mapping[str, Any], local_batch: int, sequence_bytes: int
) -> ScheduleModel | None:
    """The model of a rank's step when a parallelism at `degrees` runs each micro-batch through stages
    (`Parallelism.schedule_model`), or None."""
    models = (p.schedule_model(degrees, options, local_batch, sequence_bytes) for p in PARALLELISMS)
    return next((m for m in models if m is not None), None)


def staged_dims() -> tuple[str, ...]:
    """The mesh dimensions whose ranks plan apart (pipeline stages: `Parallelism.plans_apart`)."""
    return tuple(p.mesh_dim for p in PARALLELISMS if p.plans_apart)


def unstaged(degrees: Degrees) -> dict[str, int]:
    """`degrees` with the parallelisms whose ranks plan apart (pipeline stages) at 1: one process's layout."""
    return {d: 1 if d in staged_dims() else n for d, n in degrees.items()}


def options_at(degrees: Degrees, options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` without those of the parallelisms `degrees` leaves at 1 (a reference planned without them)."""
    unused = {o for p in PARALLELISMS if p.mesh_dim and degrees.get(p.mesh_dim, 1) == 1 for o in p.searched_options}
    return {k: v for k, v in options.items() if k not in unused}


def _screened_as(dim: str) -> str:
    p = _by_dim().get(dim)
    return p.screened_as if p is not None else "itself"


__all__ = [
    "bf16_settings",
    "not_searched",
    "searched_dims",
    "options_at",
    "planned_apart",
    "schedule_model",
    "unstaged",
    "carved",
    "canonical",
    "carved_choices",
    "data_parallel",
    "degree_options",
    "describe_options",
    "option_choices",
    "reference",
    "reference_comm",
    "searched_options",
    "sharded_degree",
    "spans_nodes",
    "staged_dims",
    "state_divisor",
    "step_options",
    "words",
    "world_size",
]
