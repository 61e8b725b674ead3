"""Checkpoints of an FSDP job (`parallelism.dp_shard`, DCP folders), over spawned gloo ranks on CPU.

Claims tested:
- save on 2 ranks, resume on 2: losses and every rank's final shards equal to an uninterrupted run (bitwise);
- save on 2 ranks, resume on 4 with the same global batch (and back to 2): the loss continues within
  rel 1e-5 of the uninterrupted 2-rank run and the full parameters within 1e-6 (summation order only). The runs read
  a parquet dataset (`data.source = "hf_datasets"`, the embedded corpus's lines): each sequence of the global
  batch reads its own rows whatever the data-parallel degree, so the resharded run reads on the same sequences;
- a different global batch, or a different model shape, is refused with one line (UserError);
- pruning (keep_latest_k) and --job.overwrite remove exactly the checkpoint folders the run recorded;
- `python -m graph_trainer.export` writes the full (unpadded) weights, equal to the gathered shards.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from graph_trainer.checkpoint.dcp_reader import read_dcp_metadata
from graph_trainer.checkpoint.run_folder import MANIFEST_FILE, Manifest, inspect
from graph_trainer.errors import UserError
from graph_trainer.job_config.cli import load_config
from graph_trainer.trainer import Trainer
from tests.distributed.test_fsdp import TINY, _max_diff
from tests.multiprocess import export_checkpoint, free_port, spawn_ranks, train_runs
from tests.test_run_safety import CreatesAFile

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.integration,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with the gloo backend"
    ),
]

REPO = Path(__file__).resolve().parents[2]
# No decay horizon, so a 2-step run resumed to 4 steps equals a 4-step run; local batch 2 on 2 ranks.
ARGS = [
    *TINY,
    "--training.steps",
    "4",
    "--lr_scheduler.decay_type",
    "none",
    "--compile.mode",
    "trace",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "1",
]
TIMEOUT_S = 300
DIM = "64"


def _save(out: str, name: str, trainer: Trainer, result, rank: int) -> None:
    Path(out, f"{name}.rank{rank}.json").write_text(
        json.dumps({"losses": result.losses, "params": result.params_sha256})
    )
    full = trainer.parallel.full_state()
    if rank == 0:
        torch.save(full, Path(out, f"{name}.params.pt"))


def _refused(cfg_args: list[str], info_args, out: str, name: str, rank: int) -> None:
    """Build a trainer that must refuse to resume; write the one-line message (rank 0)."""
    cfg, _ = load_config(cfg_args)
    try:
        Trainer(cfg, mesh=info_args)
        message = None
    except UserError as e:
        message = str(e)
    finally:
        torch.use_deterministic_algorithms(False)
    if rank == 0:
        Path(out, f"{name}.refused.txt").write_text(json.dumps(message))


def _worker(
    rank: int, world: int, port: int, out: str, runs: dict[str, list[str]], refusals: dict[str, list[str]], data: str
) -> None:
    args = [*ARGS, "--parallelism.dp_shard", str(world), "--data.source", "hf_datasets", "--data.path", data]

    def refuse(cfg) -> None:
        from graph_trainer.distributed.launch import init_distributed

        info = init_distributed(cfg)  # already joined: returns this rank's info
        for name, overrides in refusals.items():
            _refused([*args, *overrides], info, out, name, rank)

    for name, trainer, result in train_runs(rank, world, port, runs, args, out, before_leaving=refuse):
        _save(out, name, trainer, result, rank)


def _spawn(
    world: int, out: Path, runs: dict[str, list[str]], data: Path, refusals: dict[str, list[str]] | None = None
) -> None:
    spawn_ranks(_worker, world, (world, free_port(), str(out), runs, refusals or {}, str(data)), TIMEOUT_S)


def _documents(folder: Path) -> Path:
    """The embedded corpus's lines, one a row (uneven: 1 to a few hundred bytes), as a parquet dataset in `folder`:
    what the runs train on. After 2 steps each sequence of the batch stands at its own row and token, so a resume
    that gave a sequence another's position would read other tokens."""
    import datasets

    from graph_trainer.data.loader import embedded_documents

    path = folder / "documents.parquet"
    lines = [line for document in embedded_documents() for line in document.splitlines() if line.strip()]
    datasets.Dataset.from_dict({"text": lines}).to_parquet(str(path))
    return path


def _record(out: Path, name: str, rank: int = 0) -> dict:
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


def _refusal(out: Path, name: str) -> str:
    """The message a refused resume raised (see `_refused`), checked to be one line."""
    message = json.loads((out / f"{name}.refused.txt").read_text())
    assert message is not None and "\n" not in message
    return message


def _dump(folder: Path) -> list[str]:
    return ["--job.dump_folder", str(folder)]


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    """2 ranks: an uninterrupted 4-step run (keep_latest_k 2); a 2-step run resumed to 4 in its own folder
    (with the optimizer traced into the step); a resume with another model shape, refused."""
    out = tmp_path_factory.mktemp("dcp2")
    half = out / "half"
    keep = ["--checkpoint.keep_latest_k", "10"]  # the resharding runs start from its step 2
    _spawn(
        2,
        out,
        {
            "straight": ["--checkpoint.keep_latest_k", "2"],
            "first": ["--training.steps", "2", *keep, *_dump(half)],
            # the optimizer in the graph is bitwise equal to the eager one: its state must load as well
            "resumed": ["--checkpoint.resume", "true", "--compile.trace_optimizer", "true", *keep, *_dump(half)],
        },
        _documents(out),
        refusals={"other_shape": ["--model.dim", "32", "--checkpoint.resume", "true", *_dump(half)]},
    )
    return out


@pytest.fixture(scope="module")
def resharded(two, tmp_path_factory) -> Path:
    """The 2-rank step-2 checkpoint resumed on 4 ranks to step 3, then that one on 2 ranks to step 4."""
    out = tmp_path_factory.mktemp("dcp4")
    half = two / "half"
    four = out / "four"
    four.mkdir()
    shutil.copytree(half / "checkpoint" / "step-00000002.dcp", four / "checkpoint" / "step-00000002.dcp")
    shutil.copy(half / "config.toml", four)
    resume4 = ["--checkpoint.resume", "true", "--training.local_batch_size", "1", *_dump(four)]
    _spawn(
        4,
        out,
        {"four": [*resume4, "--training.steps", "3"]},
        two / "documents.parquet",
        # 4 ranks x the 2-rank run's local batch of 2: refused before anything is written
        refusals={"other_batch": ["--checkpoint.resume", "true", *_dump(half)]},
    )
    _spawn(2, out, {"back": ["--checkpoint.resume", "true", *_dump(four)]}, two / "documents.parquet")
    return out


def test_resume_on_the_same_ranks_is_bitwise(two):
    for rank in range(2):
        straight, resumed = _record(two, "straight", rank), _record(two, "resumed", rank)
        assert _record(two, "first", rank)["losses"] == straight["losses"][:2]
        assert resumed["losses"] == straight["losses"][2:]
        assert resumed["params"] == straight["params"]  # this rank's final shards
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            torch.load(two / "resumed.params.pt").values(), torch.load(two / "straight.params.pt").values(), strict=True
        )
    )


def test_each_rank_writes_its_shards_into_one_dcp_folder(two):
    step = two / "half" / "checkpoint" / "step-00000002.dcp"
    names = sorted(p.name for p in step.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "rank0.pt", "rank1.pt"]
    assert not list((two / "half" / "checkpoint").glob(".*.tmp"))


def test_keep_latest_k_prunes_checkpoint_folders_and_the_manifest_follows(two):
    dump = two / "straight"
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-00000003.dcp", "step-00000004.dcp"]
    recorded = sorted(f for f in Manifest.read(dump).files if f.startswith("checkpoint/"))
    assert recorded == ["checkpoint/step-00000003.dcp", "checkpoint/step-00000004.dcp"]


def test_overwrite_removes_the_checkpoint_folders_and_nothing_else(two, tmp_path):
    dump = tmp_path / "run"
    shutil.copytree(two / "half", dump)
    (dump / "notes.txt").write_text("mine")
    (dump / "checkpoint" / "mine.pt").write_text("mine")
    folder = inspect(str(dump), "checkpoint", resume=False, overwrite=True, checkpoint_enable=True)
    folder.prepare()
    left = sorted(str(p.relative_to(dump)) for p in dump.rglob("*"))
    assert left == sorted(["checkpoint", "checkpoint/mine.pt", MANIFEST_FILE, "notes.txt"])


def test_a_different_model_shape_is_refused_in_one_line(two):
    message = _refusal(two, "other_shape")
    assert "has shape" in message and "model expects" in message


def test_one_process_resumes_a_sharded_checkpoint_at_the_same_global_batch(two, tmp_path):
    """The 2-rank step-2 checkpoint resumed by one process: at the 2-rank run's local batch the global batch would
    halve, refused in one line naming the local batch that keeps it; with it, DCP reads the shards as whole tensors
    and steps 3 and 4 continue the 2-rank run's losses (one process sums what two ranks summed apart: 1e-5)."""
    dump = tmp_path / "run"
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(two / "half" / "checkpoint" / "step-00000002.dcp", dump / "checkpoint" / "step-00000002.dcp")
    shutil.copy(two / "half" / "config.toml", dump)
    data = ["--data.source", "hf_datasets", "--data.path", str(two / "documents.parquet")]
    resume = [*ARGS, *data, "--checkpoint.resume", "true", *_dump(dump)]
    try:
        with pytest.raises(UserError, match=r"on 1 data ranks .* would be 2 instead of 4.*local_batch_size 4") as e:
            Trainer(load_config(resume)[0])
        assert "\n" not in str(e.value)
        trainer = Trainer(load_config([*resume, "--training.local_batch_size", "4"])[0])
        result = trainer.train()
    finally:
        torch.use_deterministic_algorithms(False)
    assert trainer.step == 4 and (dump / "checkpoint" / "step-00000004.dcp" / ".metadata").is_file()
    assert result.losses == pytest.approx(_record(two, "straight")["losses"][2:], rel=1e-5)


def test_resume_on_4_ranks_then_2_continues_the_loss(two, resharded):
    """Same global batch (2 x 2 = 4 x 1): the same windows every step, so only the summation order differs."""
    straight = _record(two, "straight")["losses"]
    four, back = _record(resharded, "four")["losses"], _record(resharded, "back")["losses"]
    print(f"2 ranks {straight[2:]}, 4 ranks {four}, back on 2 {back}")
    assert four == pytest.approx(straight[2:3], rel=1e-5)
    assert back == pytest.approx(straight[3:4], rel=1e-5)
    diff = _max_diff(torch.load(resharded / "back.params.pt"), torch.load(two / "straight.params.pt"))
    print(f"max |param - uninterrupted 2-rank param| after 2 -> 4 -> 2 ranks: {diff:.3g}")
    assert diff < 1e-6
    ranks4 = {_record(resharded, "four", rank)["params"] for rank in range(4)}
    assert len(ranks4) == 4


def test_resume_with_another_global_batch_is_refused_in_one_line(resharded):
    message = _refusal(resharded, "other_batch")
    assert "global batch" in message and "--training.local_batch_size 1" in message


def test_export_writes_the_full_unpadded_weights(two, tmp_path):
    out = tmp_path / "model_full.pt"
    step = two / "straight" / "checkpoint" / "step-00000004.dcp"
    proc = export_checkpoint(step, out, tmp_path)
    assert proc.returncode == 0, proc.stderr
    exported = torch.load(out, weights_only=True)
    gathered = torch.load(two / "straight.params.pt")
    assert set(gathered) <= set(exported)
    assert all(torch.equal(exported[k], gathered[k]) for k in gathered)
    bad = export_checkpoint(tmp_path, out, tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_a_sharded_checkpoint_holds_tensors_only_no_pickled_bytes_item(two):
    """DCP unpickles a bytes item on load (`load_bytes`): every non-tensor state lives in rank{r}.pt instead."""
    steps = sorted((two / "straight" / "checkpoint").glob("step-*.dcp"))
    assert steps
    for step in steps:
        metadata = read_dcp_metadata(step / ".metadata")  # the allowlisting reader accepts our own metadata
        kinds = {type(m).__name__ for m in metadata.state_dict_metadata.values()}
        assert kinds == {"TensorStorageMetadata"}, (step, kinds)
        assert any(k.startswith("optimizer.") for k in metadata.state_dict_metadata)  # AdamW state is in it


def test_a_tampered_metadata_is_refused_by_export_in_one_line_and_runs_nothing(two, tmp_path):
    step = tmp_path / "step-00000004.dcp"
    shutil.copytree(two / "straight" / "checkpoint" / "step-00000004.dcp", step)
    marker = tmp_path / "created_by_the_checkpoint"
    with open(step / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, written by the fixture's run
    metadata.planner_data = CreatesAFile(marker)
    with open(step / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    proc = export_checkpoint(step, tmp_path / "out.pt", tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: {step / '.metadata'} asks to run io.open while being read")
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    # A bytes item, which DCP would unpickle on load, is refused as well.
    metadata.planner_data = None
    metadata.state_dict_metadata["model.extra"] = BytesStorageMetadata()
    with open(step / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UserError, match=r"declares pickled items \(model.extra\)"):
        read_dcp_metadata(step / ".metadata")
