"""The step's peak under any save-or-recompute choice, as a mixed-integer linear model: what the `budget` policy
solves, and the exact optimum its tests compare against.

One binary per candidate (`budget.choices`: layer ops that own a storage the backward reads) says
recompute (1) or save (0). Every other quantity is a continuous variable that the constraints pin to the value
`remat` and the memory estimate would give, so the model's peak at any choice is the estimate of the graph
`remat` makes from it, to the byte (tests/passes/test_remat_model.py compares them on random choices). The rules
are remat's (`passes/remat.py`) and the estimate's (`tracer/memory_estimate.py`), written as constraints:

- **Copies.** `made[x, b]`: the copy of forward op x exists once the backward reaches op b. remat makes it just
  before the first backward op that reads x, or that needs a copy of one of x's users which reads x; only for
  ops tagged recompute. So made[x, b] = R_x AND (made[x, b-] OR b reads x OR made[u, b] for a user u of x), with
  both bounds: exact.
- **Positions.** The estimate's timeline, with a place for every copy that could be made: the forward ops, then
  for each backward op the copies remat could insert before it (in forward order) and the op itself. A place
  where no copy is made holds no more than the place before it, so the memory rows there are harmless.
- **Lifetimes.** A storage lives from the op that makes it until the last use of any value that holds it (views
  share their base's storage; a copy of a view shares the copy of its base, or the saved original). Each use is
  an event (place, condition); "alive at p" is at least every event's condition at or after p (a suffix OR),
  and at least "born by p". Conditions are products of binaries, linearized as lower bounds (x >= a + b - 1).
  Dead-code elimination is a `kept` variable per original: a recomputed op that only the backward read is gone.
- **Peak.** At every place, inputs + every storage alive there <= the budget.

Only lower bounds move a variable upward, and every variable that a lower bound sets appears in the memory rows
with a positive weight, so the solver gains nothing by raising one: the optimum of the model is the optimum over
choices (docs/passes_and_memory.md has the formulation on one page).

The objective is the recompute FLOPs (`graph_utils.node_flops`, torch's FLOP counter) of every copy made, copies
of free ops included; among choices of equal FLOPs, the one whose copies re-run the fewest output elements wins
(torch counts no FLOPs for elementwise ops). `solve` minimizes the two one after the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import os
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch.fx

from graph_trainer.tracer import node_meta
from graph_trainer.tracer.graph_utils import layer_forward_nodes, node_flops, tensors
from graph_trainer.tracer.memory_estimate import storage_lifetimes, workspace_bytes

INFEASIBLE = "infeasible"  # `Solution.status` when the solver proved that no choice fits
NOTHING_FITS = "recomputing nothing fits"  # `Solution.status` when no solve was needed: no FLOPs is the optimum
# Branch-and-bound nodes a solve may explore: a stop that, unlike the time limit, gives the same choice on any
# machine. The solve-time benchmark's solves reach the time limit first from 4 debug blocks (60 s), not this one.
NODE_LIMIT = 5000
# The largest row bound the solver sees, in its unit of bytes (`_unit`). In bytes, an 8B step's memory rows hold
# coefficients near 1e9 and bounds near 4e10 against HiGHS's 1e-6 tolerances: its presolve called a model infeasible
# that selective AC's choice fits. Scaled so the bounds stay near 2**20, it finds that choice (at 32 KiB or 1 MiB
# units alike), while small models keep their byte unit (a 1-block tiny model's lowest peak took 9 s in bytes and
# 21 s in MiB). Every answer is re-evaluated exactly in bytes (`RematModel.peak`).
ROW_SCALE = 2**20
# HiGHS's options for every solve: a node limit (the same answer on any machine) and no relative gap, so "optimal"
# means proven (`solve` sets an absolute gap below its objective's smallest step).
_EXACT = {"mip_rel_gap": 0.0, "mip_abs_gap": 0.0, "node_limit": NODE_LIMIT}

Expr = tuple[dict[int, float], float]  # {variable: coefficient}, constant


def _expr(*terms: tuple[int | None, float], const: float = 0.0) -> Expr:
    coef: dict[int, float] = defaultdict(float)
    for var, c in terms:
        if var is None:
            const += c
        else:
            coef[var] += c
    return dict(coef), const


@dataclasses.dataclass
class RematModel:
    """The model of one graph: variables, bounds and memory rows (see the module docstring)."""

    candidates: list[torch.fx.Node]
    n_vars: int
    labels: list[str]  # what each variable means (for reading a solution)
    places: list[str]  # each memory row's place: an op, or "copy of x before b"
    lower: list[tuple[int, Expr]]  # x[v] >= expr
    upper: list[tuple[int, Expr]]  # x[v] <= expr
    copy_stage: int  # the first `lower` entry after the copy rules (evaluation settles those first)
    memory: list[Expr]  # per place: bytes alive (inputs in the constant); <= budget
    flops: np.ndarray  # per variable: FLOPs counted when it is 1 (a copy made)
    elements: np.ndarray  # per variable: output elements re-run when it is 1
    owners: list[torch.fx.Node | None]  # per variable: the op it is about (a storage's producer for liveness)
    place_nodes: list[torch.fx.Node]  # per memory row: the op at that place (a copy's place: the op it precedes)
    place_copies: list[torch.fx.Node | None]  # per memory row: the op copied there (None: the op's own place)
    ties: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # candidate pairs chosen alike
    # The rules and memory rows as sparse matrices, built on the first evaluation (`_evaluator`); not copied by
    # `dataclasses.replace`, whose model has rows of its own.
    _compiled: _Evaluator | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ evaluation of one choice

    def values(self, recompute: Iterable[torch.fx.Node]) -> np.ndarray:
        """Every variable's value under a choice (the candidates in `recompute` recomputed, the rest saved): each
        stage's lower bounds raised to their least fixed point, the copy rules first."""
        chosen = set(recompute)
        x = np.zeros(self.n_vars)
        for i, c in enumerate(self.candidates):
            x[i] = 1.0 if c in chosen else 0.0
        for rules, levels in zip(self._stages(), self._evaluator().levels, strict=True):
            if levels is None:  # rules that depend on each other in a cycle: raised until nothing moves
                _raise_until_settled(rules, x)
                continue
            for matrix, const, target in levels:  # each level reads only variables the levels before it settled
                np.maximum.at(x, target, np.minimum(matrix @ x + const, 1.0))
        return x

    def row_values(self, x: np.ndarray) -> np.ndarray:
        """The bytes alive at every place (each memory row's value) under the variables' values `x`."""
        evaluator = self._evaluator()
        return evaluator.memory @ x + evaluator.memory_const

    def _stages(self) -> tuple[list[tuple[int, Expr]], list[tuple[int, Expr]]]:
        return self.lower[: self.copy_stage], self.lower[self.copy_stage :]

    def _evaluator(self) -> _Evaluator:
        if self._compiled is None:
            self._compiled = _Evaluator.of(self)
        return self._compiled

    def peak(self, recompute: Iterable[torch.fx.Node]) -> int:
        """The peak the estimate gives the graph remat makes from this choice."""
        return int(round(self.row_values(self.values(recompute)).max()))

    def recompute_flops(self, recompute: Iterable[torch.fx.Node]) -> int:
        """The FLOPs of every copy remat makes under this choice (torch's FLOP counter)."""
        return int(round(float(self.flops @ self.values(recompute))))


def _raise_until_settled(rules: list[tuple[int, Expr]], x: np.ndarray) -> None:
    """Raise every rule's variable to its bound (`x[v] >= min(expr, 1)`) until no rule raises one."""
    changed = True
    while changed:
        changed = False
        for v, (coef, const) in rules:
            value = min(const + sum(c * x[u] for u, c in coef.items()), 1.0)
            if value > x[v] + 1e-9:
                x[v] = value
                changed = True


def _levels(rules: list[tuple[int, Expr]]) -> list[int] | None:
    """Each rule's level: 0 where it reads no variable that another rule of `rules` sets, else one more than the
    highest level among the variables it reads; None where the rules read each other in a cycle."""
    reads: dict[int, set[int]] = defaultdict(set)
    for v, (coef, _) in rules:
        reads[v].update(coef)
    level: dict[int, int] = {}
    for root in reads:
        if root in level:
            continue
        stack, on_path = [(root, iter(reads[root]))], {root}
        while stack:
            v, pending = stack[-1]
            u = next((u for u in pending if u in reads and u not in level), None)
            if u is None:
                stack.pop()
                on_path.discard(v)
                level[v] = max((level[u] + 1 for u in reads[v] if u in reads), default=0)
            elif u in on_path:
                return None
            else:
                on_path.add(u)
                stack.append((u, iter(reads[u])))
    return [level[v] for v, _ in rules]


@dataclasses.dataclass
class _Evaluator:
    """A model's rules and memory rows as sparse matrices: one choice evaluated in a few matrix products instead
    of a Python sum per rule (0.9 s a choice on an 8-block FSDP model, evaluated about 20 times a budget plan).
    Every coefficient and constant is a whole number (bytes, or 0/1 terms), so the sums are exact in any order."""

    levels: list[list[tuple[object, np.ndarray, np.ndarray]] | None]  # per stage: (matrix, constants, targets)
    memory: object  # csr matrix: the memory rows' coefficients
    memory_const: np.ndarray

    @classmethod
    def of(cls, model: RematModel) -> _Evaluator:
        from scipy.sparse import csr_matrix

        def matrix(rows: list[tuple[int, Expr]]):
            cols = [u for _, (coef, _) in rows for u in coef]
            data = [c for _, (coef, _) in rows for c in coef.values()]
            starts = np.cumsum([0, *(len(coef) for _, (coef, _) in rows)])
            return csr_matrix((np.asarray(data, dtype=float), np.asarray(cols, dtype=np.int64), starts),
                              shape=(len(rows), model.n_vars))  # fmt: skip

        levels = []
        for rules in model._stages():
            level = _levels(rules)
            if level is None:
                levels.append(None)
                continue
            by_level: dict[int, list[tuple[int, Expr]]] = defaultdict(list)
            for rule, k in zip(rules, level, strict=True):
                by_level[k].append(rule)
            levels.append(
                [
                    (matrix(group), np.array([const for _, (_, const) in group]), np.array([v for v, _ in group]))
                    for _, group in sorted(by_level.items())
                ]
            )
        memory = matrix([(-1, row) for row in model.memory])
        return cls(levels, memory, np.array([const for _, const in model.memory], dtype=float))


def build_model(
    gm: torch.fx.GraphModule,
    candidates: list[torch.fx.Node],
    recomputed: set[torch.fx.Node],
    saved: set[torch.fx.Node],
    input_categories: list[str] | None = None,
) -> RematModel:
    """The model of `gm` (untagged, after clean-up) where each of `candidates` is a choice, the ops in `recomputed`
    are always tagged recompute (free ops, pins, FSDP's re-gathers) and those in `saved` always saved.

    A multi-output op's getitems follow their op, as `activation_checkpoint.finalize` makes them.
    """
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    n_cand = len(candidates)
    var_of_candidate = {c: i for i, c in enumerate(candidates)}
    n_vars = n_cand
    labels = [f"recompute {c.name}" for c in candidates]
    owners: list[torch.fx.Node | None] = list(candidates)

    def new_var(label: str = "", owner: torch.fx.Node | None = None) -> int:
        nonlocal n_vars
        n_vars += 1
        labels.append(label)
        owners.append(owner)
        return n_vars - 1

    # R_x: (variable or None, constant) for every layer op; getitems follow their op.
    def tag(n: torch.fx.Node) -> tuple[int | None, float]:
        if n.target is operator.getitem:
            parent = n.args[0]
            if parent in var_of_candidate or parent in recomputed or parent in saved:
                return tag(parent)
        if n in var_of_candidate:
            return var_of_candidate[n], 0.0
        if n in recomputed:
            return None, 1.0
        return None, 0.0

    # The layer ops, and the nodes outside the layers whose tag is already decided (FSDP's gathers: re-gathered
    # ones are copied into the backward by remat as layer ops are).
    in_layers = set(layer_forward_nodes(gm))
    layer = [n for n in nodes if n in in_layers or n in recomputed or n in saved]
    layer_set = set(layer)
    eligible = [n for n in layer if tag(n) != (None, 0.0)]
    eligible_set = set(eligible)

    backward = [n for n in nodes if node_meta.is_backward(n)]
    # Where a copy of x could be made: before a backward reader of x, or where a copy of a user of x is made.
    slots: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for x in reversed(eligible):
        found = {u for u in x.users if node_meta.is_backward(u)}
        for u in x.users:
            if u in eligible_set:
                found |= set(slots[u])
        slots[x] = sorted(found, key=index.__getitem__)

    # Places: forward (and everything before the backward), then per backward op its possible copies and itself.
    place_of: dict[object, int] = {}
    order: list[object] = []
    copies_at: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
    for x in eligible:
        for b in slots[x]:
            copies_at[b].append(x)
    first_bwd = index[backward[0]] if backward else len(nodes)
    for n in nodes:
        if n.op == "output":
            continue
        if index[n] >= first_bwd and node_meta.is_backward(n):
            for x in copies_at[n]:
                place_of[(n, x)] = len(order)
                order.append((n, x))
        place_of[n] = len(order)
        order.append(n)
    n_places = len(order)

    def not_tag(x: torch.fx.Node) -> list[tuple[int | None, float]]:
        rv, rc = tag(x)
        return [(None, 1.0 - rc)] if rv is None else [(rv, -1.0), (None, 1.0)]

    def is_tag(x: torch.fx.Node) -> list[tuple[int | None, float]]:
        rv, rc = tag(x)
        return [(None, rc)] if rv is None else [(rv, 1.0)]

    lower: list[tuple[int, Expr]] = []
    upper: list[tuple[int, Expr]] = []

    # made[x, b]: copy of x exists by slot b (exact: both bounds).
    made: dict[tuple[torch.fx.Node, torch.fx.Node], int] = {}
    for x in eligible:
        for b in slots[x]:
            made[(x, b)] = new_var(f"made {x.name} by {b.name}", x)
    for x in reversed(eligible):  # users first: their `made` feed x's
        prev = None
        for b in slots[x]:
            v = made[(x, b)]
            reasons: list[tuple[int | None, float]] = []
            if prev is not None:
                lower.append((v, _expr((made[(x, prev)], 1.0))))
                reasons.append((made[(x, prev)], 1.0))
            if b in x.users:
                lower.append((v, _expr(*is_tag(x))))
                reasons.append((None, 1.0))
            for u in x.users:
                if (u, b) in made:
                    lower.append((v, _expr((made[(u, b)], 1.0), *is_tag(x), const=-1.0)))
                    reasons.append((made[(u, b)], 1.0))
            upper.append((v, _expr(*is_tag(x))))
            upper.append((v, _expr(*reasons)))
            prev = b
    copy_stage = len(lower)

    def made_expr(x: torch.fx.Node, b: torch.fx.Node) -> list[tuple[int | None, float]]:
        """made_at(x, b) = made[x, b] - made[x, b-]: the copy is made right before b."""
        terms = [(made[(x, b)], 1.0)]
        i = slots[x].index(b)
        if i > 0:
            terms.append((made[(x, slots[x][i - 1])], -1.0))
        return terms

    def made_by(x: torch.fx.Node, place: int) -> list[tuple[int | None, float]]:
        """made[x, .] at `place`: the copy exists there (made at a slot whose copy place is at or before it)."""
        best = None
        for b in slots[x]:
            if place_of[(b, x)] <= place:
                best = b
        return [(made[(x, best)], 1.0)] if best is not None else [(None, 0.0)]

    # kept[x]: the original of a layer op survives dead-code elimination.
    kept: dict[torch.fx.Node, int] = {x: new_var(f"kept {x.name}", x) for x in eligible}
    kept_rules: list[tuple[int, Expr]] = []
    for x in reversed(eligible):
        for u in x.users:
            if u in kept:
                kept_rules.append((kept[x], _expr((kept[u], 1.0))))
            elif node_meta.is_backward(u):
                kept_rules.append((kept[x], _expr(*not_tag(x))))
            else:  # a forward op outside the choice, the optimizer, the output: always there
                kept_rules.append((kept[x], _expr(const=1.0)))
            if u in eligible_set:
                for b in slots[u]:  # a copy of u reads the original x when x is saved
                    kept_rules.append((kept[x], _expr(*made_expr(u, b), *not_tag(x), const=-1.0)))

    def kept_term(n: torch.fx.Node) -> list[tuple[int | None, float]]:
        return [(kept[n], 1.0)] if n in kept else [(None, 1.0)]

    # An event: (place, terms, k): a value holding the storage is used at `place` when all k conditions hold
    # (their terms summed: the conjunction is at least sum - (k - 1)).
    Event = tuple[int, list[tuple[int | None, float]], int]

    def original_events(h: torch.fx.Node) -> list[Event]:
        """Uses of the original h (its own place included: a value nobody uses lives at its own op)."""
        events: list[Event] = [(place_of[h], kept_term(h), 1)]
        for u in h.users:
            if u.op == "output":
                events.append((n_places, [(None, 1.0)], 1))  # returned: alive to the end
            elif u in layer_set:
                events.append((place_of[u], kept_term(u), 1))
            elif node_meta.is_backward(u) and h in eligible_set:
                events.append((place_of[u], not_tag(h), 1))
            else:
                events.append((place_of[u], [(None, 1.0)], 1))
            if u in eligible_set:
                for b in slots[u]:
                    if h in eligible_set:
                        events.append((place_of[(b, u)], [*made_expr(u, b), *not_tag(h)], 2))
                    else:
                        events.append((place_of[(b, u)], made_expr(u, b), 1))
        return events

    def copy_events(h: torch.fx.Node) -> list[Event]:
        """Uses of the copy of h: where it is made, the backward ops that read it, the copies of its users."""
        events: list[Event] = [(place_of[(b, h)], made_expr(h, b), 1) for b in slots[h]]
        for u in h.users:
            if node_meta.is_backward(u):
                events.append((place_of[u], is_tag(h), 1))
            if u in eligible_set:
                for b in slots[u]:
                    events.append((place_of[(b, u)], [*made_expr(u, b), *is_tag(h)], 2))
        return events

    def backward_events(h: torch.fx.Node) -> list[Event]:
        """Uses of a backward op's value (a backward view of a forward value): its place and its users'."""
        events: list[Event] = [(place_of[h], [(None, 1.0)], 1)]
        for u in h.users:
            events.append((n_places if u.op == "output" else place_of[u], [(None, 1.0)], 1))
        return events

    def root(h: torch.fx.Node, holders: set[torch.fx.Node]) -> torch.fx.Node:
        """The forward value a backward holder views (its nearest forward holder)."""
        while node_meta.is_backward(h):
            h = next((a for a in h.all_input_nodes if a in holders), None) or h
            if node_meta.is_backward(h) and not any(a in holders for a in h.all_input_nodes):
                return h  # made in the backward: never copied
        return h

    def conj(events: list[Event], *terms: tuple[int | None, float]) -> list[Event]:
        return [(p, [*t, *terms], k + 1) for p, t, k in events]

    _, storages = storage_lifetimes(gm, input_categories)
    fixed = np.zeros(n_places + 2)
    inputs = workspace_bytes(gm)
    memory_terms: list[dict[int, float]] = [defaultdict(float) for _ in range(n_places)]
    alive_rules: list[tuple[int, Expr]] = []

    def add_storage(events: list[Event], born: int, born_by, nbytes: int, owner: torch.fx.Node) -> None:
        """Rows for one storage (made by `owner`): born at place `born` for sure (`born_by` None) or where
        `born_by(place)` (terms) says it exists; alive until its last event whose condition holds."""
        sure, conditional = -1, []
        for p, terms, k in events:
            coef, const = _expr(*terms, const=-(k - 1.0))
            if coef or born_by is not None:  # a storage that may not exist is alive only where it does
                conditional.append((p, (coef, const)))
            elif const >= 1.0 - 1e-9:
                sure = max(sure, p)
        if born_by is None and sure >= born:
            fixed[born] += nbytes
            fixed[min(sure, n_places) + 1] -= nbytes
        later_places = sorted({p for p, _ in conditional if p > sure}, reverse=True)
        if not later_places:
            return
        suffix: dict[int, int] = {}
        later = None
        for p in later_places:  # latest first: each place's OR includes every later one
            v = suffix[p] = new_var(owner=owner)
            if later is not None:
                alive_rules.append((v, _expr((later, 1.0))))
            later = v
        for p, e in conditional:
            if p in suffix:
                alive_rules.append((suffix[p], e))
        places = sorted(suffix)
        segment: dict[tuple, int] = {}
        j = 0
        for q in range(max(born, sure + 1), min(places[-1], n_places - 1) + 1):
            while places[j] < q:
                j += 1
            s = suffix[places[j]]
            if born_by is None:
                memory_terms[q][s] += nbytes
                continue
            by = born_by(q)
            if by == [(None, 0.0)]:
                continue
            # alive = used at or after q AND made by q: one variable while neither changes. (A direct bound
            # alive >= made where a use is sure once made tightens the relaxation: at 4 debug blocks it proved
            # every benchmark solve optimal, but at 6 one solve found no choice at all in 10 s, so it is left out.)
            key = (s, tuple(by))
            if key not in segment:
                segment[key] = new_var(owner=owner)
                alive_rules.append((segment[key], _expr((s, 1.0), *by, const=-1.0)))
            memory_terms[q][segment[key]] += nbytes

    for st in storages:
        if st.born < 0:
            inputs += st.nbytes
            continue
        producer = st.producer
        holders = list(dict.fromkeys(st.holders))
        holder_set = set(holders)
        copied = producer in eligible_set
        original: list[Event] = []
        copy: list[Event] = []
        for h in holders:
            if node_meta.is_backward(h):
                x = root(h, holder_set)
                if x not in eligible_set:
                    original += backward_events(h)
                    continue
                original += conj(backward_events(h), *not_tag(x))
                if copied:
                    both = conj(backward_events(h), *is_tag(x))
                    copy += both if x is producer else conj(both, *is_tag(producer))
                    if x is not producer:
                        original += conj(conj(backward_events(h), *is_tag(x)), *not_tag(producer))
                else:
                    original += conj(backward_events(h), *is_tag(x))
                continue
            original += original_events(h)
            if h in eligible_set and h is not producer:
                original += conj(copy_events(h), *not_tag(producer)) if copied else copy_events(h)
            if h in eligible_set and copied:
                copy += copy_events(h)
        add_storage(original, place_of[producer], None, st.nbytes, producer)
        if copied and slots[producer]:
            first = place_of[(slots[producer][0], producer)]
            add_storage(copy, first, lambda q, x=producer: made_by(x, q), st.nbytes, producer)

    lower += kept_rules + alive_rules
    const = np.cumsum(fixed)[:n_places] + inputs
    memory = [(dict(memory_terms[q]), float(const[q])) for q in range(n_places)]

    flops, elements = np.zeros(n_vars), np.zeros(n_vars)
    for x in eligible:
        if slots[x]:
            flops[made[(x, slots[x][-1])]] = node_flops(x)
            elements[made[(x, slots[x][-1])]] = sum(t.numel() for t in tensors(x.meta.get("val")))
    return RematModel(
        candidates=list(candidates),
        n_vars=n_vars,
        labels=labels,
        places=[p.name if isinstance(p, torch.fx.Node) else f"copy of {p[1].name} before {p[0].name}" for p in order],
        lower=lower,
        upper=upper,
        copy_stage=copy_stage,
        memory=memory,
        flops=flops,
        elements=elements,
        owners=owners,
        place_nodes=[p if isinstance(p, torch.fx.Node) else p[0] for p in order],
        place_copies=[None if isinstance(p, torch.fx.Node) else p[1] for p in order],
    )


@contextlib.contextmanager
def _solver_quiet() -> Iterator[None]:
    """HiGHS's C++ code prints debugging lines to the process's stdout now and then (seen: "HighsMipSolverData::
    transformNewIntegerFeasibleSolution tmpSolver.run();"), whatever `disp` says; they say nothing to a user, and
    the solver's result carries its status. File descriptor 1 points at /dev/null while it runs."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull, warnings.catch_warnings():
            os.dup2(devnull.fileno(), 1)
            # scipy passes HiGHS options it does not list (mip_abs_gap) on verbatim, and warns that it does.
            warnings.filterwarnings("ignore", "Unrecognized options detected", RuntimeWarning)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _row(rows, cols, vals, lo, hi, coef: dict[int, float], pin: int | None, low: float, high: float) -> None:
    """Append the constraint low <= x[pin] - coef.x <= high (pin None: low <= coef.x <= high)."""
    r = len(lo)
    if pin is not None:
        rows.append(r), cols.append(pin), vals.append(1.0)
    for u, c in coef.items():
        rows.append(r), cols.append(u), vals.append(-c if pin is not None else c)
    lo.append(low), hi.append(high)


def _unit(model: RematModel) -> float:
    """The bytes in one unit of the solver's memory rows: a power of two that keeps their bounds near `ROW_SCALE`."""
    largest = max((abs(const) for _, const in model.memory), default=1.0)
    return float(2 ** max(0, math.ceil(math.log2(max(largest, 1.0))) - int(math.log2(ROW_SCALE))))


def _in_units(coef: dict[int, float], unit: float) -> dict[int, float]:
    """A memory row's byte coefficients in the solver's unit."""
    return {u: c / unit for u, c in coef.items()}


def _rule_rows(model: RematModel) -> tuple[list, list, list, list, list]:
    """The model's bounds as sparse rows (row, column, value lists and each row's low and high)."""
    rows, cols, vals, lo, hi = [], [], [], [], []
    for v, (coef, const) in model.lower:
        _row(rows, cols, vals, lo, hi, coef, v, const, np.inf)
    for v, (coef, const) in model.upper:
        _row(rows, cols, vals, lo, hi, coef, v, -np.inf, const)
    for a, b in model.ties:
        _row(rows, cols, vals, lo, hi, {b: 1.0}, a, 0.0, 0.0)
    return rows, cols, vals, lo, hi


@dataclasses.dataclass(frozen=True)
class Solution:
    """The solver's answer for one budget: the candidates to recompute, or None when no choice fits."""

    recompute: list[torch.fx.Node] | None
    peak_bytes: int | None  # the model's peak under that choice (== the estimate's, to the byte)
    recompute_flops: int | None
    solve_s: float
    status: str
    optimal: bool = False  # HiGHS proved it optimal (else it stopped at its time limit with the best found)
    gap: float | None = None  # the solver's relative optimality gap (0 up to rounding when optimal)
    bound_bytes: int | None = None  # a lowest-peak solve's proven floor: no choice (within its FLOPs) peaks below it


def _whole_step(weights: np.ndarray) -> float:
    """The largest number that divides every nonzero weight (FLOPs and element counts are whole numbers): no two
    objective values differ by less, so a gap below it proves the optimum."""
    whole = [int(round(w)) for w in weights if w]
    return float(np.gcd.reduce(whole)) if whole else 1.0


def _bounds(model: RematModel, fixed: Mapping[torch.fx.Node, bool] | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """0/1 bounds on the model's `n` first variables, each candidate in `fixed` held at its value (True:
    recomputed)."""
    lower, upper = np.zeros(n), np.ones(n)
    for i, c in enumerate(model.candidates):
        if fixed is not None and c in fixed:
            lower[i] = upper[i] = float(fixed[c])
    return lower, upper


def _milp(objective: np.ndarray, matrix, lo, hi, n_integral: int, time_limit_s: float, abs_gap: float, bounds):
    """One HiGHS solve within `bounds` (lower, upper), the first `n_integral` variables binary, stopped at
    `abs_gap`, the time limit or `NODE_LIMIT` nodes."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    integrality = np.zeros(len(objective))
    integrality[:n_integral] = 1
    # The variables that carry the objective (each copy's last `made`) are 0 or 1 at any choice anyway; declared
    # integers, they tell HiGHS that the objective is a whole number of units, so it rounds its dual bound up and
    # proves the optimum once the gap is below one unit: a 2-block budget's proof took 8 s instead of 40.
    integrality[objective != 0] = 1
    with _solver_quiet():
        return milp(
            objective,
            constraints=LinearConstraint(matrix, lo, hi),
            integrality=integrality,
            bounds=Bounds(*bounds),
            options={"time_limit": max(time_limit_s, 0.0), **_EXACT, "mip_abs_gap": abs_gap},
        )


def solve(
    model: RematModel,
    budget_bytes: float,
    *,
    time_limit_s: float = 60.0,
    fixed: Mapping[torch.fx.Node, bool] | None = None,
) -> Solution:
    """The choice with the fewest recompute FLOPs whose peak is at most `budget_bytes`, and among those the one that
    re-runs the fewest output elements (scipy's HiGHS MILP; both within `time_limit_s` together). `fixed`: candidates
    held at a decision (True: recomputed); the answer is then the best among the choices that keep them.

    The two are solved one after the other, each in units of its weights' common divisor (`_whole_step`), with
    an absolute gap below one unit: one objective of FLOPs plus a one-in-a-million element term needs a gap HiGHS
    cannot close (its tolerances are 1e-6): a 2-block step's budget stopped at 60 s with a 76% gap, where the FLOPs
    alone are proven in 8 s (`_milp`). `optimal` says the FLOPs are proven fewest; the element count is the best
    the remaining time found (the FLOP solve's own choice, when the second finds none).

    The solver works in floating point; its answer is re-evaluated exactly (`RematModel.peak`), and where that
    is above the budget (a tolerance's worth), the budget is lowered by the excess and solved again.
    """
    from scipy.sparse import coo_matrix, vstack

    start = time.perf_counter()
    if not any((fixed or {}).values()):
        # Saving everything fits: no FLOPs and no elements re-run, the optimum of both objectives, known without a
        # solve. HiGHS took 3.7 s to prove it at the top of a 6-block frontier, and may stop before it under load.
        nothing = model.peak([])
        if nothing <= budget_bytes:
            return Solution([], nothing, 0, time.perf_counter() - start, NOTHING_FITS, True, 0.0)
    rows, cols, vals, lo, hi = _rule_rows(model)
    unit = _unit(model)
    memory_start = len(lo)
    for coef, const in model.memory:
        if coef:
            _row(rows, cols, vals, lo, hi, _in_units(coef, unit), None, -np.inf, (budget_bytes - const) / unit)
    fixed_peak = max((const for coef, const in model.memory), default=0.0)
    n_cand = len(model.candidates)
    matrix = coo_matrix((vals, (rows, cols)), shape=(len(lo), model.n_vars)).tocsr()
    bounds = _bounds(model, fixed, model.n_vars)
    flop_step, element_step = _whole_step(model.flops), _whole_step(model.elements)
    flop_objective = model.flops / flop_step
    target = budget_bytes
    for _ in range(3):
        if fixed_peak > target:
            return Solution(None, None, None, time.perf_counter() - start, INFEASIBLE)
        hi_now = np.array(hi)
        hi_now[memory_start:] -= (budget_bytes - target) / unit
        result = _milp(flop_objective, matrix, lo, hi_now, n_cand, time_limit_s, 0.5, bounds)
        if result.x is None and result.status == 2:
            return Solution(None, None, None, time.perf_counter() - start, INFEASIBLE)
        if result.x is None:  # stopped before any choice was found: recomputing every candidate, if that fits
            every = [c for c in model.candidates if fixed is None or fixed.get(c, True)]
            peak = model.peak(every)
            status = f"{result.message}; every candidate recomputed, the solver having found no choice"
            if peak <= budget_bytes:
                return Solution(list(every), peak, model.recompute_flops(every), time.perf_counter() - start, status)
            return Solution(None, None, None, time.perf_counter() - start, result.message)
        chosen = [c for i, c in enumerate(model.candidates) if result.x[i] > 0.5]
        peak = model.peak(chosen)
        if peak <= budget_bytes:
            flops = model.recompute_flops(chosen)
            optimal = result.status == 0
            if optimal:
                left_s = time_limit_s - (time.perf_counter() - start)
                if left_s > 0 and model.elements.any():  # fewest elements among choices of these FLOPs
                    within = vstack([matrix, flop_objective]).tocsr()
                    second = _milp(model.elements / element_step, within, [*lo, -np.inf],
                                   [*hi_now, flops / flop_step + 0.5], n_cand, left_s, 0.5, bounds)  # fmt: skip
                    chosen, peak = _fewer_elements(model, (chosen, peak), second, budget_bytes)
            gap = getattr(result, "mip_gap", None)
            return Solution(chosen, peak, flops, time.perf_counter() - start, result.message, optimal, gap)
        target -= peak - budget_bytes
    return Solution(None, None, None, time.perf_counter() - start, "the solver's choices kept landing above the budget")


def _fewer_elements(model: RematModel, first: tuple[list, int], second, budget_bytes: float) -> tuple[list, int]:
    """(choice, peak): the element solve's choice (`second`, a milp result) where, evaluated exactly, it fits, costs
    no more FLOPs and re-runs no more elements than `first` (the FLOP solve's choice and peak); else `first`."""
    if second.x is None:
        return first
    chosen = first[0]
    better = [c for i, c in enumerate(model.candidates) if second.x[i] > 0.5]
    peak = model.peak(better)
    fewer = model.elements @ model.values(better) <= model.elements @ model.values(chosen)
    if peak <= budget_bytes and model.recompute_flops(better) <= model.recompute_flops(chosen) and fewer:
        return better, peak
    return first


def smallest_peak(model: RematModel, *, time_limit_s: float = 10.0) -> tuple[int, bool]:
    """(the lowest peak a choice reaches, whether the solver proved it the lowest within `time_limit_s` and
    `NODE_LIMIT` nodes): what an infeasible budget is told to rise to. Recomputing every candidate is the
    fallback answer (unproven)."""
    lowest = lowest_peak(model, time_limit_s=time_limit_s)
    return lowest.peak_bytes, lowest.optimal


def lowest_peak(
    model: RematModel,
    *,
    within_flops: float | None = None,
    time_limit_s: float = 10.0,
    fixed: Mapping[torch.fx.Node, bool] | None = None,
) -> Solution:
    """The choice with the lowest peak among those recomputing at most `within_flops` (None: any), `optimal` when
    proven within `time_limit_s` and `NODE_LIMIT` nodes, and the solver's proven floor (`bound_bytes`: no such
    choice peaks below it, whether or not it found one). `fixed`: candidates held at a decision, as in `solve`
    (the floor is then the floor of the choices that keep them).

    The peak is one more variable, at least every memory row, and the objective. Where the solver finds no choice
    within its limits, the better of recomputing every candidate (within the FLOPs) and nothing is the answer, said
    unproven."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    n = model.n_vars + 1  # the last variable is the peak
    rows, cols, vals, lo, hi = _rule_rows(model)
    unit = _unit(model)
    for coef, const in model.memory:  # the peak variable is in the solver's unit
        _row(rows, cols, vals, lo, hi, {**_in_units(coef, unit), n - 1: -1.0}, None, -np.inf, -const / unit)
    if within_flops is not None:  # in units of the costliest copy: coefficients near 1
        scale = max(float(model.flops.max(initial=0.0)), 1.0)
        _row(rows, cols, vals, lo, hi, {v: c / scale for v, c in enumerate(model.flops) if c}, None, -np.inf,
             within_flops / scale)  # fmt: skip
    integrality = np.zeros(n)
    integrality[: len(model.candidates)] = 1
    objective = np.zeros(n)
    objective[-1] = 1.0
    lower, upper = _bounds(model, fixed, n)
    upper[-1] = np.inf
    start = time.perf_counter()
    with _solver_quiet():
        result = milp(
            objective,
            constraints=LinearConstraint(coo_matrix((vals, (rows, cols)), shape=(len(lo), n)).tocsr(), lo, hi),
            integrality=integrality,
            bounds=Bounds(lower, upper),
            options={"time_limit": time_limit_s, **_EXACT},
        )
    seconds = time.perf_counter() - start
    bound = getattr(result, "mip_dual_bound", None)
    bound_bytes = None if bound is None or not np.isfinite(bound) else math.ceil(bound * unit - 1e-6 * unit)
    if result.x is None:
        every = [c for c in model.candidates if fixed is None or fixed.get(c, True)]
        within = within_flops is None or model.recompute_flops(every) <= within_flops
        chosen = every if within and model.peak(every) <= model.peak([]) else []
        status = f"{result.message}; the solver found no choice"
        return Solution(chosen, model.peak(chosen), model.recompute_flops(chosen), seconds, status, False, None,
                        bound_bytes)  # fmt: skip
    chosen = [c for i, c in enumerate(model.candidates) if result.x[i] > 0.5]
    gap = getattr(result, "mip_gap", None)
    peak, optimal = model.peak(chosen), result.status == 0
    return Solution(chosen, peak, model.recompute_flops(chosen), seconds, result.message, optimal, gap,
                    peak if optimal else bound_bytes)  # fmt: skip


__all__ = [
    "INFEASIBLE",
    "NOTHING_FITS",
    "RematModel",
    "Solution",
    "build_model",
    "lowest_peak",
    "smallest_peak",
    "solve",
]
