"""Results files: every table of measured figures in README.md and docs/ is quoted from one of these.

A benchmark that measures something a page shows calls `save(name, tables, data)` at the end of its run.
That writes `benchmarks/results/<name>.json` with what produced it (the command, the commit, the date, the
machine, the torch version), the raw figures (`data`) and each table already rendered as markdown (`tables`).

Every table on the pages in `PAGES` has one of three markers on the line before it:

- `<!-- results: NAME#TABLE -->`: the table is TABLE of benchmarks/results/NAME.json, character for character;
- `<!-- results pending: NAME#TABLE; `python -m benchmarks.MODULE ...`; WHERE THE FIGURES SHOWN CAME FROM -->`:
  that command writes TABLE of NAME but has not run where its figures mean something yet (times need an idle
  machine); the figures shown are dated by the marker, which becomes `results:` once NAME.json exists;
- `<!-- not measured: WHY -->`: the table holds no measured figures (options, layouts, claims held by tests).

`tests/test_results_tables.py` holds every page to that. So a figure changes in the docs only by re-running its
benchmark, and the file says when, where and how. `python -m benchmarks.results` rewrites every marked table
(pending ones included) from the results files present, after a benchmark has run; `--pending` lists the commands
the pending tables wait for.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent
# `<!-- results: NAME#TABLE -->`: the table after this line is TABLE of benchmarks/results/NAME.json.
MARKER = re.compile(r"^<!-- results: ([\w.-]+)#([\w.-]+) -->$")
# `<!-- results pending: NAME#TABLE; `COMMAND`; where from -->`: COMMAND writes it, but has not run where it should.
PENDING = re.compile(r"^<!-- results pending: ([\w.-]+)#([\w.-]+); `(python -m benchmarks\.(\w+)[^`]*)`; (\S.*) -->$")
# `<!-- not measured: why -->`: a table of options, files or claims, no figure a benchmark measures.
NOT_MEASURED = re.compile(r"^<!-- not measured: (\S.*) -->$")
# The pages whose tables are held to the markers. docs/configuration.md is generated from the schema (its tables
# are the options, and tests/test_docs.py holds them equal to it), so it holds no figure to mark.
PAGES = sorted(
    [REPO / "README.md", REPO / "models" / "README.md", REPO / "graph_trainer" / "passes" / "README.md"]
    + [p for p in (REPO / "docs").glob("*.md") if p.name != "configuration.md"]
)


@dataclass(frozen=True)
class DocTable:
    """One markdown table on a page: where it starts (1-based), the marker line before it, and its text."""

    page: Path
    line: int
    marker: str
    text: str

    @property
    def where(self) -> str:
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page}:{self.line}"

    def quoted(self) -> tuple[str, str] | None:
        """(results name, table name) when the marker is a results or pending marker, else None."""
        m = MARKER.match(self.marker) or PENDING.match(self.marker)
        return (m.group(1), m.group(2)) if m else None


def doc_tables(page: Path) -> list[DocTable]:
    """Every markdown table on `page` (a run of lines starting with `|`), with the line before it."""
    lines = page.read_text().splitlines()
    tables = []
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            end = next((j for j in range(i, len(lines)) if not lines[j].startswith("|")), len(lines))
            marker = lines[i - 1].strip() if i else ""
            tables.append(DocTable(page, i + 1, marker, "\n".join(lines[i:end])))
    return tables


def _commit() -> str:
    """HEAD's short hash, with `+dirty` when tracked files other than results differ from it (a figure from
    uncommitted code)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        # Results files rewritten by earlier benchmarks of the same run are not code: they do not make it dirty.
        dirty = (
            subprocess.run(
                ["git", "diff", "--quiet", "HEAD", "--", ".", ":!benchmarks/results"], cwd=REPO, capture_output=True
            ).returncode
            != 0
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine() -> str:
    """The machine in words: the accelerator if one is used, else the CPU and its core count."""
    import torch  # here, not at the top: tests/test_results_tables.py reads files and should not pay for torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; each cell as str() gives it (format figures before passing them)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save(
    name: str, tables: dict[str, str], data: object, argv: Sequence[str] | None = None, folder: Path | None = None
) -> Path:
    """Write benchmarks/results/<name>.json (or `folder`/<name>.json: a test's run, kept out of the repository):
    provenance, the raw `data` and the rendered `tables`."""
    import torch

    argv = sys.argv if argv is None else argv
    folder = RESULTS if folder is None else folder
    record = {
        "command": "python -m " + _module_of(argv[0]) + "".join(" " + a for a in argv[1:]),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "torch": torch.__version__,
        "tables": tables,
        "data": data,
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"results: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return path


def show(name: str, tables: dict[str, str], data: object, *, save_it: bool) -> None:
    """Print each table; with `save_it` (a benchmark's `--save`), also `save` them as NAME."""
    for table in tables.values():
        print(table)
    if save_it:
        save(name, tables, data)


def load(name: str) -> dict:
    """The record `save(name, ...)` wrote."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def update_docs(pages: Sequence[Path] = PAGES) -> list[str]:
    """Rewrite each results or pending table whose results file exists with the file's table; the places changed.

    A pending marker whose file now exists becomes a results marker. Run it after a benchmark has saved.
    """
    changed = []
    for page in pages:
        text = page.read_text()
        for table in doc_tables(page):
            quoted = table.quoted()
            if quoted is None or not (RESULTS / f"{quoted[0]}.json").is_file():
                continue
            rendered = load(quoted[0])["tables"].get(quoted[1])
            if rendered is None and PENDING.match(table.marker):
                continue  # the file is another run's (e.g. without --best): this table still waits for its own
            if rendered is None:
                raise KeyError(f"{table.where}: {quoted[0]}.json has no table {quoted[1]!r}")
            marker = f"<!-- results: {quoted[0]}#{quoted[1]} -->"
            if (table.marker, table.text) != (marker, rendered.strip()):
                old = table.marker + "\n" + table.text + "\n"
                text = text.replace(old, marker + "\n" + rendered.strip() + "\n", 1)
                changed.append(table.where)
        if text != page.read_text():
            page.write_text(text)
    return changed


def _module_of(script: str) -> str:
    """`benchmarks/plan_time.py` (or its absolute path) as the module name `benchmarks.plan_time`."""
    path = Path(script).resolve()
    try:
        return ".".join(path.relative_to(REPO).with_suffix("").parts)
    except ValueError:
        return path.stem


def pending_commands(pages: Sequence[Path] = PAGES) -> dict[str, list[str]]:
    """{command: the places of the pending tables it writes}, in the order the pages show them."""
    commands: dict[str, list[str]] = {}
    for page in pages:
        for table in doc_tables(page):
            m = PENDING.match(table.marker)
            if m:
                commands.setdefault(m.group(3), []).append(table.where)
    return commands


def main() -> None:
    """Rewrite the docs' marked tables from the results files, or list the commands pending tables wait for."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--pending", action="store_true", help="list the commands the pending tables wait for")
    if parser.parse_args().pending:
        for command, places in pending_commands().items():
            print(f"{command}  # {', '.join(places)}")
    else:
        for place in update_docs():
            print(f"updated {place}")


if __name__ == "__main__":
    main()
