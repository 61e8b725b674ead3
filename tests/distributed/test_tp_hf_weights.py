"""Hugging Face weights into tensor-parallel ranks (`checkpoint.initial_load_path` with `parallelism.tp`; gloo).

Claims tested, with a tiny random `LlamaForCausalLM` (q/k scaled up, so a wrong RoPE permutation shows) whose
vocabulary (2047) tp 2 pads, so the last rank's embedding and output blocks end in a masked padding row:
- tp 2, and tp 2 x dp_shard 2 (FSDP's rows of TP's blocks), trained from it give the losses of one process
  trained from it, within a stated tolerance;
- the tp 2 run's checkpoint, exported with `--format hf`, loads in transformers with our logits, and holds the
  pretrained weights moved only by training (a block read from the wrong place would be off by far more).
tests/checkpoint/test_hf_weights.py checks in one process that each rank reads exactly its block.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from graph_trainer.export import main as export_main
from tests.checkpoint.test_hf_weights import assert_exported_is_the_trained_model, hf_llama, our_args
from tests.multiprocess import free_port, spawn_ranks, train_one_process, train_runs
from tests.tiny import DETERMINISTIC, TINY_BATCH, tiny_model

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.integration,  # 2 and then 4 ranks load and train 2 eager steps
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with the gloo backend"
    ),
]
TP, STEPS, VOCAB = 2, 2, 2047
ARGS = ["--config", "llama3_debug", *tiny_model(), *TINY_BATCH, *DETERMINISTIC, "--model.vocab_size", str(VOCAB)]
ARGS += ["--training.steps", str(STEPS), "--compile.mode", "eager"]
LAYOUTS = {  # world -> (run name, its overrides)
    TP: ("tp", ["--parallelism.tp", str(TP), "--checkpoint.enable", "true"]),
    2 * TP: ("tp_fsdp", ["--parallelism.tp", str(TP), "--parallelism.dp_shard", "2"]),
}
# tp vs one process from the same weights: the same arithmetic up to the summation order of the row-parallel
# matmuls' partial sums and of the vocabulary-parallel log-sum-exp (tests/distributed/test_tp.py bounds the
# losses at 1e-6 relative for the same reasons).
LOSS_RTOL = 1e-6


def _worker(rank: int, world: int, port: int, out: str, folder: str) -> None:
    name, overrides = LAYOUTS[world]
    runs = {name: [*overrides, "--checkpoint.initial_load_path", folder]}
    for name, _, result in train_runs(rank, world, port, runs, ARGS, out):
        if rank == 0:
            Path(out, f"{name}.json").write_text(json.dumps({"losses": result.losses}))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    hf_llama(vocab=VOCAB).save_pretrained(folder)
    return folder


def _train(tmp_path_factory, folder: Path, world: int) -> Path:
    out = tmp_path_factory.mktemp(f"tp_hf_{world}")
    spawn_ranks(_worker, world, (world, free_port(), str(out), str(folder)), timeout_s=420)
    return out


def _one_process_losses(folder: Path, dump: Path, local_batch: int) -> list[float]:
    overrides = ["--checkpoint.initial_load_path", str(folder), "--training.local_batch_size", str(local_batch)]
    return train_one_process([*ARGS, *overrides], str(dump))[1].losses


def test_tp_trained_from_hf_weights_matches_one_process_and_exports_to_hf(tmp_path_factory, folder, tmp_path):
    out = _train(tmp_path_factory, folder, TP)
    losses = json.loads((out / "tp.json").read_text())["losses"]
    one = _one_process_losses(folder, tmp_path / "one", 2)
    print(f"tp {TP} from HF weights: losses {losses}, one process {one}")
    assert losses == pytest.approx(one, rel=LOSS_RTOL)
    checkpoint = out / "tp" / "checkpoint" / f"step-{STEPS:08d}.dcp"
    assert export_main([str(checkpoint), str(tmp_path / "exported"), "--format", "hf"]) == 0
    assert_exported_is_the_trained_model(checkpoint, tmp_path / "exported", folder, our_args(vocab=VOCAB))


def test_tp_with_fsdp_trained_from_hf_weights_matches_one_process(tmp_path_factory, folder, tmp_path):
    """tp 2 x dp_shard 2 (each rank reads FSDP's rows of its TP blocks) against one process with the same global
    batch (2 data ranks x 2 sequences)."""
    out = _train(tmp_path_factory, folder, 2 * TP)
    losses = json.loads((out / "tp_fsdp.json").read_text())["losses"]
    one = _one_process_losses(folder, tmp_path / "one", 4)
    print(f"tp {TP} x dp_shard 2 from HF weights: losses {losses}, one process {one}")
    assert losses == pytest.approx(one, rel=LOSS_RTOL)
