"""DeepSeek-V3's Hugging Face weights in and out (issue 31, item 5): transformers' `DeepseekV3ForCausalLM` folders.

The folder is a 6-layer model written by `save_pretrained` (2 dense layers, then mixtures of 4 routed experts
and 1 shared expert; multi-head latent attention with query compression): deeper than the short models the
depth-free plan traces. Its random weights are made telling, so that a wrong mapping cannot hide:
- the q and kv-latent projections are scaled up (sharp attention: a wrong RoPE layout moves the logits);
- the norms are not ones (a swapped q/kv norm shows);
- the router biases are random (they decide which experts a token goes to: a bias left at zero routes otherwise).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from graph_trainer import __main__ as cli
from graph_trainer.checkpoint import hf as hf_module
from graph_trainer.checkpoint.hf import Pretrained, save_hf
from graph_trainer.distributed.parallelism import ParallelModel
from graph_trainer.errors import UserError
from graph_trainer.export import full_model_state
from graph_trainer.export import main as export_main
from models import MODELS
from models.deepseek_v3 import DeepSeekV3, DeepSeekV3StateDictAdapter, ModelArgs
from models.deepseek_v3.hf_config import args_from_hf_config
from tests.checkpoint.test_hf_weights import HF, LAYERS, LOSS_RTOL, write_tokenizer
from tests.extras import import_extra
from tests.tiny import DETERMINISTIC, TINY_BATCH

transformers = import_extra("transformers")
safetensors = import_extra("safetensors")

DEEPSEEK = MODELS["deepseek_v3"]
DENSE = 2
EXPERTS = 4
# transformers' eager attention and routing against ours (SDPA, grouped matmuls, index_add), same weights, float32.
# Measured: 6.0e-7 on logits of size ~0.6; 1e-5 leaves room for another BLAS. Without the router biases the
# difference is 0.12, with each expert's gate and up projections swapped 0.04 (the negative controls below).
LOGITS_ATOL = 1e-5
TENSORS = 91  # ours: 13 a dense layer, 16 a MoE layer (the experts stacked: 3, not 3 x 4), 3 at the top


def hf_deepseek(layers: int = LAYERS) -> torch.nn.Module:
    """A random 6-layer DeepseekV3ForCausalLM whose weights tell a wrong mapping apart (see the module doc)."""
    config = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
        first_k_dense_replace=DENSE, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_b_proj" in name or "kv_a_proj" in name:
                p.mul_(20.0)
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def args_of(folder: Path) -> ModelArgs:
    return ModelArgs(**args_from_hf_config(json.loads((folder / "config.json").read_text()), {}))


def load_ours(folder: Path) -> DeepSeekV3:
    """Our model built on meta and filled from the Hugging Face `folder`, as the trainer does on one process."""
    args = args_of(folder)
    with torch.device("meta"):
        model = DeepSeekV3(args)
    Pretrained.open(folder, DEEPSEEK, args).load_into(model, ParallelModel(model, None, []), torch.device("cpu"))
    return model.eval()


@pytest.fixture(scope="module")
def ds_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "tiny-deepseek-v3"
    hf_deepseek().save_pretrained(folder)
    return folder


TOKENS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))


def hf_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(TOKENS).logits


def test_the_folder_holds_one_tensor_per_expert_and_the_router_bias(ds_folder):
    """What the mapping is for: transformers writes each routed expert's projections apart, and the bias."""
    adapter = DeepSeekV3StateDictAdapter(args_of(ds_folder))
    with safetensors.safe_open(ds_folder / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert f"model.layers.{DENSE}.mlp.experts.{EXPERTS - 1}.down_proj.weight" in names
    assert f"model.layers.{DENSE}.mlp.gate.e_score_correction_bias" in names
    ours = {n for n in names if adapter.our_name(n) is not None}
    assert ours == names  # every tensor of the folder has its place


def test_logits_equal_transformers_after_loading(ds_folder):
    model = load_ours(ds_folder)
    assert sum(1 for layer in model.layers if layer.moe is not None) == LAYERS - DENSE
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf_logits(ds_folder), atol=LOGITS_ATOL, rtol=0)


def test_without_the_router_bias_the_logits_differ(ds_folder, monkeypatch):
    """Negative control: the bias changes the routing, so a loader that skipped it would fail the test above."""
    monkeypatch.setattr(hf_module, "_read_buffer", lambda *args: 0)  # the bias stays as init_buffers left it
    model = load_ours(ds_folder)
    with torch.no_grad():
        assert (model(TOKENS) - hf_logits(ds_folder)).abs().max() > 100 * LOGITS_ATOL


def test_with_gate_and_up_swapped_the_logits_differ(ds_folder, monkeypatch):
    """Negative control: the experts' projections are told apart by name, not by shape (gate and up have one)."""
    real = DeepSeekV3StateDictAdapter.hf_names

    def swapped(self, name):
        names = real(self, name)
        swap = {"gate_proj": "up_proj", "up_proj": "gate_proj"}  # both ways: the folder's names stay the wanted ones
        return [re.sub("gate_proj|up_proj", lambda m: swap[m[0]], n) if "experts." in n else n for n in names]

    monkeypatch.setattr(DeepSeekV3StateDictAdapter, "hf_names", swapped)
    model = load_ours(ds_folder)
    with torch.no_grad():
        assert (model(TOKENS) - hf_logits(ds_folder)).abs().max() > 100 * LOGITS_ATOL


def test_ours_to_hf_to_ours_is_bitwise_and_transformers_loads_the_export(ds_folder, tmp_path):
    """The export writes transformers' names and layouts (several shards with an index), the router's gate and
    bias in float32 as transformers keeps them; it reloads with our logits, and back into ours bitwise."""
    model = load_ours(ds_folder)
    adapter = DeepSeekV3StateDictAdapter(model.args)
    state = model.state_dict()
    back = adapter.from_hf(adapter.to_hf(state))
    kept = {k: v for k, v in state.items() if adapter.in_hf_files(k)}
    assert back.keys() == kept.keys() and all(torch.equal(back[k], kept[k]) for k in kept)
    assert not adapter.in_hf_files(f"layers.{DENSE}.moe.router.tokens_per_expert")  # a statistic, not a weight

    files = save_hf(state, adapter, tmp_path / "export", dtype=torch.bfloat16, max_shard_bytes=200_000)
    assert len(files) > 1
    weight_map = json.loads((files[0].parent / "model.safetensors.index.json").read_text())["weight_map"]
    bias = f"model.layers.{DENSE}.mlp.gate.e_score_correction_bias"
    with safetensors.safe_open(files[0].parent / weight_map[bias], framework="pt") as f:
        assert f.get_tensor(bias).dtype == torch.float32
        assert f.get_tensor(bias).equal(state[f"layers.{DENSE}.moe.router.expert_bias"])

    save_hf(state, adapter, tmp_path / "export32")
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(tmp_path / "export32"), model(TOKENS), atol=LOGITS_ATOL, rtol=0)


def test_the_multi_token_prediction_layer_is_skipped_and_a_missing_expert_named(ds_folder, tmp_path):
    """Published DeepSeek-V3 folders hold one more layer (multi-token prediction), which transformers skips and so
    do we; a folder without one expert's tensor is refused naming it."""
    adapter = DeepSeekV3StateDictAdapter(args_of(ds_folder))
    assert adapter.ignorable(f"model.layers.{LAYERS}.eh_proj.weight")
    assert not adapter.ignorable(f"model.layers.{LAYERS - 1}.mlp.gate.weight")

    folder = tmp_path / "missing-expert"
    folder.mkdir()
    (folder / "config.json").write_text((ds_folder / "config.json").read_text())
    tensors = safetensors.torch.load_file(ds_folder / "model.safetensors")
    missing = f"model.layers.{LAYERS - 1}.mlp.experts.2.up_proj.weight"
    del tensors[missing]
    tensors[f"model.layers.{LAYERS}.eh_proj.weight"] = torch.zeros(64, 128)  # the MTP layer: skipped, no error
    safetensors.torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"has no tensor {missing}, which the model needs"):
        load_ours(folder)


def test_a_folder_with_rope_on_halves_is_refused_in_one_line(ds_folder, tmp_path, capsys):
    """`rope_interleave = false` rotates another channel order than the weights here: refused, not mis-loaded."""
    folder = tmp_path / "halves"
    folder.mkdir()
    config = json.loads((ds_folder / "config.json").read_text()) | {"rope_interleave": False}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").symlink_to(ds_folder / "model.safetensors")
    assert cli.main([HF, str(folder), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rope_interleave false (ours: true)" in err, err


@pytest.mark.integration
def test_the_folder_alone_trains_depth_free_with_transformers_loss_and_exports(ds_folder, tmp_path, capsys):
    """`--checkpoint.initial_load_path DIR`, no --model.* option, through the CLI: the traced step (planned
    depth-free: 6 layers) starts from transformers' loss on the same tokens, and the export of its checkpoint
    reloads in transformers with the logits of the trained model."""
    from graph_trainer.builder import build_data
    from graph_trainer.distributed.launch import single_process
    from graph_trainer.job_config.cli import load_config

    write_tokenizer(ds_folder)
    run = tmp_path / "run"
    argv = [HF, str(ds_folder), *TINY_BATCH, *DETERMINISTIC, "--training.steps", "2"]
    assert cli.main([*argv, "--checkpoint.enable", "true", "--job.dump_folder", str(run)]) == 0
    out = capsys.readouterr().out
    assert (
        f"preflight: depth-free plan, models of {DENSE + 2} + {DENSE + 3} blocks traced for a model of {LAYERS}" in out
    )
    assert out.count(f"loaded {TENSORS} tensors") == 1
    assert f"model deepseek_v3 of {ds_folder}: " in out  # not the flavor's name: the folder is the model
    loss = json.loads((run / "summary.json").read_text())["steps"][0]["loss"]

    cfg, _ = load_config(argv)
    assert cfg.model.name == "deepseek_v3"
    batch = next(iter(build_data(cfg, single_process(cfg)).loader))
    tokens = torch.cat([batch["input"], batch["labels"][:, -1:]], dim=1)  # transformers shifts the labels itself
    hf = transformers.AutoModelForCausalLM.from_pretrained(ds_folder, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(input_ids=tokens, labels=tokens).loss.item()
    print(f"\nstep 1 loss {loss} against transformers' {theirs}: {abs(loss - theirs) / theirs:.1e} relative")
    assert abs(loss - theirs) <= LOSS_RTOL * theirs, (loss, theirs)

    checkpoint = run / "checkpoint" / "step-00000002.pt"
    assert export_main([str(checkpoint), str(tmp_path / "trained"), "--format", "hf"]) == 0
    trained = DeepSeekV3(args_of(ds_folder))
    trained.load_state_dict(full_model_state(checkpoint))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(tmp_path / "trained"), trained.eval()(TOKENS), atol=LOGITS_ATOL, rtol=0)

    # A checkpoint without a router bias would export a folder that transformers loads with that bias at zero
    # (a warning there, other routing): refused, naming it.
    saved = torch.load(checkpoint, weights_only=True)
    bias = f"layers.{LAYERS - 1}.moe.router.expert_bias"
    del saved["model"][bias]
    torch.save(saved, tmp_path / "step-00000002.pt")
    assert export_main([str(tmp_path / "step-00000002.pt"), str(tmp_path / "no-bias"), "--format", "hf"]) == 2
    assert f"holds no {bias} (of 1 missing)" in capsys.readouterr().err
    assert not (tmp_path / "no-bias").exists()


def test_each_fsdp_rank_reads_exactly_its_experts(ds_folder):
    """3 FSDP ranks over 4 experts (2, 2 and none plus padding): each rank's shards are the rows of the whole
    loaded model, padding zero, bitwise; the router biases are whole on every rank."""
    from graph_trainer.distributed.fsdp import ShardGroup, fully_shard_model

    args = args_of(ds_folder)
    whole = load_ours(ds_folder)
    world, shards = 3, []
    for rank in range(world):
        with torch.device("meta"):
            model = DeepSeekV3(args)
        fsdp = fully_shard_model(model, ShardGroup(rank, world, "unused"))  # sharding itself needs no process group
        Pretrained.open(ds_folder, DEEPSEEK, args).load_into(model, ParallelModel(model, None, [fsdp]), "cpu")
        shards.append(dict(model.named_parameters()))
        bias = f"layers.{LAYERS - 1}.moe.router.expert_bias"
        assert torch.equal(model.get_buffer(bias), whole.get_buffer(bias))
    for name, full in whole.named_parameters():
        stacked = torch.cat([s[name] for s in shards])
        assert stacked.shape[0] == world * -(-full.shape[0] // world), name
        assert torch.equal(stacked[: full.shape[0]], full), name
        assert not stacked[full.shape[0] :].any(), name
    experts = f"layers.{DENSE}.moe.experts.w1"
    assert [s[experts].shape[0] for s in shards] == [2, 2, 2] and not shards[2][experts].any()
