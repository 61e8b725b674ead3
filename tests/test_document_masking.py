"""Packed documents that do not see each other (`data.document_masking`): the loaders' document ids, a packed row
equal to its documents run alone (Llama 3 and DeepSeek-V3), the traced step bitwise equal to eager with one trace
while the boundaries move, the memory estimate still equal to the measured peak, and the dry run's attention line.
"""

from __future__ import annotations

import json
import random
from itertools import islice
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from graph_trainer.data.loader import build_dataloader
from graph_trainer.data.packing import DOCUMENT_IDS
from graph_trainer.data.tokenizer import ByteTokenizer
from graph_trainer.job_config.cli import load_config
from graph_trainer.trainer import Trainer
from models.deepseek_v3.model import DeepSeekV3
from models.deepseek_v3.model import ModelArgs as DeepSeekArgs
from models.llama3.model import ModelArgs as LlamaArgs
from models.llama3.model import Transformer
from tests.extras import import_extra
from tests.passes.test_activation_checkpoint import _measure as measure_traced_step
from tests.tiny import TINY

BYTE = ByteTokenizer()
MASKING = ["--data.document_masking", "true"]


def short_documents(path: Path, n: int = 80, seed: int = 0) -> Path:
    """A jsonl of `n` documents of 2 to 20 characters: rows of 32 tokens hold several, at moving boundaries."""
    rng = random.Random(seed)
    rows = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(2, 20))) for _ in range(n)]
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- the loaders' document ids


def _check_ids_follow_eos(batch: dict[str, torch.Tensor]) -> None:
    """Ids start at 0 in each row (a document cut by the row's end starts again there) and grow by one exactly
    after each EOS (the byte tokenizer ends every document with it), so they mark the boundaries the loader packed."""
    ids, tokens = batch[DOCUMENT_IDS], batch["input"]
    assert ids.shape == tokens.shape and ids.dtype == torch.long
    assert (ids[:, 0] == 0).all()
    assert torch.equal(ids[:, 1:] - ids[:, :-1], (tokens[:, :-1] == BYTE.eos_id).long())


@pytest.mark.parametrize("source", ["jsonl", "hf_datasets"])
def test_loaders_emit_document_ids_at_the_boundaries_and_resume_exactly(tmp_path, source):
    if source == "hf_datasets":
        import_extra("datasets")
    path = str(short_documents(tmp_path / "docs.jsonl"))
    kw = dict(batch_size=2, seq_len=32, seed=0)
    build = lambda **extra: build_dataloader(source, path, BYTE, **kw, **extra)  # noqa: E731
    loader = build(document_masking=True)
    batches = list(islice(loader, 3))
    for b in batches:
        _check_ids_follow_eos(b)
        assert (b[DOCUMENT_IDS][:, -1] >= 1).all()  # >= 2 documents in every row
    assert not torch.equal(batches[0][DOCUMENT_IDS], batches[1][DOCUMENT_IDS])  # the boundaries move
    # Resume: the batches after a state_dict are the ones the run would have read, ids included.
    resumed = build(document_masking=True)
    loader_state = build(document_masking=True)
    next(loader_state)
    resumed.load_state_dict(loader_state.state_dict())
    for want, got in zip(batches[1:], islice(resumed, 2), strict=True):
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # Off: the batches are today's, without the key.
    off = next(build())
    assert DOCUMENT_IDS not in off and torch.equal(off["input"], batches[0]["input"])


# --------------------------------------------------------------------------- a packed row == its documents alone

LLAMA = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=64)
DEEPSEEK = DeepSeekArgs(
    dim=64, n_layers=2, n_dense_layers=1, n_heads=4, vocab_size=64, inter_dim=128, moe_inter_dim=32,
    n_routed_experts=4, n_shared_experts=1, n_activated_experts=2, q_lora_rank=0, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, max_seq_len=64, original_seq_len=64,
)  # fmt: skip
# The projections whose outputs RoPE rotates, scaled up: a tiny random model's attention is nearly uniform, which
# would hide positions that fail to restart (DECISIONS: "a tiny random model hides a wrong RoPE permutation").
SHARPEN = {"llama3": ("wq", "wk"), "deepseek_v3": ("wq", "wkv_a")}
# Per-token losses, packed row against the documents run alone, fp32 on CPU. Measured: 4.8e-7 at most for both
# families, one float32 ulp at these losses (~4.7). Not 0 because the CPU flash kernel runs the softmax of a row
# block by block over all S keys (the masked ones add exact zeros, but the running max and sums are rescaled along
# another path than over the document's keys alone) and the matmuls see other shapes; 2e-6 is 4 ulps.
ALONE_TOLERANCE = 2e-6


def _per_token_losses(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, ids=None) -> torch.Tensor:
    logits = model(tokens) if ids is None else model(tokens, ids)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
def test_a_packed_row_equals_its_documents_run_alone(family):
    torch.manual_seed(0)
    model = Transformer(LLAMA) if family == "llama3" else DeepSeekV3(DEEPSEEK)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2] in SHARPEN[family]:
                p.mul_(8.0)
    tokens, labels = torch.randint(0, 64, (2, 48)), torch.randint(0, 64, (2, 48))
    lengths = [[5, 17, 9, 17], [20, 1, 27]]  # a one-token document too
    ids = torch.stack([torch.arange(len(row)).repeat_interleave(torch.tensor(row)) for row in lengths])
    seen = {}
    hook = model.layers[0].attention.register_forward_pre_hook(lambda _m, args: seen.update(cos=args[1]))
    packed = _per_token_losses(model, tokens, labels, ids)
    hook.remove()
    # RoPE restarts at each document: every token gets its own position's angles, exactly. (RoPE scores depend on
    # relative positions only, so a missing restart would move the losses by rounding alone: checked here.)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    assert torch.equal(seen["cos"], model.rope.cos[positions])
    for b in range(2):
        start = 0
        for length in lengths[b]:
            doc = slice(start, start + length)
            alone = _per_token_losses(model, tokens[b : b + 1, doc], labels[b : b + 1, doc])[0]
            assert (packed[b, doc] - alone).abs().max().item() <= ALONE_TOLERANCE, (family, b, start)
            start += length
    # The check has teeth: without the ids the later documents see the earlier ones and sit at later positions.
    assert (packed - _per_token_losses(model, tokens, labels)).abs().max().item() > 1000 * ALONE_TOLERANCE


# --------------------------------------------------------------------------- the step


@pytest.mark.integration  # two short trainer runs
def test_traced_step_equals_eager_bitwise_with_one_trace_while_boundaries_move(tmp_path):
    data = ["--data.source", "jsonl", "--data.path", str(short_documents(tmp_path / "docs.jsonl"))]
    selective = ["--activation_checkpoint.mode", "selective"]  # the attention op saved, the mask kept once

    def run(name: str, *extra: str):
        cfg, _ = load_config(
            ["--config", "llama3_debug", *TINY, *MASKING, *data, *selective, "--training.steps", "2",
             "--job.dump_folder", str(tmp_path / name), *extra]
        )  # fmt: skip
        return Trainer(cfg).train()

    eager, traced = run("eager", "--compile.mode", "eager"), run("traced")
    assert traced.losses == eager.losses
    assert traced.grads_sha256 == eager.grads_sha256 and traced.params_sha256 == eager.params_sha256
    assert traced.trace_count == 1
    # ... while the steps' boundaries moved: the same loader's first batches.
    loader = build_dataloader("jsonl", data[-1], BYTE, batch_size=2, seq_len=32, seed=0, document_masking=True)
    ids = [b[DOCUMENT_IDS] for b in islice(loader, 2)]
    assert not torch.equal(ids[0], ids[1])


def test_one_mask_serves_every_layer_and_the_estimate_equals_the_measured_peak(tmp_path):
    data = ["--data.source", "jsonl", "--data.path", str(short_documents(tmp_path / "docs.jsonl"))]
    cfg, _ = load_config(["--config", "llama3_debug", *TINY, *MASKING, *data, "--job.dump_folder", str(tmp_path / "r")])
    trainer = Trainer(cfg)
    estimated, measured, _ = measure_traced_step(trainer)
    assert estimated == measured
    # Every layer's attention, forward and backward, reads the one [B, 1, S, S] mask in the attention's dtype: no
    # per-layer conversion (a boolean mask would be turned into an additive one inside each call).
    graph = trainer.step_fn.traced.gm.graph
    attention = [n for n in graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
    masks = {n.kwargs["attn_mask"] for n in attention}
    assert len(attention) == 2 * 2 and len(masks) == 1  # TINY: 2 layers, a forward and a backward op each
    (mask,) = masks
    assert mask.meta["val"].shape == (2, 1, 32, 32) and mask.meta["val"].dtype == torch.float32


def test_dry_run_prints_attention_memory_per_layer_against_seq_len(capsys, monkeypatch):
    from graph_trainer.plan import dry_run as dry_run_module

    monkeypatch.setattr(dry_run_module, "plan_modes", lambda *a, **k: {})  # the AC modes' table: other tests'
    cfg, _ = load_config(["--config", "llama3_debug", *TINY, *MASKING])
    dry_run_module.dry_run(cfg, device=torch.device("cpu"))
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("attention MiB per layer"))
    # TINY: batch 2, 4 heads of 16 (k and v expanded to them), fp32. Per layer q, k, v and the output are
    # 2*4*S*16*4 = 512 S bytes each and the log-sum-exp 2*4*S*4 = 32 S: 2080 S; the mask 2*S*S*4 = 8 S^2 bytes.
    per_layer = {s: 2080 * s / 2**20 for s in (16, 32, 64)}
    mask = {s: 8 * s * s / 2**20 for s in (16, 32, 64)}
    assert line == (
        "attention MiB per layer (q, k, v, output, log-sum-exp kept for backward): "
        + ", ".join(f"seq {s}: {v:.3g}" for s, v in per_layer.items())
        + "; document mask, once for all layers: "
        + ", ".join(f"seq {s}: {v:.3g}" for s, v in mask.items())
    )
