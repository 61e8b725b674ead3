"""Memory-budget activation checkpointing: the fewest recompute FLOPs whose whole-step peak fits the budget.

The `budget` mode of the `memory_policy` pass (`passes/memory_policy.py`).

Reads and writes the same metadata as `activation_checkpoint` (whose structural
rules it keeps: layer regions, saved boundaries, random and in-place ops never
recomputed, per-op overrides pinned). Metadata only: preserves numerics bitwise.

Budget (`graph_trainer.job_config.memory_budget`): a fraction <= 1 of the no-AC
activation memory (the estimated step peak minus the graph inputs: parameters,
buffers, batch, optimizer state, which no checkpointing policy changes), or a
size with its unit ("40GiB") for the whole step's peak, everything included.

Method: an exact mixed-integer linear program (`passes/remat_model.py`, solved by
scipy's HiGHS). The choices are the layer ops that own a storage the backward
reads in the no-AC graph (only those free memory when recomputed), and the ops
that cost FLOPs (a matmul the backward does not read, such as an output
projection, is read again when the residual add after it is recomputed: saving
it then is selective AC's choice, and must be one of ours). Views follow their
base, and the other ops whose output the backward does not read are tagged
recompute for free (they cost no FLOPs when a recomputed op needs them). The model's peak
under any choice is the estimate of the graph remat makes from it, to the byte,
so the solver's optimum is the choice with the fewest recompute FLOPs (torch's
FLOP counter, every copy counted) among all that fit: not a heuristic's. Why an
MILP: the peak is a maximum over the whole step of sums of lifetimes that depend
on chains of choices (a copy is made where its first recomputed user needs it),
which a greedy order or a per-op score cannot see; HiGHS proves optimality on
these models in seconds at a few blocks (docs/passes_and_memory.md has the
formulation and the measured times).

An infeasible budget is refused with the smallest peak any choice reaches (the
same model, minimizing the peak).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

import torch.fx

from graph_trainer.errors import ConfigError
from graph_trainer.job_config.memory_budget import MemoryBudget, parse_memory_budget
from graph_trainer.job_config.schema import ActivationCheckpointConfig
from graph_trainer.observability.log import get_logger
from graph_trainer.observability.units import GIB
from graph_trainer.optimizer.update_memory import Accumulation, EagerUpdate
from graph_trainer.passes.activation_checkpoint import (
    RECOMPUTE,
    SAVE,
    Decisions,
    StepStructure,
    analyze,
    apply_overrides,
    finalize,
    write_tags,
)
from graph_trainer.passes.budget_depth import BlockChoice, Key, candidate_keys, extend_in_depth, signature
from graph_trainer.passes.fsdp_gather import gather_decisions, tag_fsdp_gathers
from graph_trainer.passes.fsdp_prefetch import prefetch_reserve
from graph_trainer.passes.op_patterns import parse_overrides
from graph_trainer.passes.remat import peak_after_remat
from graph_trainer.passes.remat_model import (
    INFEASIBLE,
    RematModel,
    Solution,
    build_model,
    lowest_peak,
    smallest_peak,
    solve,
)
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.graph_utils import is_view, node_flops, storage_keys
from graph_trainer.tracer.memory_estimate import estimate_peak_memory

logger = get_logger(__name__)

# Seconds the solver may take per trace, a safety net behind its node limit (`remat_model.NODE_LIMIT`). Past
# either, the best choice found is used and the log line says it is not proven optimal, with HiGHS's gap. Since
# ops that cost FLOPs became choices, debug models of 4 and 6 blocks stop here, unproven, with the narrower space's
# FLOPs (docs/passes_and_memory.md, the solve-time table); those choices depend on the machine's speed. A deep
# model's unproven choice then gets as long again to be lowered block class by block class (`descend`).
SOLVE_TIME_LIMIT_S = 60.0
# The block-class descent's time (`descend`) in `lowest_peak_in_depth`, in its solves' time limits: room for two
# rounds of three classes at the 8B and 16B widths, whose class solves settle in 2-26 s of a 30 s limit.
DESCENT_SOLVES = 6


def backward_storages(gm: torch.fx.GraphModule) -> set[int]:
    """Storages read by a backward op (in the untagged graph: what is saved for backward)."""
    keys: set[int] = set()
    for n in gm.graph.nodes:
        if node_meta.is_backward(n):
            for a in n.all_input_nodes:
                if not node_meta.is_backward(a):
                    keys |= storage_keys(a)
    return keys


def choices(
    structure: StepStructure, pinned: set[torch.fx.Node], saved_storages: set[int]
) -> tuple[list[torch.fx.Node], set[torch.fx.Node]]:
    """(the candidates, in graph order: layer ops that own a storage the backward reads, or that cost FLOPs; the
    free ops, tagged recompute whatever the choice: views, which follow their base, and FLOP-free ops whose output no
    backward op reads)."""
    candidates: list[torch.fx.Node] = []
    free: set[torch.fx.Node] = set()
    for n in structure.layer_nodes:
        if n in structure.forced or n in pinned:
            continue
        keys = storage_keys(n)
        owned = keys - set().union(*(storage_keys(a) for a in n.all_input_nodes)) if n.all_input_nodes else keys
        if is_view(n) or not (owned & saved_storages or node_flops(n)):
            free.add(n)
        else:
            candidates.append(n)
    return candidates, free


def _remat_model(
    gm: torch.fx.GraphModule,
    structure: StepStructure,
    ac: ActivationCheckpointConfig,
    input_categories: list[str] | None,
    fsdp_policy: str | None,
) -> tuple[RematModel, set[torch.fx.Node], Decisions]:
    """(the exact model of `gm`'s peak and recompute FLOPs under any choice, the ops recomputed whatever the choice,
    the per-op overrides' decisions) for `ac`'s save and recompute lists.

    With FSDP (`fsdp_policy`: `parallelism.fsdp_reshard_after_forward`), the gathers the `fsdp_gather` pass will
    tag after this one are in the model as it will tag them (re-gathered: copied into the backward; kept: saved),
    so the model's peak is the final graph's, not the peak of a graph that keeps every gathered parameter.
    """
    candidates, always, pinned = _candidates(gm, structure, ac)
    gathers = {} if fsdp_policy is None else gather_decisions(gm, fsdp_policy)
    regathered = {n for n, again in gathers.items() if again}
    kept = set(gathers) - regathered
    model = build_model(gm, candidates, always | regathered, (set(pinned) - always) | kept, input_categories)
    return model, always, pinned


def _peak_after_gathers_and_remat(
    gm: torch.fx.GraphModule, input_categories: list[str] | None, fsdp_policy: str | None
) -> int:
    """The estimated peak of `gm` rematerialized as its tags say, with FSDP's gathers tagged as the `fsdp_gather`
    pass will tag them (`fsdp_policy`; None: no FSDP): the final graph's peak, which the model promised. The gather
    tags are put back as they were: that pass writes them."""
    if fsdp_policy is None:
        return peak_after_remat(gm, input_categories)
    gathers = gather_decisions(gm, fsdp_policy)
    before = {n: {k: n.meta[k] for k in (node_meta.RECOMPUTE, node_meta.AC_GRAPH_ID) if k in n.meta} for n in gathers}
    tag_fsdp_gathers(gm, fsdp_policy)
    try:
        return peak_after_remat(gm, input_categories)
    finally:
        for n, meta in before.items():
            n.meta.pop(node_meta.RECOMPUTE, None)
            n.meta.pop(node_meta.AC_GRAPH_ID, None)
            n.meta.update(meta)


def _no_ac_peak(
    gm: torch.fx.GraphModule, model: RematModel | None, input_categories: list[str] | None
) -> tuple[int, int, int]:
    """(the graph inputs' bytes, the no-AC peak a fraction budget refers to: with FSDP (`model` given), that of the
    step FSDP runs, its gathers tagged, with nothing else recomputed; the bytes the graph leaves alive)."""
    no_ac = estimate_peak_memory(gm, input_categories=input_categories)
    final = sum(no_ac.final_bytes_by_category.values())
    return no_ac.input_bytes, no_ac.peak_bytes if model is None else model.peak([]), final


def _reserve(gm: torch.fx.GraphModule, fsdp_policy: str | None, gathers_prefetched: bool) -> int:
    """Bytes the budget keeps for FSDP's prefetch, which moves gathers after the budget is decided (0 without it):
    the most one unit's gathers in flight add (`fsdp_prefetch.prefetch_reserve`)."""
    return prefetch_reserve(gm) if fsdp_policy is not None and gathers_prefetched else 0


@dataclasses.dataclass(frozen=True)
class Outside:
    """What the step holds beyond the graph the budget's model describes: `reserve`, room for the gathers FSDP's
    prefetch moves up later (`_reserve`); `held`, bytes alive through the graph that are not its inputs (the eager
    update's state; with accumulation, the other micro-batches and what `Accumulation` lists), said in `held_what`;
    and `after`, the eager update's own peak after the graph (the graph's final bytes, the update's scratch and
    its state; 0 for a micro-step, after which the update graph runs: the preflight holds the budget to the whole
    step's planned peak, `plan/preflight.py`)."""

    reserve: int = 0
    held: int = 0
    after: int = 0
    held_what: str = ""

    def graph_target(self, budget: MemoryBudget, *, input_bytes: int, no_ac_peak: int) -> float:
        """The peak the final graph may reach: a size budget is the whole step's, so the eager update's state comes
        off it; a fraction is of the graph's own activations (`no_ac_peak` counting the reserve)."""
        held = self.held if budget.peak_bytes is not None else 0
        return budget.target(input_bytes=input_bytes, no_ac_peak=no_ac_peak) - held

    def whole_step(self, budget: MemoryBudget, model_peak: int) -> int:
        """The step's peak, in the budget's terms, of a choice whose model peak is `model_peak`."""
        if budget.peak_bytes is None:
            return model_peak + self.reserve
        return max(model_peak + self.reserve + self.held, self.after)

    def words(self) -> str:
        """The log lines' words for what the target leaves room for (nothing without it)."""
        parts = [f"{self.reserve / GIB:.4f} GiB kept for FSDP's prefetch"] if self.reserve else []
        parts += [f"{self.held / GIB:.4f} GiB of {self.held_what} beside the graph"] if self.held else []
        return f" (with {' and '.join(parts)})" if parts else ""


def _outside(
    gm: torch.fx.GraphModule,
    fsdp_policy: str | None,
    gathers_prefetched: bool,
    eager_update: EagerUpdate | None,
    accumulation: Accumulation | None,
    final_bytes: int,
    input_categories: list[str] | None,
) -> Outside:
    """`gm`'s `Outside`: `final_bytes` is what the graph leaves alive (the eager update runs on it)."""
    reserve = _reserve(gm, fsdp_policy, gathers_prefetched)
    state = eager_update.state_bytes if eager_update is not None else 0
    if accumulation is not None and "gradient" in (input_categories or []):  # a micro-step: accumulators are inputs
        held = state + accumulation.held(gm, input_categories)
        return Outside(reserve, held, 0, "the optimizer state and the step's other micro-batches")
    if eager_update is None:
        return Outside(reserve)
    return Outside(reserve, state, final_bytes + eager_update.scratch_bytes + state, "eager AdamW state")


def _update_refusal(ac: ActivationCheckpointConfig, outside: Outside) -> ConfigError | None:
    """The refusal of a size budget below the eager update's own peak, which no choice in the graph lowers."""
    budget = parse_memory_budget(ac.memory_budget)
    if budget.peak_bytes is None or outside.after <= budget.peak_bytes:
        return None
    smallest = budget.smallest(outside.after, input_bytes=0, no_ac_peak=0)
    return ConfigError(
        f"activation_checkpoint.memory_budget {ac.memory_budget} is infeasible: the eager AdamW update after the "
        f"graph peaks at {outside.after / GIB:.4f} GiB (parameters, gradients, its state and scratch), whatever is "
        f"recomputed; set --activation_checkpoint.memory_budget {smallest} or more, or shard the state "
        "(--parallelism.dp_shard)"
    )


def _infeasible(
    model: RematModel, ac: ActivationCheckpointConfig, input_bytes: int, no_ac_peak: int, status: str, out: Outside
):
    """The one-line refusal of a budget no choice of `model` fits, with the smallest feasible budget (in the
    budget's terms: `Outside.whole_step` of the model's lowest peak)."""
    lowest, proven = smallest_peak(model, time_limit_s=SOLVE_TIME_LIMIT_S)
    budget = parse_memory_budget(ac.memory_budget)
    smallest = out.whole_step(budget, lowest)
    needed = budget.smallest(smallest, input_bytes=input_bytes, no_ac_peak=no_ac_peak)
    which = "the smallest reachable peak" if proven else f"the lowest peak found in {SOLVE_TIME_LIMIT_S:g} s"
    if status != INFEASIBLE:  # not proven: say what stopped the solver
        which += f" (no fitting choice found: {status})"
    # A fraction is of the graph's peak; the dry run's table shows the whole step's (with what runs beside the
    # graph, such as the eager update): a refusal naming 0.0412 GiB under rows of 0.08 read as a contradiction.
    step = out.whole_step(MemoryBudget(peak_bytes=0), lowest)
    beside = f" ({out.held_what} beside the graph)" if out.held_what else ""
    whole = "" if step == smallest else f"; the whole step{beside} then peaks at {step / GIB:.4f} GiB"
    return ConfigError(
        f"activation_checkpoint.memory_budget {ac.memory_budget} is infeasible: {which} "
        f"is {smallest / GIB:.4f} GiB ({(smallest - input_bytes) / GIB:.4f} GiB of activations{whole}); "
        f"set --activation_checkpoint.memory_budget {needed} or more, or lower the batch size "
        "or sequence length"
    )


def _proof(optimal: bool, status: str, gap: float | None) -> str:
    return "optimal" if optimal else f"not proven optimal: {status}" + ("" if gap is None else f", gap {gap:.2%}")


def tag_memory_budget(
    gm: torch.fx.GraphModule,
    ac: ActivationCheckpointConfig,
    *,
    input_categories: list[str] | None = None,
    fsdp_policy: str | None = None,
    gathers_prefetched: bool = False,
    eager_update: EagerUpdate | None = None,
    accumulation: Accumulation | None = None,
    block_choice: BlockChoice | None = None,
) -> torch.fx.GraphModule:
    """Tag `gm` so its estimated peak fits `ac.memory_budget` with the fewest recompute FLOPs (see module docstring).
    `fsdp_policy`: with FSDP, `parallelism.fsdp_reshard_after_forward`, which the model applies to the gathers as
    the later `fsdp_gather` pass will (`_remat_model`); the no-AC peak is then that of the graph with no other
    recompute. `gathers_prefetched`: with FSDP, `parallelism.fsdp_prefetch`, whose later pass can hold one unit's
    gathers more than the graph decided here: the choice is solved that much below the target (`_reserve`), and the
    no-AC peak a fraction refers to counts it. `eager_update`: the AdamW update run after the graph (None: in it),
    whose state a size budget leaves room for beside the graph, and whose own peak it must hold (`Outside`).
    `accumulation`: the step's micro-batches, when `gm` is one micro-step of several (a size budget leaves room for
    what is alive beside it, `Accumulation`). `block_choice`: the choice the plan solved on this model's short
    traces (`solve_in_depth`), applied by block class instead of solving this graph whole; a graph it was not solved
    for (a retrace at another shape) is solved whole, which is said.

    In place; returns `gm`.

    Raises:
        ConfigError: the budget is below the smallest peak any choice reaches (the message gives the smallest
            feasible budget in the user's unit).
    """
    structure = analyze(gm)
    if block_choice is not None and _apply_block_choice(gm, structure, ac, input_categories, fsdp_policy, block_choice):
        return gm
    built = None if fsdp_policy is None else _remat_model(gm, structure, ac, input_categories, fsdp_policy)
    input_bytes, no_ac_peak, final_bytes = _no_ac_peak(gm, built and built[0], input_categories)
    out = _outside(gm, fsdp_policy, gathers_prefetched, eager_update, accumulation, final_bytes, input_categories)
    if refusal := _update_refusal(ac, out):
        raise refusal
    no_ac_peak += out.reserve
    target = out.graph_target(parse_memory_budget(ac.memory_budget), input_bytes=input_bytes, no_ac_peak=no_ac_peak)
    if no_ac_peak <= target:
        write_tags(gm, structure, {})  # the no-AC graph fits: recompute nothing
        logger.info(
            f"memory_budget: the no-AC peak {no_ac_peak / GIB:.4f} GiB fits the graph's target "
            f"{target / GIB:.4f} GiB{out.words()}; nothing recomputed"
        )
        return gm

    model, always, pinned = built or _remat_model(gm, structure, ac, input_categories, fsdp_policy)
    candidates = model.candidates
    solution = solve(model, target - out.reserve, time_limit_s=SOLVE_TIME_LIMIT_S)
    if solution.recompute is None:
        raise _infeasible(model, ac, input_bytes, no_ac_peak, solution.status, out)
    chosen = set(solution.recompute)
    _write_choice(gm, structure, always, pinned, chosen)
    _check_estimate(gm, input_categories, fsdp_policy, solution.peak_bytes)
    say = logger.info if solution.optimal else logger.warning  # a choice short of the optimum is a fallback
    s = solution
    say(
        f"memory_budget: the graph's target peak {target / GIB:.4f} GiB{out.words()}; recompute "
        f"{len(chosen)}/{len(candidates)} candidates, {s.recompute_flops / 1e9:.3f} GFLOP of recompute, "
        f"peak {s.peak_bytes / GIB:.4f} GiB ({_proof(s.optimal, s.status, s.gap)}, {s.solve_s:.1f} s)"
    )
    return gm


def _write_choice(
    gm: torch.fx.GraphModule,
    structure: StepStructure,
    always: set[torch.fx.Node],
    pinned: Decisions,
    chosen: set[torch.fx.Node],
) -> None:
    decisions: Decisions = {n: RECOMPUTE if n in always or n in chosen else SAVE for n in structure.layer_nodes}
    decisions.update(pinned)
    write_tags(gm, structure, finalize(structure, decisions))


def _check_estimate(
    gm: torch.fx.GraphModule, input_categories: list[str] | None, fsdp_policy: str | None, promised: int
) -> None:
    """Warn when the tagged graph's estimate is not the peak the model promised (a modelling gap)."""
    estimated = _peak_after_gathers_and_remat(gm, input_categories, fsdp_policy)
    if estimated != promised:  # the model is tested equal to remat + the estimate; a graph it misreads
        logger.warning(
            f"memory_budget: the solver's model puts this choice's peak at {promised / GIB:.4f} GiB and "
            f"the memory estimate at {estimated / GIB:.4f} GiB; the step runs as estimated (a modelling gap in "
            "passes/remat_model.py: please report it with this graph)"
        )


def _candidates(
    gm: torch.fx.GraphModule, structure: StepStructure, ac: ActivationCheckpointConfig
) -> tuple[list[torch.fx.Node], set[torch.fx.Node], Decisions]:
    """(the candidates, the ops recomputed whatever the choice, the per-op overrides' decisions)."""
    save, recompute = parse_overrides(ac.save_list, ac.recompute_list)
    pinned = apply_overrides(structure, {}, save, recompute)  # forced saves win over a pin (`finalize`)
    candidates, free = choices(structure, set(pinned), backward_storages(gm))
    always = free | {n for n, d in pinned.items() if d == RECOMPUTE and n not in structure.forced}
    return candidates, always, pinned


def _apply_block_choice(
    gm: torch.fx.GraphModule,
    structure: StepStructure,
    ac: ActivationCheckpointConfig,
    input_categories: list[str] | None,
    fsdp_policy: str | None,
    block_choice: BlockChoice,
) -> bool:
    """Tag `gm` with `block_choice` (True), or say why it does not apply (False: solve it whole)."""
    candidates, always, pinned = _candidates(gm, structure, ac)
    depth = 1 + max((node_meta.layer_id(n) for n in structure.layer_nodes), default=-1)
    chosen = block_choice.decisions(candidate_keys(candidates, depth, block_choice.lead))
    if isinstance(chosen, str):
        logger.warning(
            f"memory_budget: the choice planned on {' + '.join(map(str, block_choice.short_depths))}-block traces does "
            f"not apply to this graph ({chosen}); solving it whole"
        )
        return False
    _write_choice(gm, structure, always, pinned, chosen)
    if depth != block_choice.depth:  # a short step of the plan, tagged as the deep one will be
        return True
    c = block_choice
    if c.micro_step:  # a pipeline's: each rank's peak is its stage plan's, said by the preflight
        (logger.info if c.optimal else logger.warning)(
            f"memory_budget: one process's choice at this micro-batch, one per block class solved on the "
            f"{' + '.join(map(str, c.short_depths))}-block traces: recompute {c.recomputed}/{c.candidates} candidates, "
            f"{c.recompute_flops / 1e9:.3f} GFLOP of recompute a micro-batch ({_proof(c.optimal, c.status, c.gap)}, "
            f"{c.solve_s:.1f} s)"
        )
        return True
    _check_estimate(gm, input_categories, fsdp_policy, block_choice.peak_bytes)
    say = logger.info if c.optimal else logger.warning
    say(
        f"memory_budget: the graph's target peak {c.target_bytes / GIB:.4f} GiB{c.room}; recompute "
        f"{c.recomputed}/{c.candidates} candidates, one choice per block class solved on the "
        f"{' + '.join(map(str, c.short_depths))}-block traces, {c.recompute_flops / 1e9:.3f} GFLOP of recompute, "
        f"peak {c.peak_bytes / GIB:.4f} GiB ({_proof(c.optimal, c.status, c.gap)}, {c.solve_s:.1f} s)"
    )
    return True


@dataclasses.dataclass(frozen=True)
class DeepModel:
    """The budget's model of a deep step under per-class choices (`budget_depth.extend_in_depth`), its candidates'
    keys, and its graph inputs' bytes."""

    model: RematModel
    keys: dict[torch.fx.Node, Key]
    input_bytes: int
    depth: int
    lead: int
    outside: Outside = Outside()  # what the step holds beside the graph at this depth

    def count(self, candidates: Iterable[torch.fx.Node]) -> int:
        """How many candidates of the deep step `candidates` of the short model's stand for (a middle block's for
        every middle block)."""
        middle = self.depth - self.lead - 2
        return sum(middle if k[0] == "mid" else 1 for k in {self.keys[c] for c in candidates})


def deep_model(
    short: tuple[torch.fx.GraphModule, torch.fx.GraphModule],
    input_categories: tuple[list[str], list[str]],
    ac: ActivationCheckpointConfig,
    *,
    counterpart: dict[torch.fx.Node, torch.fx.Node],
    block_of: dict[torch.fx.Node, int | None],
    lead: int,
    depth: int,
    fsdp_policy: str | None = None,
    gathers_prefetched: bool = False,
    eager_updates: tuple[EagerUpdate | None, EagerUpdate | None] = (None, None),
) -> DeepModel:
    """The budget's model of the `depth`-block step from its `lead`+3- and `lead`+4-block steps (`short`, after
    clean-up), as `solve_in_depth` solves it. `fsdp_policy`, `gathers_prefetched`: as `tag_memory_budget`'s (a unit's
    gathers are the same at every depth, so the short step's reserve is the deep one's). `eager_updates`: the short
    steps' eager updates (None: in the graph); their state and scratch, and the graph's final bytes, grow by the
    same bytes a block, as the plan extends them (`plan/block_plan.py`).

    Raises:
        NotExtendable: the short steps' models do not extend in depth (`budget_depth`).
    """
    three, four = (
        _remat_model(gm, analyze(gm), ac, categories, fsdp_policy)[0]
        for gm, categories in zip(short, input_categories, strict=True)
    )
    model = extend_in_depth(four, three, counterpart=counterpart, block_of=block_of, lead=lead, depth=depth)
    estimates = [estimate_peak_memory(gm, input_categories=c) for gm, c in zip(short, input_categories, strict=True)]

    def at_depth(read: Callable[[int], int]) -> int:
        return read(1) + (depth - lead - 4) * (read(1) - read(0))

    input_bytes = at_depth(lambda i: estimates[i].input_bytes)
    final_bytes = at_depth(lambda i: sum(estimates[i].final_bytes_by_category.values()))
    update = None
    if eager_updates[1] is not None:
        update = EagerUpdate(
            eager_updates[1].implementation,
            at_depth(lambda i: eager_updates[i].state_bytes),
            at_depth(lambda i: eager_updates[i].scratch_bytes),
        )
    outside = _outside(short[1], fsdp_policy, gathers_prefetched, update, None, final_bytes, None)
    return DeepModel(model, candidate_keys(model.candidates, lead + 4, lead), input_bytes, depth, lead, outside)


def solve_in_depth(deep: DeepModel, ac: ActivationCheckpointConfig) -> BlockChoice:
    """The budget policy's choice for a deep step, one per block class, solved on its model from the short steps
    (`deep_model`).

    Raises:
        ConfigError: no choice fits the budget at the deep step's depth (with the smallest feasible budget).
    """
    model, input_bytes, out = deep.model, deep.input_bytes, deep.outside
    if refusal := _update_refusal(ac, out):
        raise refusal
    no_ac_peak = model.peak([]) + out.reserve
    target = out.graph_target(parse_memory_budget(ac.memory_budget), input_bytes=input_bytes, no_ac_peak=no_ac_peak)
    solved_at = target - out.reserve  # the model's peak bound: the target less what FSDP's prefetch may add
    if no_ac_peak <= target:
        solution = Solution([], model.peak([]), 0, 0.0, "the no-AC peak fits", True)
    else:
        solution = solve(model, solved_at, time_limit_s=SOLVE_TIME_LIMIT_S)
        if solution.recompute is None:
            raise _infeasible(model, ac, input_bytes, no_ac_peak, solution.status, out)
        if not solution.optimal:  # the whole solve stopped at its limits: improve its choice class by class

            def fewer_flops(fixed: dict[torch.fx.Node, bool], seconds: float) -> Solution:
                return solve(model, solved_at, time_limit_s=seconds, fixed=fixed)

            def better(found: Solution, best: Solution) -> bool:
                return found.peak_bytes <= solved_at and found.recompute_flops < best.recompute_flops

            found, note = descend(deep, solution, fewer_flops, better, SOLVE_TIME_LIMIT_S)
            solution = dataclasses.replace(found, status=f"{solution.status}; {note}")
    return _block_choice(deep, solution, target)


def descend(
    deep: DeepModel,
    start: Solution,
    resolve: Callable[[dict[torch.fx.Node, bool], float], Solution],
    better: Callable[[Solution, Solution], bool],
    seconds: float,
) -> tuple[Solution, str]:
    """Block-coordinate descent from `start` (a choice that fits): each block class's choice solved again with
    every other class's held at the best choice so far (`resolve(fixed, seconds left)`), the class of the most
    blocks first, while a round improves the choice (`better(found, best)`) and time is left (`seconds` in all).

    Why: at the widths of Llama-3 8B and DeepSeek-V3 16B no solve of the whole deep model settles in 30 s, so its
    answer is whatever HiGHS happened to find; one class's solve with the others held settles in 2-26 s, and is
    then the best choice of that class given the others. On the 16B at selective AC's FLOPs, from selective's
    choice, two rounds of such solves took the peak from 0.873 of eager selective to 0.686, where the whole model's
    bisection had stopped at 0.818 (docs/passes_and_memory.md). The answer is a local optimum, not a proven one:
    its `optimal` stays `start`'s, and the note returned beside it says whether every class's last solve was
    proven."""
    model, keys = deep.model, deep.keys
    classes = sorted({k[0] for k in keys.values()}, key=lambda c: (-deep.count(n for n in keys if keys[n][0] == c), c))
    deadline = time.perf_counter() + seconds
    best, rounds, improved, proven = start, 0, True, False
    while improved and time.perf_counter() < deadline:
        improved, proven, rounds = False, True, rounds + 1
        for cls in classes:
            left = deadline - time.perf_counter()
            if left <= 0:
                proven = False
                break
            chosen = set(best.recompute)
            fixed = {c: c in chosen for c in model.candidates if keys[c][0] != cls}
            found = resolve(fixed, left)
            proven &= found.optimal
            if found.recompute is not None and better(found, best):
                best, improved = found, True
    held = "each class's choice proven the best given the others'" if proven and not improved else "time spent"
    spent = seconds - max(deadline - time.perf_counter(), 0.0)
    gap = start.gap if best is start else None  # the solver's gap was of the start's objective
    best = dataclasses.replace(best, optimal=start.optimal, gap=gap, solve_s=start.solve_s + spent)
    return best, f"by block class: {rounds} rounds, {held}"


def lowest_peak_in_depth(
    deep: DeepModel,
    flops: float,
    *,
    time_limit_s: float = SOLVE_TIME_LIMIT_S,
    resolution: int = 2**20,
    known: Iterable[torch.fx.Node] = (),
    direct_time_limit_s: float | None = None,
) -> tuple[BlockChoice, int]:
    """(the per-class choice of a deep step with the lowest peak among those recomputing at most `flops` (torch's
    FLOP counter, at the deep step's depth), the lowest peak proven out of reach: no choice within the FLOPs peaks
    at or below it): what another policy's recompute buys under this one.

    The budget's own solve (fewest FLOPs under a peak) is bisected on the peak, to within `resolution` bytes: the
    fewest FLOPs never rise with the budget, so a solve proven to need more than `flops` (or to have no choice)
    at a budget proves every lower peak out of reach too. HiGHS proves that solve in seconds where minimizing the
    peak under a FLOP limit directly finds no choice at all in 10 s (a 4-block model of the tiny test widths). When
    a bisection step was not proven, that direct solve runs once more for its dual bound, a floor that holds
    whether or not it finds a choice (Llama-3 8B: no bisection step settles in 30 s, the bound does).
    `known`: a choice within the FLOPs (another policy's, such as selective AC's). scipy's HiGHS takes no starting
    point, so it is first lowered class by class (`descend`), and the bisection starts from there. Where the
    bisection stops unproven and the direct solve finds a lower choice, that choice is lowered class by class too.
    The choice says `optimal` when every solve of the bisection was proven, or the direct solve was (its own time
    limit: `direct_time_limit_s`, default `time_limit_s`); its status says where it came from."""
    start = time.perf_counter()
    model = deep.model
    best = Solution([], model.peak([]), 0, 0.0, "nothing recomputed", True)
    known = list(known)
    if known and model.recompute_flops(known) <= flops and model.peak(known) < best.peak_bytes:
        best = Solution(known, model.peak(known), model.recompute_flops(known), 0.0, "the known choice", True)

    def lower_peak(fixed: dict[torch.fx.Node, bool], seconds: float) -> Solution:
        return lowest_peak(model, within_flops=flops, time_limit_s=min(seconds, time_limit_s), fixed=fixed)

    def better(found: Solution, best: Solution) -> bool:
        return found.recompute_flops <= flops and found.peak_bytes < best.peak_bytes

    notes = []
    if best.recompute:  # a known choice: lowered class by class first, so the bisection starts below it
        descended, note = descend(deep, best, lower_peak, better, DESCENT_SOLVES * time_limit_s)
        notes.append(f"the known choice {'lowered' if descended.peak_bytes < best.peak_bytes else 'kept'} {note}")
        best = descended
    low, high, proven, floor, bisected = 0, best.peak_bytes, True, 0, best
    while high - low > resolution:
        middle = (low + high) // 2
        found = solve(model, middle, time_limit_s=time_limit_s)
        settled = found.optimal or found.status == INFEASIBLE
        proven &= settled
        if found.recompute is not None and found.recompute_flops <= flops:
            best, high = found, found.peak_bytes
        else:
            low = middle
            floor = max(floor, middle) if settled else floor
    notes.insert(0, "optimal" if proven else "a bisection step stopped at the solver's limits")
    if best is bisected and not proven:
        notes.append("no choice found below it")
    if not proven:  # one direct solve: its dual bound is a floor even where it finds no choice
        direct = lowest_peak(model, within_flops=flops, time_limit_s=direct_time_limit_s or time_limit_s)
        if direct.bound_bytes is not None:
            floor = max(floor, direct.bound_bytes - 1)
        if direct.recompute_flops <= flops and direct.peak_bytes < best.peak_bytes:
            best = direct
            notes.append("the lowest peak's own solve found a lower one")
        if direct.optimal:  # that solve proved its peak the lowest: so is the answer's, which is no higher
            proven, notes = True, ["optimal: the lowest peak's own solve proved it"]
    if not proven and best is not bisected and best.recompute:  # a new choice: lowered class by class too
        best, note = descend(deep, best, lower_peak, better, DESCENT_SOLVES * time_limit_s)
        notes.append(f"then lowered {note}")
    status = "; ".join(notes)
    found = dataclasses.replace(best, solve_s=time.perf_counter() - start, status=status, optimal=proven)
    return _block_choice(deep, found, found.peak_bytes), floor


def _block_choice(deep: DeepModel, solution: Solution, target: float) -> BlockChoice:
    model, keys, depth, lead = deep.model, deep.keys, deep.depth, deep.lead
    chosen = {keys[c] for c in solution.recompute}
    return BlockChoice(
        depth=depth,
        recompute=frozenset(chosen),
        signatures=tuple(sorted({keys[c]: signature(c) for c in model.candidates}.items())),
        target_bytes=int(target),
        peak_bytes=solution.peak_bytes,
        recompute_flops=solution.recompute_flops,
        recomputed=deep.count(solution.recompute),
        candidates=deep.count(model.candidates),
        optimal=solution.optimal,
        gap=solution.gap,
        solve_s=solution.solve_s,
        status=solution.status,
        short_depths=(lead + 3, lead + 4),
        lead=lead,
        room=deep.outside.words(),
    )


@dataclasses.dataclass(frozen=True)
class FrontierPoint:
    """One budget of the frontier and the policy's answer: the fewest recompute FLOPs whose peak fits it."""

    budget_bytes: int  # the whole step's peak asked for
    fraction: float  # the same budget as a fraction of the no-AC activation memory (`memory_budget`'s other form)
    peak_bytes: int  # the chosen plan's whole-step peak (the model's and the eager update's, equal to the estimate's)
    recompute_flops: int
    recomputed: int  # candidates recomputed, of `candidates`
    candidates: int
    optimal: bool  # HiGHS proved it; else the best choice found within the solver's limits
    gap: float | None
    solve_s: float
    # With FSDP's prefetch: bytes the policy keeps below `budget_bytes` for the gathers the prefetch moves later
    # (`_reserve`); `peak_bytes` is then the step's before they move, and at most this much more after.
    reserve_bytes: int = 0


def budget_frontier(
    gm: torch.fx.GraphModule,
    ac: ActivationCheckpointConfig,
    *,
    input_categories: list[str] | None = None,
    points: int = 10,
    on_point: Callable[[FrontierPoint], None] | None = None,
    time_limit_s: float = SOLVE_TIME_LIMIT_S,
    fsdp_policy: str | None = None,
    gathers_prefetched: bool = False,
    eager_update: EagerUpdate | None = None,
) -> list[FrontierPoint]:
    """The budget policy's answers at `points` budgets evenly spread from the lowest peak a choice reaches (the
    lowest found within `time_limit_s` on a deep graph) to the no-AC peak, both included: what each whole-step peak
    costs in recompute FLOPs. `gm` is the untagged step after clean-up, as the pass sees it; it is left as it is.
    `on_point` hears each point as it is solved (a deep graph takes seconds a point). `time_limit_s` bounds each
    solve, as `SOLVE_TIME_LIMIT_S` bounds the pass's: a point stopped by it says so (not optimal, with the solver's
    gap). A choice that fits a budget fits every larger one, so a stopped solve whose choice costs more FLOPs than
    the point before (or that found none) takes that point's choice, also said not optimal: the frontier never
    rises. `fsdp_policy`, `gathers_prefetched`, `eager_update`: as `tag_memory_budget`'s.
    """
    structure = analyze(gm)
    model, _always, _pinned = _remat_model(gm, structure, ac, input_categories, fsdp_policy)
    no_ac = estimate_peak_memory(gm, input_categories=input_categories)
    highest = no_ac.peak_bytes if fsdp_policy is None else model.peak([])
    out = _outside(
        gm, fsdp_policy, gathers_prefetched, eager_update, None, sum(no_ac.final_bytes_by_category.values()), None
    )
    return model_frontier(
        model, no_ac.input_bytes, highest, points=points, on_point=on_point, time_limit_s=time_limit_s, outside=out
    )


def model_frontier(
    model: RematModel,
    input_bytes: int,
    highest: int,
    *,
    points: int = 10,
    on_point: Callable[[FrontierPoint], None] | None = None,
    time_limit_s: float = SOLVE_TIME_LIMIT_S,
    count: Callable[[list[torch.fx.Node]], int] = len,
    outside: Outside = Outside(),
) -> list[FrontierPoint]:
    """`budget_frontier` on a model (`input_bytes`: its graph's inputs; `highest`: its no-AC peak); `count`: how
    many of the step's candidates a choice of the model's stands for (`DeepModel.count` on a deep model);
    `outside`: what the step holds beside the graph (`Outside`): each point's budget and peak are the whole step's,
    the budget being the size that asks for the point's choice."""
    if points < 2:
        raise ValueError(f"a frontier needs at least 2 points, got {points}")
    # The low end is the lowest peak the solver finds within the limit: proven the lowest on small graphs, the best
    # found on deep ones (said once). Either way a known choice reaches it, so every point has a choice that fits.
    lowest_found = lowest_peak(model, time_limit_s=time_limit_s)
    lowest_choice, lowest = lowest_found.recompute, lowest_found.peak_bytes
    reserve, whole = outside.reserve, MemoryBudget(peak_bytes=0)  # a size budget: the whole step's peak
    if not lowest_found.optimal:  # in the rows' terms: the whole step's peak, not the model's
        logger.warning(
            f"budget frontier: its first budget, {outside.whole_step(whole, lowest) / GIB:.4f} GiB, is the lowest "
            f"peak the solver found in {time_limit_s:g} s, not one it proved the lowest"
        )
    activations = max(highest + reserve - input_bytes, 1)
    out = []
    # The best choice known to fit: the lowest-peak choice fits every budget here, and each point's choice fits the
    # next (budgets rise). A solve stopped by its limits with more FLOPs than it, or with no choice, takes it.
    known = Solution(lowest_choice, lowest, model.recompute_flops(lowest_choice), 0.0, "the lowest-peak choice")
    for i in range(points):
        budget = int(round(lowest + (highest - lowest) * i / (points - 1)))
        found = solve(model, budget, time_limit_s=time_limit_s)
        if found.recompute is None or found.recompute_flops > known.recompute_flops:
            found = dataclasses.replace(known, solve_s=found.solve_s, optimal=False, gap=None)
        known = found
        point = FrontierPoint(
            budget_bytes=outside.whole_step(whole, budget),
            fraction=(budget + reserve - input_bytes) / activations,
            peak_bytes=max(found.peak_bytes + outside.held, outside.after),  # before the prefetch moves its gathers
            recompute_flops=found.recompute_flops,
            recomputed=count(found.recompute),
            candidates=count(model.candidates),
            optimal=found.optimal,
            gap=found.gap,
            solve_s=found.solve_s,
            reserve_bytes=reserve,
        )
        out.append(point)
        if on_point is not None:
            on_point(point)
    return out
