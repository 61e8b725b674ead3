"""Issue 22.6 through the command line: one run per folder, a full disk, checkpoints that run no code.

- A second run into a folder that a live run holds is refused in one line naming the holder's pid (exit 2);
  after `kill -9` of the holder the rerun trains. With 2 ranks, rank 0 holds the lock and both ranks
  refuse with the same line.
- A write that fails as on a full disk (ENOSPC injected by `tests.faults` into the real trainer's
  checkpoint, summary, manifest or TensorBoard writes, or into one rank of a 2-rank DCP save) stops the
  run with one line naming the folder and the cause, exit 74; no partial file is left, the earlier
  checkpoint is kept, and summary.json says `write_failed` (or the line says it could not).
- A checkpoint whose pickle would create a file is refused in one line and the file is not created: a
  single-file one, and a sharded one's tampered `.metadata` on a 2-rank resume (every rank refuses).
  (tests/test_fsdp_checkpoint.py checks that DCP holds no bytes item, and `export` on a tampered one.)

The 2-rank runs are launched as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR), one process per rank, so
that each rank's exit code and message can be checked.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from graph_trainer.checkpoint.dcp_reader import read_dcp_metadata
from tests.checkpoint.test_run_folder import REPO, TINY, cli, one_line_error
from tests.extras import child_pythonpath
from tests.multiprocess import free_port
from tests.test_run_lifecycle import CKPT, start, wait_for_step

EXIT_WRITE_FAILED = 74
ONE_LAYER = ["--model.n_layers", "1"]  # the cheapest model that still checkpoints every kind of state


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1", **extra}


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """The trainer's command line through `tests.faults` (which injects nothing unless `GT_ENOSPC` is set)."""
    command = [sys.executable, "-m", "tests.faults", *TINY, *ONE_LAYER, *args]
    return subprocess.run(command, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=600)


def _final(dump: Path) -> dict:
    return json.loads((dump / "summary.json").read_text())["final"]


def _leftovers(dump: Path) -> list[str]:
    """Temp files or folders of an atomic write that did not complete."""
    return sorted(str(p.relative_to(dump)) for p in dump.rglob("*.tmp"))


# --- one run per folder -----------------------------------------------------------------------------------


_HOLD = (
    "import sys, time; from pathlib import Path; from graph_trainer.runtime.folder_lock import lock_folder; "
    "assert lock_folder(Path(sys.argv[1])) is None; print('held', flush=True); time.sleep(600)"
)


def _two_ranks(args: list[str], cwd: Path, **env: str) -> list[subprocess.CompletedProcess]:
    """The trainer's command line (through `tests.faults`) as ranks 0 and 1 of one job, launched as torchrun
    would, but each watched on its own: torchrun stops the other ranks once one has exited, which would race
    with what they print."""
    launch = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **env}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.faults", *TINY, *ONE_LAYER, "--parallelism.dp_shard", "2", *args],
            cwd=cwd,
            env=_env(RANK=str(rank), LOCAL_RANK=str(rank), **launch),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    done = [(p, *p.communicate(timeout=600)) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, out, err in done]


def _same_line_from_every_rank(ranks: list[subprocess.CompletedProcess], code: int, start: str) -> None:
    """Every rank exited with `code` and printed one line, the same on all, starting with `start`."""
    for proc in ranks:
        assert proc.returncode == code, proc.stderr[-3000:]
        assert proc.stderr.startswith(start) and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert len({proc.stderr for proc in ranks}) == 1


@pytest.mark.integration  # a training run, a refused run on one and on two ranks, a rerun after kill -9
def test_a_held_folder_is_refused_naming_the_pid_on_one_and_two_ranks_and_kill_9_frees_it(tmp_path):
    dump = tmp_path / "run"
    holder = start("--training.steps", "100000", "--job.dump_folder", str(dump), cwd=tmp_path)
    line = f"error: job.dump_folder '{dump}' is in use by another run (pid {holder.pid}); "
    try:
        wait_for_step(holder, 1)
        before = {p: p.read_bytes() for p in dump.rglob("*") if p.is_file() and p.suffix == ".pt"}
        second = cli("--training.steps", "1", "--job.dump_folder", str(dump), "--job.overwrite", "true", cwd=tmp_path)
        one_line_error(second, line.removeprefix("error: "))
        # Two ranks: rank 0 holds the lock, both learn of the refusal through the process group.
        _same_line_from_every_rank(_two_ranks(["--job.dump_folder", str(dump)], tmp_path), 2, line)
        assert holder.poll() is None  # the holder trains on, its files untouched
        assert {p: p.read_bytes() for p in before} == before
    finally:
        holder.kill()  # SIGKILL: no handler runs; the kernel drops the lock with the process
        holder.communicate()
    rerun = cli("--training.steps", "1", "--job.dump_folder", str(dump), "--job.overwrite", "true", cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert _final(dump)["status"] == "ok"


# --- a full disk --------------------------------------------------------------------------------------------


@pytest.mark.integration  # one short run per kind of write
@pytest.mark.parametrize(
    "pattern, extra, failed, summary_written",
    [
        # step 1's checkpoint is written, step 2's finds the disk full
        (r"step-00000002\.pt", [], "step-00000002.pt in {dump}/checkpoint", True),
        # the first summary.json (step 1): it cannot record its own failure either
        (r"summary\.json", [], "summary.json in {dump}", False),
        # the manifest, the run's very first write: the run stops before its first step
        (r"run_manifest\.json", [], "run_manifest.json in {dump}", False),
        # TensorBoard's event file, written by its own thread
        (r"tfevents", ["--metrics.enable_tensorboard", "true"], "in {dump}/tb", True),
    ],
    ids=["checkpoint", "summary", "manifest", "tensorboard"],
)
def test_a_full_disk_stops_the_run_in_one_line_and_keeps_every_earlier_checkpoint(
    tmp_path, pattern, extra, failed, summary_written
):
    dump = tmp_path / "run"
    proc = _run([*CKPT, "--training.steps", "2", *extra, "--job.dump_folder", str(dump)], tmp_path, GT_ENOSPC=pattern)
    assert proc.returncode == EXIT_WRITE_FAILED, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr
    assert line.startswith(f"error: writing {failed.format(dump=dump)} failed: No space left on device [ENOSPC]")
    assert _leftovers(dump) == []
    checkpoints = sorted(p.name for p in (dump / "checkpoint").glob("step-*")) if (dump / "checkpoint").is_dir() else []
    if pattern.startswith("step"):
        assert checkpoints == ["step-00000001.pt"]
        assert "every earlier checkpoint is kept, the latest" in line and "--checkpoint.resume" in line
        torch.load(dump / "checkpoint" / "step-00000001.pt", weights_only=True)  # complete and readable
    else:
        assert checkpoints == [] and "no checkpoint was saved" in line
    if summary_written:
        final = _final(dump)
        assert final["status"] == "write_failed" and final["message"] == line.removeprefix("error: ").strip()
    else:
        assert "summary.json could not record this either" in line
        if pattern.startswith("summary"):
            assert not (dump / "summary.json").exists()


_SHARDED = [*CKPT, "--training.steps", "2"]


@pytest.fixture(scope="module")
def full_disk_on_rank_1(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """2 ranks, a checkpoint every step; rank 1's shard file of step 2 meets a full disk (rank 0 writes its own
    part and .metadata normally)."""
    tmp = tmp_path_factory.mktemp("full_disk_dcp")
    dump = tmp / "run"
    ranks = _two_ranks(
        [*_SHARDED, "--job.dump_folder", str(dump)],
        tmp,
        GT_ENOSPC=r"step-00000002\.dcp.*\.distcp",
        GT_ENOSPC_RANK="1",
    )
    return dump, ranks


@pytest.mark.integration  # a torchrun launch of two ranks
def test_a_full_disk_on_one_rank_of_a_sharded_save_stops_both_ranks_and_keeps_the_earlier_checkpoint(
    full_disk_on_rank_1,
):
    dump, ranks = full_disk_on_rank_1
    line = f"error: writing step-00000002.dcp in {dump}/checkpoint failed: No space left on device (rank 1)"
    _same_line_from_every_rank(ranks, EXIT_WRITE_FAILED, line)
    assert _final(dump)["status"] == "write_failed" and _final(dump)["final_step"] == 2
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-00000001.dcp"]  # no torn step 2
    metadata = read_dcp_metadata(dump / "checkpoint" / "step-00000001.dcp" / ".metadata")  # complete, readable
    assert len(metadata.state_dict_metadata) > 0


@pytest.mark.integration  # a torchrun launch of two ranks
def test_a_tampered_dcp_metadata_is_refused_on_resume_by_every_rank_and_runs_nothing(full_disk_on_rank_1, tmp_path):
    dump, _ = full_disk_on_rank_1
    marker = tmp_path / "created_by_the_checkpoint"
    metadata_file = dump / "checkpoint" / "step-00000001.dcp" / ".metadata"
    with open(metadata_file, "rb") as f:
        metadata = pickle.load(f)  # our own file, written by the fixture's run
    metadata.planner_data = CreatesAFile(marker)
    with open(metadata_file, "wb") as f:
        pickle.dump(metadata, f)
    ranks = _two_ranks([*_SHARDED, "--job.dump_folder", str(dump), "--checkpoint.resume"], tmp_path)
    _same_line_from_every_rank(ranks, 2, f"error: {metadata_file} asks to run io.open while being read, which")
    assert not marker.exists()


# --- checkpoints run no code --------------------------------------------------------------------------------


class CreatesAFile:
    """Unpickled by plain pickle, this would create `path`: the payload of a tampered checkpoint."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


@pytest.mark.integration  # the refusal comes after the step was planned (preflight), as for any resume
def test_a_single_file_checkpoint_holding_a_pickle_payload_is_refused_and_runs_nothing(tmp_path):
    dump, marker = tmp_path / "run", tmp_path / "created_by_the_checkpoint"
    (dump / "checkpoint").mkdir(parents=True)
    bad = dump / "checkpoint" / "step-00000001.pt"
    torch.save({"model": CreatesAFile(marker), "step": 1}, bad)
    proc = cli("--checkpoint.enable", "true", "--checkpoint.resume", "--job.dump_folder", str(dump), cwd=tmp_path)
    one_line_error(proc, f"{bad} asks to run io.open while being read, which a checkpoint never does")
    assert not marker.exists()


def test_the_lock_refusal_names_the_holder_read_from_proc_locks(tmp_path):
    """Unit check of the pid lookup (the CLI tests above use it end to end): a child holds, we see its pid."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        from graph_trainer.runtime.folder_lock import lock_folder, release_folder

        assert lock_folder(tmp_path) == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
    deadline = time.monotonic() + 10
    while lock_folder(tmp_path) is not None and time.monotonic() < deadline:  # the kernel drops it at exit
        time.sleep(0.05)
    assert lock_folder(tmp_path) is None  # held by this process now; taking it again is a no-op
    release_folder(tmp_path)
