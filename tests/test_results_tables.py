"""Tables of measured figures in the docs are quoted from the results files their benchmarks write.

See benchmarks/results.py for the convention: `<!-- results: NAME#TABLE -->` on the line before a table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import results

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [REPO / "README.md", REPO / "models" / "README.md", REPO / "graph_trainer" / "passes" / "README.md"]
    + list((REPO / "docs").glob("*.md"))
)


def quoted_tables(page: Path) -> list[tuple[int, str, str, str]]:
    """(line number, results name, table name, the table's text) for each results marker on `page`."""
    lines = page.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        m = results.MARKER.match(line.strip())
        if not m:
            continue
        table = []
        for row in lines[i + 1 :]:
            if not row.startswith("|"):
                break
            table.append(row)
        found.append((i + 1, m.group(1), m.group(2), "\n".join(table)))
    return found


QUOTES = [(page, *q) for page in PAGES for q in quoted_tables(page)]


@pytest.mark.parametrize(
    "page,line,name,table,text", QUOTES, ids=[f"{p.name}:{q[0]}" for p, *q in QUOTES] if QUOTES else None
)
def test_doc_table_quotes_its_results_file(page, line, name, table, text):
    where = f"{page.relative_to(REPO)}:{line}"
    path = results.RESULTS / f"{name}.json"
    assert path.is_file(), f"{where} quotes {name}.json, which no benchmark has written"
    record = results.load(name)
    for key in ("command", "commit", "date", "machine", "torch"):
        assert record.get(key), f"{name}.json has no {key}"
    assert table in record["tables"], f"{where}: {name}.json has no table {table!r}"
    assert text == record["tables"][table].strip(), f"{where} differs from {name}.json#{table}: re-run its benchmark"


def test_marker_needs_a_table_after_it(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- results: x#t -->\n| a |\n|---|\n| 1 |\n\ntext\n")
    assert quoted_tables(page) == [(1, "x", "t", "| a |\n|---|\n| 1 |")]
