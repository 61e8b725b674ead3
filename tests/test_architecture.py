"""The layout table in docs/architecture.md is the law of imports: each folder imports only what its row allows.

The test reads the table itself, so the documented direction and the enforced one cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "docs" / "architecture.md"
# `python -m graph_trainer.plan` runs the layout search (layouts/), a unit above plan/ and the trainer
ENTRY_POINTS = {"graph_trainer.__main__", "graph_trainer.export", "graph_trainer.plan.__main__"}
ALIASES = {"graph_trainer/tracer/compiled.py"}  # the documented re-export (see the table's note)
ALWAYS = {"errors"}


def _rows() -> dict[str, set[str]]:
    """Unit ('models', 'runtime', 'loss', ...) -> the units its row says it may import."""
    rows = {}
    for line in TABLE.read_text().splitlines():
        m = re.match(r"\| `(?:graph_trainer/)?([\w]+)(?:/|\.py)` \| .* \| (.*) \|$", line)
        if m:
            allowed = m.group(2)
            rows[m.group(1)] = set() if allowed.startswith("nothing") else {a.strip() for a in allowed.split(",")}
    return rows


def _closure(rows: dict[str, set[str]]) -> dict[str, set[str]]:
    closed = {}
    for unit in rows:
        seen, stack = set(), list(rows[unit] | ALWAYS)
        while stack:
            name = stack.pop()
            if name not in seen:
                seen.add(name)
                stack.extend(rows.get(name, set()))
        closed[unit] = seen
    return closed


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "models":
        return "models"
    return parts[1] if parts[0] == "graph_trainer" and len(parts) > 1 else None


def _imports(path: Path) -> list[str]:
    """Modules imported by `path`, leaving out imports under `if TYPE_CHECKING:` (they never run)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name.removesuffix(".__init__")


def test_the_table_covers_every_folder_and_top_level_module():
    rows = _rows()
    units = {_unit(_module_name(p)) for p in (REPO / "graph_trainer").rglob("*.py")} - {None}
    units -= {m.split(".")[1] for m in ENTRY_POINTS if m.count(".") == 1} | {"__init__"}  # top-level modules
    units.discard("configs")
    assert units <= set(rows), f"not in docs/architecture.md's table: {sorted(units - set(rows))}"
    assert "models" in rows


def test_every_import_follows_the_table():
    allowed = _closure(_rows())
    broken = []
    for path in sorted([*(REPO / "graph_trainer").rglob("*.py"), *(REPO / "models").rglob("*.py")]):
        module = _module_name(path)
        unit = "models" if module.startswith("models") else _unit(module)
        if module in ENTRY_POINTS or unit is None or str(path.relative_to(REPO)) in ALIASES:
            continue
        for imported in _imports(path):
            target = _unit(imported)
            if target is not None and target != unit and target not in allowed[unit]:
                broken.append(f"{path.relative_to(REPO)} imports {imported} ({unit} may not import {target})")
    assert not broken, "\n".join(broken)


def test_models_import_nothing_from_graph_trainer():
    for path in (REPO / "models").rglob("*.py"):
        assert not [m for m in _imports(path) if m.split(".")[0] == "graph_trainer"], path


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (function-level imports included: they run too). `from package
    import module` is an edge to that module, not to the package's `__init__` (which Python runs first for any of
    its modules, and which may import them back to re-export their names)."""
    paths = [*(REPO / "graph_trainer").rglob("*.py"), *(REPO / "models").rglob("*.py")]
    modules = {_module_name(p): p for p in paths}
    graph = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named = [f"{node.module}.{a.name}" for a in node.names]
                targets |= {n for n in named if n in modules} or {node.module}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[module] = {_project_module(t, modules) for t in targets} - {module, None}
    return graph


def _project_module(name: str, modules: dict) -> str | None:
    """The project module `name` is, or lies in (a name imported from it); None outside the project."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_no_module_imports_itself_through_others():
    """No import cycle: each module can be read (and loaded) after the ones it imports. A cycle ties two modules'
    concepts together so that neither can move alone (checkpoint/single_file.py and sharded.py were one)."""
    import graphlib

    try:
        tuple(graphlib.TopologicalSorter(_import_graph()).static_order())
    except graphlib.CycleError as e:
        # graphlib lists the cycle along its predecessor edges: reversed, each module imports the next
        pytest.fail(f"import cycle: {' imports '.join(reversed(e.args[1]))}")


def _step_fields() -> set[str]:
    """The attributes the executor's step (`tracer/executor.py`'s `GraphStep`) sets on itself."""
    tree = ast.parse((REPO / "graph_trainer" / "tracer" / "executor.py").read_text())
    step = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "GraphStep")
    return {
        t.attr
        for n in ast.walk(step)
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else [])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def test_the_planner_names_no_pass_and_sets_no_field_of_a_step():
    """The planner reaches the graph through the stage API (`graph_trainer.stages`): nothing in plan/ names a
    registered pass (their order and names are the pipeline's) or sets a field of the executor's step (it once set
    `step.transform = None` to get a raw trace)."""
    from graph_trainer.passes import available_passes

    names, fields = set(available_passes()), _step_fields()
    assert "transform" in fields
    for path in (REPO / "graph_trainer" / "plan").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and node.value in names:
                pytest.fail(f"{where} names the pass {node.value!r}")
            for target in node.targets if isinstance(node, ast.Assign) else []:
                if isinstance(target, ast.Attribute) and target.attr in fields:
                    if not (isinstance(target.value, ast.Name) and target.value.id == "self"):
                        pytest.fail(f"{where} sets the step's field: {ast.unparse(target)}")


PARALLELISM_NAMES = {"tp", "ep", "fsdp", "dp_shard", "dp_replicate", "hsdp", "cp", "pp"}
# What still names a parallelism in code outside distributed/ (its home) and job_config/ (option validation), and
# how often: issue 30 moves these into the parallelism classes. The counts may only fall; a file reaching 0 leaves.
STILL_NAMING: dict[str, int] = {}


def _parallelism_names(path: Path) -> list[int]:
    """Lines of `path` whose code (not comments or docstrings) names a parallelism: an identifier, attribute,
    keyword argument or plain string equal to one of PARALLELISM_NAMES."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and ast.get_docstring(n, clean=False) is not None
    }
    lines = []
    for n in ast.walk(tree):
        name = (
            n.attr
            if isinstance(n, ast.Attribute)
            else n.id
            if isinstance(n, ast.Name)
            else n.arg
            if isinstance(n, ast.keyword)
            else n.value
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
            else None
        )
        if name in PARALLELISM_NAMES:
            lines.append(n.lineno)
    return lines


def test_nothing_outside_distributed_names_a_parallelism_and_the_files_left_to_move_only_shrink():
    """A parallelism's facts live in its class (`distributed/parallelism.py`): what the mesh, the search, the cost
    model and the messages need is derived from the registered parallelisms. Option validation (job_config/) may
    name them. STILL_NAMING lists what is left to move, as a ratchet: no new file, no new mention."""
    found = {}
    for path in sorted((REPO / "graph_trainer").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel.startswith(("graph_trainer/distributed/", "graph_trainer/job_config/")):
            continue
        lines = _parallelism_names(path)
        if lines:
            found[rel] = lines
    for rel, lines in found.items():
        allowed = STILL_NAMING.get(rel, 0)
        assert len(lines) <= allowed, f"{rel} names a parallelism on lines {lines} ({len(lines)}, allowed {allowed})"
    stale = {rel: n for rel, n in STILL_NAMING.items() if len(found.get(rel, [])) < n}
    assert not stale, f"fewer mentions left than STILL_NAMING says: lower its counts {stale}"
