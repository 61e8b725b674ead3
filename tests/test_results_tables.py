"""Every table in the docs says where its figures come from, and a table of measured figures quotes its results file.

See benchmarks/results.py for the three markers: `<!-- results: NAME#TABLE -->`, `<!-- results pending: NAME#TABLE;
why -->` and `<!-- not measured: why -->`, on the line before a table. The test only reads files.
"""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import results

TABLES = [t for page in results.PAGES for t in results.doc_tables(page)]
QUOTES = [t for t in TABLES if results.MARKER.match(t.marker)]
PENDING = [t for t in TABLES if results.PENDING.match(t.marker)]


def test_every_table_says_where_its_figures_come_from():
    unmarked = [
        t.where
        for t in TABLES
        if not any(m.match(t.marker) for m in (results.MARKER, results.PENDING, results.NOT_MEASURED))
    ]
    assert not unmarked, (
        "tables with no marker on the line before them: " + ", ".join(unmarked) + ". Measured figures: "
        "`<!-- results: NAME#TABLE -->` and the table its benchmark saved (benchmarks/results.py); anything else: "
        "`<!-- not measured: why -->`"
    )


@pytest.mark.parametrize("table", QUOTES, ids=[t.where for t in QUOTES])
def test_doc_table_quotes_its_results_file(table):
    name, key = table.quoted()
    path = results.RESULTS / f"{name}.json"
    assert path.is_file(), f"{table.where} quotes {name}.json, which no benchmark has written"
    record = results.load(name)
    for field in ("command", "commit", "date", "machine", "torch"):
        assert record.get(field), f"{name}.json has no {field}"
    assert key in record["tables"], f"{table.where}: {name}.json has no table {key!r}"
    assert table.text == record["tables"][key].strip(), (
        f"{table.where} differs from {name}.json#{key}: re-run `{record['command']}`, then "
        "`python -m benchmarks.results`"
    )


def _pending_table_names_the_benchmark_that_writes_it(table: results.DocTable) -> None:
    name, key = table.quoted()
    command, module = results.PENDING.match(table.marker).group(3, 4)
    path = results.RESULTS / f"{name}.json"
    assert not path.is_file() or key not in results.load(name)["tables"], (
        f"{table.where}: {name}.json#{key} exists now: run `python -m benchmarks.results` to quote it"
    )
    source = results.REPO / "benchmarks" / f"{module}.py"
    assert source.is_file(), f"{table.where}: `{command}` names no benchmark under benchmarks/"
    text = source.read_text()
    # It writes NAME: the literal first argument of its save() or show(), or the name the command passes to --save.
    writes_it = re.search(rf'(results\.)?(save|show)\(\s*"{re.escape(name)}"', text)
    assert writes_it or f"--save {name}" in command, f"{table.where}: `{command}` does not write {name}.json"


def test_pending_tables_name_the_benchmark_that_writes_them(tmp_path):
    """Every pending table of the docs (none, once every benchmark has run where it should), and one written
    here so that the rule is exercised even then: its command names a benchmark that writes its file."""
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- results pending: budget_policy#not_yet; `python -m benchmarks.budget_policy`; figures as of now -->\n"
        "| a |\n|---|\n| 1 |\n"
    )
    (written,) = results.doc_tables(page)
    for table in [*PENDING, written]:
        _pending_table_names_the_benchmark_that_writes_it(table)
    wrong = results.doc_tables(page)[0]
    wrong = type(wrong)(wrong.page, wrong.line, wrong.marker.replace("budget_policy`", "no_such_bench`"), wrong.text)
    with pytest.raises(AssertionError, match="names no benchmark"):
        _pending_table_names_the_benchmark_that_writes_it(wrong)


def test_markers_find_their_tables(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- results: x#t -->\n| a |\n|---|\n| 1 |\n\ntext\n\n| b |\n|---|\n\n<!-- not measured: options -->\n| c |\n"
    )
    found = [(t.line, t.marker, t.text, t.quoted()) for t in results.doc_tables(page)]
    assert found == [
        (2, "<!-- results: x#t -->", "| a |\n|---|\n| 1 |", ("x", "t")),
        (8, "", "| b |\n|---|", None),
        (12, "<!-- not measured: options -->", "| c |", None),
    ]


def test_update_docs_quotes_the_file_and_ends_pending(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(results, "REPO", tmp_path)
    # The file as save() writes it, less the provenance (save() would import torch for its version: seconds).
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "bench.json").write_text(
        json.dumps({"tables": {"t": results.markdown_table(["a"], [[2]])}})
    )
    page = tmp_path / "page.md"
    page.write_text(
        "x\n<!-- results pending: bench#t; `python -m benchmarks.bench`; abc1234 -->\n| a |\n|---|\n| 1 |\ny\n"
    )
    assert results.update_docs([page]) == ["page.md:3"]
    assert page.read_text() == "x\n<!-- results: bench#t -->\n| a |\n|---|\n| 2 |\ny\n"
    assert results.update_docs([page]) == []
