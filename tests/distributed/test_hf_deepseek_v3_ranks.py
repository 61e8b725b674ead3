"""A DeepSeek-V3 Hugging Face folder fine-tuned on instruction rows by 2 gloo ranks with expert parallelism
(dp_shard 2 x ep 2: each rank holds 2 of the 4 routed experts), against one process on the same global batch.

The claims (issue 31):
- every rank plans the 6-layer model depth-free and reads from the folder only the experts it holds;
- the masked chat loss is the sum over the answers' tokens divided by the count of the whole global batch (the
  count all-reduced once a step), so both steps' losses are one process's;
- the ranks' checkpoint exports to a folder transformers loads, holding the weights one process trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from graph_trainer.export import main as export_main
from tests.checkpoint.test_hf_deepseek_v3 import (
    DENSE,
    EXPERTS,
    LOGITS_ATOL,
    TOKENS,
    hf_deepseek,
    hf_logits,
    load_ours,
)
from tests.checkpoint.test_hf_weights import HF, LAYERS, write_tokenizer
from tests.data.test_chat import prompt_rows, write_rows
from tests.multiprocess import LogLines, free_port, spawn_ranks, train_one_process, train_runs
from tests.tiny import DETERMINISTIC

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.integration,  # 2 ranks and one process train a 6-layer MoE 2 steps: about a minute on 2 cores
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with the gloo backend"
    ),
]

WORLD = 2
STEPS = 2
LOCAL_BATCH = 2
# A capacity factor of ep: every routed row fits on its expert's rank, as on one process (a smaller factor drops
# rows, logged: tests/distributed/test_expert_parallel.py).
EXPERT_PARALLEL = ["--parallelism.dp_shard", str(WORLD), "--parallelism.ep", str(WORLD)]
EXPERT_PARALLEL += ["--parallelism.ep_capacity_factor", str(WORLD)]
ONE_PROCESS = ["--training.local_batch_size", str(WORLD * LOCAL_BATCH)]  # the same global batch
EXPERTS_W1 = f"layers.{DENSE}.moe.experts.w1"
# Two ranks against one process: the same sums in another order (the loss's count and the gradients reduced over
# ranks, the experts' rows moved by all-to-all). Measured on this CPU: step 1's loss equal, step 2's 8e-8
# relative; trained weights 3.5e-7 absolute (AdamW's first steps divide each gradient element by its own
# magnitude, so rounding in near-zero elements grows towards the learning rate; training moved them 9e-4). The
# bounds leave room for another BLAS and stay far below a wrong count (the mean of the ranks' means is off by
# about 1% in tests/data/test_chat.py).
LOSS_RTOL = 1e-6
WEIGHTS_ATOL = 1e-5


def _args(folder: Path, rows: Path) -> list[str]:
    return [HF, str(folder), "--data.path", str(rows), "--training.seq_len", "64",
            "--training.local_batch_size", str(LOCAL_BATCH), "--training.steps", str(STEPS), *DETERMINISTIC,
            "--checkpoint.enable", "true", "--checkpoint.interval", str(STEPS)]  # fmt: skip


def _worker(rank: int, port: int, folder: str, rows: str, out: str) -> None:
    lines = LogLines()

    def save_loaded_experts(_name: str, trainer) -> None:  # as loaded, before the first step
        torch.save(dict(trainer.model.named_parameters())[EXPERTS_W1].detach().clone(), f"{out}/experts{rank}.pt")

    runs = {"ep": EXPERT_PARALLEL}
    args = _args(Path(folder), Path(rows))
    for _, _, result in train_runs(rank, WORLD, port, runs, args, out, on_built=save_loaded_experts):
        record = {"losses": result.losses, "trace_count": result.trace_count, "lines": lines.lines}
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The folder, the rows, the 2-rank run (`out/ep`, `out/rank<r>.json`) and the one-process run (`out/one`)."""
    out = tmp_path_factory.mktemp("ds_ranks")
    folder = out / "tiny-deepseek-v3"
    hf_deepseek().save_pretrained(folder)
    write_tokenizer(folder)
    rows = write_rows(out / "rows.jsonl", prompt_rows(64))
    spawn_ranks(_worker, WORLD, (free_port(), str(folder), str(rows), str(out)), timeout_s=600)
    _, one = train_one_process([*_args(folder, rows), *ONE_PROCESS], str(out / "one"))
    (out / "one.json").write_text(json.dumps({"losses": one.losses}))
    return out


def _record(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def test_the_run_plans_depth_free_and_each_rank_holds_its_experts_as_loaded(runs):
    lines = _record(runs, 0)["lines"]
    short = f"{DENSE + 2} + {DENSE + 3}"
    assert f"preflight: depth-free plan, models of {short} blocks traced for a model of {LAYERS}" in lines, lines
    assert sum(line.startswith("loaded ") for line in lines) == 1, lines  # the folder is read once
    whole = dict(load_ours(runs / "tiny-deepseek-v3").named_parameters())[EXPERTS_W1]
    per_rank = EXPERTS // WORLD
    for rank in range(WORLD):
        loaded = torch.load(runs / f"experts{rank}.pt", weights_only=True)
        assert torch.equal(loaded, whole[rank * per_rank : (rank + 1) * per_rank]), rank


def test_the_ranks_losses_are_one_processs_on_the_same_global_batch(runs):
    """Each rank divides its answers' loss sum by the global count: the logged losses (the ranks' sum) are those
    of one process reading both ranks' rows, step 1 and step 2 (after one update from the ranks' gradients)."""
    one = json.loads((runs / "one.json").read_text())["losses"]
    for rank in range(WORLD):
        record = _record(runs, rank)
        assert record["trace_count"] == 1
        assert len(record["losses"]) == STEPS
        for ours, theirs in zip(record["losses"], one, strict=True):
            assert abs(ours - theirs) <= LOSS_RTOL * abs(theirs), (record["losses"], one)
    print(f"\n2 ranks (ep 2) losses {_record(runs, 0)['losses']}; one process {one}")


def test_the_ranks_checkpoint_exports_what_one_process_trained(runs, tmp_path):
    """`python -m graph_trainer.export <the ranks' DCP step> DIR --format hf`: transformers loads the folder, and
    it holds the weights one process trained (within the reduction order's rounding)."""
    step = runs / "ep" / "checkpoint" / f"step-{STEPS:08d}.dcp"
    assert export_main([str(step), str(tmp_path / "exported"), "--format", "hf"]) == 0
    exported = load_ours(tmp_path / "exported")
    one_step = runs / "one" / "checkpoint" / f"step-{STEPS:08d}.pt"
    assert export_main([str(one_step), str(tmp_path / "one"), "--format", "hf"]) == 0
    trained = dict(load_ours(tmp_path / "one").named_parameters())
    folder = dict(load_ours(runs / "tiny-deepseek-v3").named_parameters())
    diff = max((p - trained[n]).abs().max().item() for n, p in exported.named_parameters())
    moved = max((p - folder[n]).abs().max().item() for n, p in exported.named_parameters())
    print(f"\nexport of the 2-rank checkpoint: max |weight - one process's| {diff:.3g}; moved {moved:.3g} by training")
    assert diff <= WEIGHTS_ATOL and moved > 10 * WEIGHTS_ATOL
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(tmp_path / "exported"), exported(TOKENS), atol=LOGITS_ATOL, rtol=0)
