"""Sharded (DCP folder) checkpoints without processes: the manifest owns folders, the reshard rule, the guard's norm.

The multi-process claims (bitwise resume, resharding, export) are in tests/checkpoint/test_fsdp_checkpoint.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from graph_trainer.checkpoint.formats import holds_sharded, refuse_other_format
from graph_trainer.checkpoint.run_folder import MANIFEST_FILE, Manifest, remove_run
from graph_trainer.errors import UserError
from graph_trainer.job_config.resume import compare_on_resume, stored_config
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.divergence import DivergenceGuard, TrainingDiverged


def _checkpoint_folder(path) -> None:
    path.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "rank0.pt"):
        (path / name).write_bytes(b"x")


def test_manifest_owns_a_recorded_checkpoint_folder_and_its_torn_temp_folder_and_removes_only_them(tmp_path):
    manifest = Manifest(tmp_path / MANIFEST_FILE)
    ckpt = tmp_path / "checkpoint"
    manifest.record(ckpt / "step-00000002.dcp")
    _checkpoint_folder(ckpt / "step-00000002.dcp")
    _checkpoint_folder(ckpt / ".step-00000002.dcp.tmp")  # a save killed half-way
    _checkpoint_folder(ckpt / "step-00000009.dcp")  # not this run's
    assert manifest.owns(ckpt / "step-00000002.dcp" / "__0_0.distcp")
    assert manifest.owns(ckpt / ".step-00000002.dcp.tmp" / "rank0.pt")
    assert not manifest.owns(ckpt / "step-00000009.dcp" / "__0_0.distcp")
    remove_run(manifest)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000009.dcp"]
    assert len(list((ckpt / "step-00000009.dcp").iterdir())) == 3


def _now(dp_shard: int, local_batch_size: int, dp_replicate: int = 1) -> JobConfig:
    cfg = JobConfig()
    cfg.parallelism.dp_shard, cfg.training.local_batch_size = dp_shard, local_batch_size
    cfg.parallelism.dp_replicate = dp_replicate
    return cfg


def _saved(dp_shard: int, local_batch_size: int, dp_replicate: int = 1) -> dict:
    return stored_config(_now(dp_shard, local_batch_size, dp_replicate))


def test_a_sharded_checkpoint_reshards_only_with_the_same_global_batch(tmp_path):
    lines = compare_on_resume(_saved(2, 4), _now(4, 2), tmp_path, reshardable=True)
    assert any(line.startswith("parallelism.dp_shard: 2 in the checkpoint, 4 now (resharded") for line in lines)
    with pytest.raises(UserError, match=r"global batch .* would be 16 instead of 8.*--training.local_batch_size 2"):
        compare_on_resume(_saved(2, 4), _now(4, 4), tmp_path, reshardable=True)
    with pytest.raises(
        UserError, match=r"a data-parallel degree \(parallelism.dp_replicate x parallelism.dp_shard\) that divides 8"
    ):
        compare_on_resume(_saved(2, 4), _now(3, 4), tmp_path, reshardable=True)
    with pytest.raises(UserError, match="changed training.local_batch_size"):  # single-file checkpoints: as before
        compare_on_resume(_saved(2, 4), _now(4, 2), tmp_path)


def test_hsdp_counts_both_data_parallel_dimensions_in_the_global_batch(tmp_path):
    """HSDP 2 x 2 with local batch 2 reads 8 sequences a step: resumed as dp_shard 4 it keeps them at local batch
    2, and as dp_shard 2 alone it would read 4, refused. A replicated (single-file) run cannot change
    dp_replicate: its global batch would change under the saved data position, silently."""
    lines = compare_on_resume(_saved(2, 2, dp_replicate=2), _now(4, 2), tmp_path, reshardable=True)
    assert any(line.startswith("parallelism.dp_replicate: 2 in the checkpoint, 1 now (resharded") for line in lines)
    with pytest.raises(
        UserError, match=r"on 2 data ranks \(dp_shard 2\) .* would be 4 instead of 8.*local_batch_size 4"
    ):
        compare_on_resume(_saved(2, 2, dp_replicate=2), _now(2, 2), tmp_path, reshardable=True)
    with pytest.raises(UserError, match=r"changed parallelism.dp_replicate 4 \(checkpoint: 2\)"):
        compare_on_resume(_saved(1, 2, dp_replicate=2), _now(1, 2, dp_replicate=4), tmp_path)


def test_a_sharded_job_refuses_a_folder_of_single_file_checkpoints_and_a_whole_job_takes_sharded_ones(tmp_path):
    (tmp_path / "step-00000002.pt").write_bytes(b"")
    with pytest.raises(UserError, match="which a parallelism.dp_shard job cannot resume") as e:
        refuse_other_format(tmp_path, sharded=True)
    assert "\n" not in str(e.value)
    sharded = tmp_path / "sharded"
    _checkpoint_folder(sharded / "step-00000002.dcp")
    assert holds_sharded(sharded) and not holds_sharded(tmp_path)  # a job of whole state goes on writing DCP there


def test_the_guard_checks_the_norm_summed_over_the_ranks():
    shard = [torch.full((4,), 1.0)]  # norm 2 on this rank
    other = {"sq": 4.0}  # the other rank's squared norm
    guard = DivergenceGuard(lambda sq: sq + other["sq"])
    guard.start(shard, 0)
    assert guard.ref_norm == pytest.approx(math.sqrt(8))
    other["sq"] = 1e6  # the other rank's shard blew up: every rank must see it
    with pytest.raises(TrainingDiverged, match="parameter norm exploded"):
        guard.check_before_save(1, 1.0, shard)


def test_a_checkpoint_folder_outside_the_dump_folder_is_owned_below_its_recorded_step_folders(tmp_path):
    manifest = Manifest(tmp_path / "run" / MANIFEST_FILE)
    (tmp_path / "run").mkdir()
    outside = tmp_path / "elsewhere"
    manifest.record(outside / "step-00000001.dcp")
    _checkpoint_folder(outside / "step-00000001.dcp")
    (outside / "notes.txt").write_text("not ours")
    assert manifest.owns(outside / "step-00000001.dcp" / "rank0.pt")
    assert not manifest.owns(outside / "notes.txt")
    remove_run(manifest)
    assert sorted(p.name for p in outside.iterdir()) == ["notes.txt"]


def test_a_pp_checkpoint_resumed_by_one_process_accumulating_its_micro_batches_is_a_reshard(tmp_path):
    """A pp 2 run of local batch 8 (micro-batches of 2) read 8 sequences a step; one process reading them as 4
    accumulated micro-batches of 2 keeps the global batch, so it resumes (the schedule's micro-batches are
    accumulation's); a single-file checkpoint could not change the layout so."""
    pipeline = _now(1, 8)
    pipeline.parallelism.pp, pipeline.parallelism.pp_microbatch_size = 2, 2
    alone = _now(1, 2)
    alone.training.global_batch_size = 8
    lines = compare_on_resume(stored_config(pipeline), alone, tmp_path, reshardable=True)
    assert any(line.startswith("parallelism.pp: 2 in the checkpoint, 1 now") for line in lines), lines
    with pytest.raises(UserError, match="training.global_batch_size 8"):
        compare_on_resume(stored_config(pipeline), alone, tmp_path)
