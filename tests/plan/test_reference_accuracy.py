"""The accuracy table (`python -m benchmarks.reference_table`) on its smallest published row, so that the benchmark
cannot rot: Llama-3 8B on 8 H100s planned pinned to torchtitan's layout (depth-free, 32 blocks from short traces),
one line per published row of predicted / published tokens/s per GPU, the compile row marked, written through
`benchmarks.results.save` (captured here, so the repository's results file is left alone)."""

from __future__ import annotations

import sys

from benchmarks import reference_table
from graph_trainer.job_config.load import resolve_model_args


def test_accuracy_table_has_one_line_per_published_row(monkeypatch):
    saved, pinned = {}, []
    plan_pinned = reference_table.plan_pinned
    monkeypatch.setattr(reference_table, "plan_pinned", lambda *a: pinned.append(plan_pinned(*a)) or pinned[-1])
    capture = lambda name, tables, data: saved.update(name=name, tables=tables, data=data)  # noqa: E731
    monkeypatch.setattr(reference_table.results, "save", capture)
    monkeypatch.setattr(sys, "argv", ["reference_table", "--rows", "8b-8", "--memory", "false"])
    reference_table.main()

    published = reference_table.ROWS["8b-8"][-1]
    assert saved["name"] == "reference_table" and set(saved["tables"]) == {"throughput"}
    lines = saved["tables"]["throughput"].splitlines()[2:]  # past the header and its rule
    assert len(lines) == len(published) == len(saved["data"]) == 2
    for line, record, (label, tokens_published, _, _) in zip(lines, saved["data"], published, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:3] == ["8b-8", label, f"{tokens_published:,}"]
        ratio = record["predicted_tokens_per_gpu"] / tokens_published
        assert cells[4] == f"{ratio:.3f}" and record["ratio"] == ratio
        assert cells[5] == ("yes" if abs(ratio - 1) <= reference_table.GOAL else "no")
        assert (cells[6] == "no compile term") == ("compile" in label)
        # Each loss once: the step is its compute plus only the communication not hidden behind it.
        assert record["step_s"] == record["compute_s"] + record["exposed_comm_s"]
        assert record["counted_s"] < record["compute_s"]
    # The row is planned at its real depth (32 blocks) from short traces: the depth-free plan, not a whole trace.
    (row,) = pinned
    assert resolve_model_args(row.cfg).n_layers == 32 and 0 < row.row.exact.blocks_traced < 32
