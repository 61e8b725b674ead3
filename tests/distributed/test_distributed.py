"""Data parallelism over 2 processes (gloo on CPU): the gradient all-reduce is inside the one step graph.

Claims tested: traced == eager bitwise in a 2-process run (losses and params), with
the optimizer in the graph too; both ranks end with identical parameters; the
graph holds one `_c10d_functional.all_reduce` + `wait_tensor` per gradient, in the
backward phase; 2 ranks x batch 2 match 1 process x batch 4 closely (torchrun CLI,
estimate == measured on CPU); bad launches exit 2 with the cause and the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from graph_trainer.distributed.launch import check_launch, trainer_command
from graph_trainer.errors import UserError
from graph_trainer.job_config.cli import load_config
from graph_trainer.tracer import node_meta
from graph_trainer.trainer import Trainer
from tests.multiprocess import assert_peaks_match, free_port, peaks, spawn_ranks, step_graph_nodes, train_runs
from tests.tiny import TINY as TINY_RUN

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with the gloo backend"
    ),
]

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
STEPS = 3
TINY = ["--config", "llama3_debug", *TINY_RUN, "--training.steps", str(STEPS)]
RUNS = {
    "eager": ["--compile.mode", "eager"],
    "trace": ["--compile.mode", "trace"],
    "trace_optimizer": ["--compile.mode", "trace", "--compile.trace_optimizer", "true"],
}
COLLECTIVES = ("_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default")
TIMEOUT_S = 120


def _worker(rank: int, port: int, out: str) -> None:
    """One rank: train every run in RUNS and write what the tests compare."""
    args = [*TINY, "--parallelism.dp_replicate", str(WORLD)]
    for name, trainer, result in train_runs(rank, WORLD, port, RUNS, args, out):
        collectives = [
            (str(n.target), node_meta.phase(n)) for n in step_graph_nodes(trainer) if "c10d" in str(n.target)
        ]
        record = {
            "losses": result.losses,
            "params": result.params_sha256,
            "grads": result.grads_sha256,
            "trace_count": result.trace_count,
            "collectives": collectives,
            "num_params": len(list(trainer.model.parameters())),
        }
        Path(out, f"{name}.rank{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    """Every run in RUNS trained by 2 spawned ranks: {run: [rank 0 record, rank 1 record]}."""
    out = tmp_path_factory.mktemp("dp2")
    spawn_ranks(_worker, WORLD, (free_port(), str(out)), TIMEOUT_S)
    return {name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)] for name in RUNS}


@pytest.mark.integration  # shares trainings on 2 spawned ranks
@pytest.mark.parametrize("mode", ["trace", "trace_optimizer"])
def test_two_ranks_traced_equal_eager_bitwise(two_ranks, mode):
    eager, traced = two_ranks["eager"][0], two_ranks[mode][0]
    assert len(traced["losses"]) == STEPS
    assert traced["losses"] == eager["losses"]
    assert traced["params"] == eager["params"]
    assert traced["grads"] == eager["grads"]
    assert traced["trace_count"] == 1


@pytest.mark.integration  # shares trainings on 2 spawned ranks
@pytest.mark.parametrize("mode", list(RUNS))
def test_both_ranks_end_with_identical_parameters(two_ranks, mode):
    rank0, rank1 = two_ranks[mode]
    assert rank0["params"] == rank1["params"]
    assert rank0["grads"] == rank1["grads"]
    assert rank0["losses"] == rank1["losses"]  # the logged loss is the global average


@pytest.mark.integration  # shares trainings on 2 spawned ranks
@pytest.mark.parametrize("mode", ["trace", "trace_optimizer"])
def test_step_graph_holds_one_all_reduce_per_gradient_in_the_backward(two_ranks, mode):
    rank0 = two_ranks[mode][0]
    targets = [t for t, _ in rank0["collectives"]]
    n = rank0["num_params"]
    assert targets.count(COLLECTIVES[0]) == n
    assert targets.count(COLLECTIVES[1]) == n
    assert {phase for _, phase in rank0["collectives"]} == {node_meta.BACKWARD}


@pytest.mark.integration  # a torchrun launch of two ranks
def test_torchrun_two_ranks_close_to_one_process_with_the_global_batch(tmp_path):
    """CLI under torchrun, 2 x batch 2, vs in-process 1 x batch 4: same losses up to summation order."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        *trainer_command(WORLD),
        *TINY,
        "--parallelism.dp_replicate",
        str(WORLD),
        "--metrics.track_memory",
        "true",
        "--job.dump_folder",
        str(tmp_path / "dp2"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "dp2" / "summary.json").read_text())
    assert summary["final"]["trace_count"] == 1
    assert_peaks_match(peaks(summary["steps"]))

    cfg, _ = load_config([*TINY, "--training.local_batch_size", "4", "--job.dump_folder", str(tmp_path / "dp1")])
    try:
        single = Trainer(cfg).train()
    finally:
        torch.use_deterministic_algorithms(False)
    losses = [s["loss"] for s in summary["steps"]]
    # The mean of the 2 ranks' mean losses against one mean over the 4 rows: another summation order, and the
    # gradients' all-reduce another order again. Measured 8.5e-8 relative at most over the 3 steps (one float32
    # ulp of a loss near 6); 1e-6 (about 12 ulp) leaves room for another machine's kernels.
    assert losses == pytest.approx(single.losses, rel=1e-6)


def _cli(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")} | env
    return subprocess.run(
        [sys.executable, "-m", "graph_trainer", *TINY, "--job.dump_folder", str(tmp_path), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("option", ["dp_shard", "dp_replicate"])
def test_dp_shard_without_torchrun_exits_2_naming_torchrun(tmp_path, option):
    proc = _cli(tmp_path, {}, f"--parallelism.{option}", "2")
    assert proc.returncode == 2
    assert f"error: parallelism.{option} = 2 needs one process per rank" in proc.stderr
    assert "torchrun --nproc_per_node 2 -m graph_trainer" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_world_size_not_dp_shard_exits_2_naming_both(tmp_path):
    proc = _cli(tmp_path, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert proc.returncode == 2
    assert "error: WORLD_SIZE = 2 (processes launched) but parallelism.dp_shard = 1" in proc.stderr
    assert "--parallelism.dp_shard 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_check_launch_reads_torchrun_env():
    cfg, _ = load_config([*TINY, "--parallelism.dp_shard", "2"])
    assert check_launch(cfg, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == (1, 2, 1)
    with pytest.raises(UserError, match="RANK 2 is outside WORLD_SIZE 2"):
        check_launch(cfg, {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    one, _ = load_config(TINY)
    assert check_launch(one, {}) == (0, 1, 0)


def test_trainer_without_process_group_refuses_dp_shard(tmp_path):
    cfg, _ = load_config([*TINY, "--parallelism.dp_shard", "2", "--job.dump_folder", str(tmp_path)])
    with pytest.raises(UserError, match="torchrun --nproc_per_node 2"):
        Trainer(cfg)


def test_dp_shard_with_dp_replicate_launches_as_hsdp_on_their_product_of_ranks():
    cfg, _ = load_config([*TINY, "--parallelism.dp_shard", "2", "--parallelism.dp_replicate", "2"])
    check_launch(cfg, {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})  # accepted: HSDP
    with pytest.raises(UserError, match="torchrun --nproc_per_node 4"):
        check_launch(cfg, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


# SIGTERM raised in the middle of the command line's first import, as torchrun sends it to a rank that is still
# importing when another rank has refused the launch. Deterministic: the signal is sent from inside the import.
_SIGTERM_WHILE_IMPORTING = """
import builtins, os, signal, sys
from graph_trainer.__main__ import main
from graph_trainer.runtime.interrupts import unwind_on_sigterm
unwind_on_sigterm()
real_import = builtins.__import__
def import_then_sigterm(name, *args, **kwargs):
    if name.startswith("graph_trainer.job_config"):
        builtins.__import__ = real_import
        os.kill(os.getpid(), signal.SIGTERM)
    return real_import(name, *args, **kwargs)
builtins.__import__ = import_then_sigterm
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_the_command_line_imports_is_one_line_and_exit_143(tmp_path):
    """CI, round 4: a rank stopped by torchrun during its imports printed a traceback instead of one line."""
    args = ["--config", "llama3_debug.toml", "--job.dump_folder", str(tmp_path / "run")]
    proc = subprocess.run(
        [sys.executable, "-c", _SIGTERM_WHILE_IMPORTING, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert proc.stderr == "interrupted by SIGTERM\n"


@pytest.mark.integration  # a torchrun launch of two ranks
def test_torchrun_world_size_not_dp_shard_exits_2_in_one_line_per_rank(tmp_path):
    """A bad launch under torchrun exits 2 before joining a process group (no hang), in one line on every rank.

    The rank that checks first says why; torchrun then stops the others. A rank that was still importing says
    that it was stopped (one line, no traceback); one that got as far as the check says why, like the first.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # Each rank's stderr in its own file (--redirects 2): on one shared pipe the ranks' lines can interleave.
    cmd = [
        *trainer_command(WORLD, torchrun_args=["--log-dir", str(tmp_path / "logs"), "--redirects", "2"]),
        *TINY,
        "--parallelism.dp_shard",
        "4",
        "--job.dump_folder",
        str(tmp_path / "bad"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode != 0
    assert "exitcode  : 2" in proc.stderr
    line = "error: WORLD_SIZE = 2 (processes launched) but parallelism.dp_shard = 4; pass --parallelism.dp_shard 2"
    rank_logs = sorted((tmp_path / "logs").rglob("stderr.log"))
    assert len(rank_logs) == WORLD
    texts = [log.read_text() for log in rank_logs]
    assert any(line in text for text in texts), texts
    for text in texts:
        assert "Traceback" not in text, text[-2000:]
        said = [s for s in text.splitlines() if s.startswith(("error:", "interrupted"))]
        assert len(said) == 1 and (line in said[0] or said[0] == "interrupted by SIGTERM"), text[-2000:]


def _first_rank_answers(rank: int, port: int, out: str) -> None:
    """Rank 0's answer, or its exception, on both ranks; what each rank ran `make` for."""
    from graph_trainer.distributed.mesh import ParallelDims, build_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = build_mesh(ParallelDims(pp=2), rank, torch.device("cpu"))
        ran: list[int] = []

        def answer() -> dict:
            ran.append(rank)
            return {"from": rank}

        def refuse() -> None:
            ran.append(rank)
            raise UserError(f"refused by rank {rank}")

        def unpicklable() -> None:
            error = UserError("holds a lambda")
            error.hook = lambda: None  # pickle cannot send this
            raise error

        got = mesh.from_first_rank(answer)
        raised = []
        for make in (refuse, unpicklable):
            try:
                mesh.from_first_rank(make)
            except Exception as e:
                raised.append(f"{type(e).__name__}: {e}")
        Path(out, f"rank{rank}.json").write_text(json.dumps({"got": got, "raised": raised, "ran": ran}))
    finally:
        dist.destroy_process_group()


def test_rank_0s_answer_or_its_error_reaches_every_rank_and_no_other_rank_computes_it(tmp_path):
    """`Mesh.from_first_rank`, how a pipeline's ranks take one memory budget choice: the same answer on both ranks,
    computed by rank 0 alone, and rank 0's error raised on both (a rank left waiting would hang the job), in its own
    words where pickle cannot send it."""
    spawn_ranks(_first_rank_answers, 2, (free_port(), str(tmp_path)), timeout_s=60)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        raised = ["UserError: refused by rank 0", "RuntimeError: UserError: holds a lambda"]
        assert record == {"got": {"from": 0}, "raised": raised, "ran": [0, 0] if rank == 0 else []}
