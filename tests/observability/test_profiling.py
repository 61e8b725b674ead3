"""Issue 22.5 through the command line: profiler traces, CUDA memory snapshots, the CPU memory timeline.

- `profiling.enable_profiling` writes step N's torch.profiler Chrome trace under the dump folder;
- `profiling.enable_memory_snapshot` on CPU writes step N's memory timeline: live bytes at every node of
  the step graph, the static estimate against the measurement (equal to the byte on CPU), as JSON and PNG,
  with the peak node and its module; on CUDA, the allocator's snapshot (a `gpu` test);
- without matplotlib, asking for the CPU timeline is one line and exit 2, before anything is written.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch

from graph_trainer.checkpoint.run_folder import Manifest
from tests.checkpoint.test_run_folder import REPO, TINY, cli, one_line_error
from tests.extras import import_extra

PROFILE = ["--profiling.profile_freq", "2", "--training.steps", "2"]


@pytest.mark.integration  # one short training run
def test_profiling_writes_the_chrome_trace_and_the_cpu_memory_timeline_where_estimate_equals_measurement(tmp_path):
    import_extra("matplotlib")
    import matplotlib.image

    dump = tmp_path / "run"
    args = ["--profiling.enable_profiling", "true", "--profiling.enable_memory_snapshot", "true"]
    proc = cli(*PROFILE, *args, "--job.dump_folder", str(dump), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    trace = dump / "profile_traces" / "iteration_2" / "rank0_trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)  # the step's matmuls, as the profiler saw them
    assert not (dump / "profile_traces" / "iteration_1").exists()  # step 1 was the warm-up, not written

    folder = dump / "memory_snapshot" / "iteration_2"
    doc = json.loads((folder / "rank0_memory_timeline.json").read_text())
    nodes = doc["nodes"]
    compared = [n for n in nodes if n["measured_bytes"] is not None]
    assert doc["nodes_compared"] == len(compared) > 100  # every op the graph dispatched was lined up
    assert doc["max_abs_difference_bytes"] == 0  # the CPU estimate is exact, node by node
    assert doc["estimated_peak"] == doc["measured_peak"]
    peak = doc["estimated_peak"]
    assert nodes[peak["index"]]["name"] == peak["node"] and peak["bytes"] == max(n["measured_bytes"] for n in compared)
    assert {n["phase"] for n in nodes} >= {"forward", "backward"}
    # The step's whole peak (summary.json) also counts the eager AdamW update after the graph: never less.
    step2 = json.loads((dump / "summary.json").read_text())["steps"][1]
    assert doc["outside_graph_bytes"] > 0 and step2["peak_active_bytes"] >= peak["bytes"]

    pixels = matplotlib.image.imread(folder / "rank0_memory_timeline.png")
    assert pixels.shape[0] > 400 and pixels.shape[1] > 1000
    owned = Manifest.read(dump)
    assert owned is not None and all(owned.owns(p) for p in (trace, folder / "rank0_memory_timeline.png"))


def test_the_cpu_memory_timeline_without_matplotlib_is_one_line_telling_how_to_install(tmp_path):
    no_matplotlib = "import sys; sys.modules['matplotlib'] = None; from graph_trainer.__main__ import main; " + (
        "sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", no_matplotlib, *TINY, "--profiling.enable_memory_snapshot", "true"]
        + ["--job.dump_folder", str(tmp_path / "run")],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    one_line_error(proc, "pip install 'graph_trainer[plots]' (matplotlib), or set profiling.enable_memory_snapshot")
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_run_writes_the_allocator_snapshot_of_the_profiled_step(tmp_path):
    dump = tmp_path / "run"
    proc = cli(*PROFILE, "--profiling.enable_memory_snapshot", "true", "--job.dump_folder", str(dump), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(dump / "memory_snapshot" / "iteration_2" / "rank0_memory_snapshot.pickle", "rb") as f:
        snapshot = pickle.load(f)  # our own file, just written
    assert snapshot["segments"] and any(trace for trace in snapshot["device_traces"])  # the recorded history
    assert not list((dump / "memory_snapshot").rglob("*.png"))  # on CUDA, the allocator's snapshot instead


def test_dispatched_ops_line_up_with_the_graph_nodes_even_with_ops_around_them():
    from graph_trainer.observability.memory_timeline import measured_per_node
    from graph_trainer.step import GraphNode

    mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor
    nodes = [
        GraphNode("x", "placeholder", "", None, 10),
        GraphNode("mm", "mm", "layer", "forward", 20, mm),
        GraphNode("getitem", "getitem", "layer", "forward", 20),
        GraphNode("add", "add", "layer", "backward", 30, add),
    ]
    ops = [(add, 1), (mm, 21), (add, 31), (mm, 5)]  # an op before the graph and one after it
    assert measured_per_node(nodes, ops) == [None, 21, None, 31]
    assert measured_per_node(nodes, [(add, 1)]) is None  # a compiled graph: nothing lines up
