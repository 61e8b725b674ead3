"""Results files: every table of measured figures in README.md and docs/ is quoted from one of these.

A benchmark that measures something a page shows calls `save(name, tables, data)` at the end of its run.
That writes `benchmarks/results/<name>.json` with what produced it (the command, the commit, the date, the
machine, the torch version), the raw figures (`data`) and each table already rendered as markdown (`tables`).

A page quotes a table by putting the marker `<!-- results: NAME#TABLE -->` on the line before it and the
rendered table right after it. `tests/test_results_tables.py` holds every marker's table equal to the file's,
and every other table with figures in the docs to an explicit `<!-- not measured: why -->` marker. So a
figure changes in the docs only by re-running its benchmark, and the file says when, where and how.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent
# `<!-- results: NAME#TABLE -->`: the table after this line is TABLE of benchmarks/results/NAME.json.
MARKER = re.compile(r"^<!-- results: ([\w.-]+)#([\w.-]+) -->$")


def _commit() -> str:
    """HEAD's short hash, with `+dirty` when tracked files differ from it (a figure from uncommitted code)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO, capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine() -> str:
    """The machine in words: the accelerator if one is used, else the CPU and its core count."""
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


def load(name: str) -> dict:
    """The record `save(name, ...)` wrote."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def _module_of(script: str) -> str:
    """`benchmarks/plan_time.py` (or its absolute path) as the module name `benchmarks.plan_time`."""
    path = Path(script).resolve()
    try:
        return ".".join(path.relative_to(REPO).with_suffix("").parts)
    except ValueError:
        return path.stem
