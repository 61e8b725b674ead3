"""Hugging Face weights in and out: names, the RoPE layout of q/k, config.json checks, FSDP shards, and the CLI.

The Hugging Face models here are tiny random `LlamaForCausalLM`s written by `save_pretrained`. With their
init std of 0.02 attention is nearly uniform, and a wrong q/k permutation would still give matching logits:
their q and k weights are scaled up so that positions matter, and a negative control shows that a missing
permutation then fails the comparison.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graph_trainer import __main__ as cli
from graph_trainer.builder import initial_weights
from graph_trainer.checkpoint.hf import INDEX_FILE, SINGLE_FILE, HFFolder, Pretrained, save_hf
from graph_trainer.distributed.fsdp import ShardGroup, fully_shard_model
from graph_trainer.distributed.launch import trainer_command
from graph_trainer.distributed.parallelism import ParallelModel
from graph_trainer.distributed.tp import tensor_parallelize
from graph_trainer.errors import UserError
from graph_trainer.export import full_model_state
from graph_trainer.export import main as export_main
from graph_trainer.job_config.cli import load_config
from graph_trainer.job_config.model_args import build_model_args
from models import MODELS
from models.llama3 import Llama3StateDictAdapter, Transformer
from models.llama3.state_dict_adapter import halves_to_interleaved, interleaved_to_halves
from tests.extras import import_extra
from tests.test_docs import HF_ROUND_TRIP
from tests.tiny import DETERMINISTIC, TINY_BATCH, tiny_model

transformers = import_extra("transformers")
import_extra("safetensors")

REPO = Path(__file__).resolve().parents[2]
LLAMA = MODELS["llama3"]
# Logits of the same weights through transformers' eager attention and rotate-half RoPE, and through ours
# (SDPA, pair rotation): the same math in another op order, in float32. Measured: at most 1e-6 on logits of
# size ~1; 1e-5 leaves room for another BLAS. A missing permutation moves them by more than 0.1 (checked below).
LOGITS_ATOL = 1e-5
QK_SCALE = 20.0  # q/k weights x20 (std 0.4): attention scores of several units, far from uniform


def hf_llama(*, tie: bool = False, layers: int = 2, scaling: bool = False, vocab: int = 2048) -> torch.nn.Module:
    """A random Hugging Face Llama shaped like tests/tiny.py's model (debugmodel's vocabulary and FFN width)."""
    rope_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling=rope_scaling if scaling else None,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(QK_SCALE)
    return model


def our_args(*, tie: bool = False, layers: int = 2, scaling: bool = False, vocab: int = 2048):
    """Our arguments for `hf_llama` with the same options."""
    overrides = {"dim": 64, "n_layers": layers, "n_heads": 4, "n_kv_heads": 2, "tie_embeddings": tie}
    args = build_model_args("llama3", "debugmodel", {**overrides, "vocab_size": vocab})
    if scaling:
        args = dataclasses.replace(args, use_rope_scaling=True, scaling_factor=8.0, original_max_seq_len=64)
    return args


def load_ours(folder: Path, args) -> Transformer:
    """Our model built on meta, filled from the Hugging Face `folder`."""
    return load_sharded(folder, args, None)[0]


def load_sharded(folder: Path, args, group: ShardGroup | None):
    """(our model, its FSDP or None): built on meta, sharded as rank `group.rank` of `group` (None: whole), then
    filled from the Hugging Face `folder`."""
    with torch.device("meta"):
        model = Transformer(args)
    fsdp = fully_shard_model(model, group) if group is not None else None
    parallel = ParallelModel(model, None, [fsdp] if fsdp else [])
    Pretrained.open(folder, LLAMA, args).load_into(model, parallel, torch.device("cpu"))
    return model, fsdp


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    hf_llama().save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------- the RoPE layout


@pytest.mark.parametrize("scaling", [False, True], ids=["rope", "rope-llama3-scaling"])
def test_qk_scores_equal_hugging_face_rope_per_head(scaling):
    """q.k of every head and position pair, through HF's rotate-half RoPE on HF's weights and through ours on the
    permuted weights: equal to 1e-5 in float32 (the comparison DECISIONS.md asks for)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from models.common.rope import apply_rotary
    from models.llama3.model import rotary_embedding

    hf = hf_llama(scaling=scaling)
    args = our_args(scaling=scaling)
    torch.manual_seed(1)
    seq, hd = 48, args.head_dim
    x = torch.randn(1, seq, args.dim)
    wq, wk = hf.model.layers[0].self_attn.q_proj.weight, hf.model.layers[0].self_attn.k_proj.weight
    adapter = Llama3StateDictAdapter(args)
    name = "layers.0.attention.wq.weight"
    with torch.no_grad():
        cos, sin = LlamaRotaryEmbedding(hf.config)(x, torch.arange(seq)[None])
        q_hf = (x @ wq.T).view(1, seq, 4, hd).transpose(1, 2)
        k_hf = (x @ wk.T).view(1, seq, 2, hd).transpose(1, 2).repeat_interleave(2, dim=1)
        q_hf, k_hf = apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
        rope = rotary_embedding(args)
        c, s = rope(seq)
        q = apply_rotary((x @ adapter.from_hf_rows(name, wq).T).view(1, seq, 4, hd), c, s).transpose(1, 2)
        k = apply_rotary((x @ adapter.from_hf_rows(name, wk).T).view(1, seq, 2, hd), c, s).transpose(1, 2)
        k = k.repeat_interleave(2, dim=1)
    ours, theirs = q @ k.transpose(-1, -2), q_hf @ k_hf.transpose(-1, -2)
    assert theirs.abs().max() > 1.0  # scores of several units: positions matter
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_permutations_are_inverse_and_move_rows_within_heads():
    rows = torch.arange(2 * 8 * 3, dtype=torch.float32).view(16, 3)
    halves = interleaved_to_halves(rows, head_dim=8)
    assert torch.equal(halves_to_interleaved(halves, head_dim=8), rows)
    assert torch.equal(halves[:8].sort(dim=0).values, rows[:8])  # head 0's rows stay in head 0
    # Our pair (row 2i, row 2i+1) is HF's (row i, row i + head_dim/2).
    assert torch.equal(halves[1], rows[2]) and torch.equal(halves[4], rows[1])


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_equal_hugging_face_after_loading(tmp_path, monkeypatch, tie):
    hf = hf_llama(tie=tie)
    hf.save_pretrained(tmp_path / "hf")
    if tie:
        assert "lm_head.weight" not in HFFolder.open(tmp_path / "hf").files  # HF writes a tied weight once
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    model = load_ours(tmp_path / "hf", our_args(tie=tie))
    assert (model.output.weight is model.tok_embeddings.weight) == tie
    with torch.no_grad():
        theirs, ours = hf(tokens).logits, model(tokens)
    torch.testing.assert_close(ours, theirs, atol=LOGITS_ATOL, rtol=0)
    # Negative control: without the q/k permutation the same comparison fails by far.
    monkeypatch.setattr(Llama3StateDictAdapter, "from_hf_rows", lambda self, name, rows: rows)
    with torch.no_grad():
        unpermuted = load_ours(tmp_path / "hf", our_args(tie=tie))(tokens)
    assert (unpermuted - theirs).abs().max() > 0.1


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("max_shard_bytes", [10**9, 200_000], ids=["one-file", "sharded"])
def test_ours_to_hf_to_ours_is_bitwise_and_transformers_loads_it(tmp_path, tie, max_shard_bytes):
    args = our_args(tie=tie)
    torch.manual_seed(3)
    model = Transformer(args)  # random init: every tensor distinct
    with torch.no_grad():  # q/k scaled, so that transformers' logits below would show a wrong permutation
        for layer in model.layers:
            layer.attention.wq.weight.mul_(QK_SCALE)
            layer.attention.wk.weight.mul_(QK_SCALE)
    files = save_hf(model.state_dict(), Llama3StateDictAdapter(args), tmp_path / "out", max_shard_bytes=max_shard_bytes)
    if max_shard_bytes < 10**9:
        index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
        assert len(files) > 2 and {tmp_path / "out" / f for f in index["weight_map"].values()} == set(files)
        assert index["metadata"]["total_size"] == sum(
            t.numel() * 4 for k, t in model.state_dict().items() if not (tie and k == "output.weight")
        )
    else:
        assert files == [tmp_path / "out" / SINGLE_FILE] and not (tmp_path / "out" / INDEX_FILE).exists()
    back = load_ours(tmp_path / "out", args)
    for name, t in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    assert (back.output.weight is back.tok_embeddings.weight) == tie
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    tokens = torch.randint(0, 2048, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=LOGITS_ATOL, rtol=0)


def test_bfloat16_export_holds_the_rounded_weights(tmp_path):
    args = our_args()
    model = Transformer(args)
    save_hf(model.state_dict(), Llama3StateDictAdapter(args), tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_ours(tmp_path / "bf16", args)  # read into float32 parameters
    for name, t in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], t.to(torch.bfloat16).float()), name


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_each_fsdp_rank_reads_exactly_its_rows(tmp_path, tie):
    """3 ranks (uneven rows; shard boundaries cut through heads, so q/k are read by whole heads around them):
    each rank's shards are the rows of the whole loaded model, padding zero, bitwise; a tied weight stays one
    shard in both of its slots, where FSDP's gather finds it."""
    hf_llama(tie=tie).save_pretrained(tmp_path / "hf")
    args = our_args(tie=tie)
    whole = load_ours(tmp_path / "hf", args).state_dict()
    world = 3
    shards = []
    for rank in range(world):
        group = ShardGroup(rank, world, "unused")  # sharding itself needs no process group
        model, fsdp = load_sharded(tmp_path / "hf", args, group)
        shards.append(dict(model.named_parameters(remove_duplicate=False)))
        assert (model.output.weight is model.tok_embeddings.weight) == tie
        for unit in fsdp.units:  # every slot of a parameter holds the one loaded shard
            assert all(
                m._parameters[a] is t for t, slots in zip(unit.current(), unit.slots, strict=True) for m, a in slots
            )
    for name, full in whole.items():
        rows = shards[0][name].shape[0]
        assert rows == -(-full.shape[0] // world)
        stacked = torch.cat([s[name] for s in shards])
        assert torch.equal(stacked[: full.shape[0]], full), name
        assert not stacked[full.shape[0] :].any(), name


def load_parallel(folder: Path, args, tp: ShardGroup, dp: ShardGroup | None = None) -> Transformer:
    """Our model built on meta, split as rank `tp.rank` of tensor parallelism (then FSDP-sharded as rank `dp.rank`
    of `dp`), then filled from the Hugging Face `folder` (no process group: splitting and loading need none)."""
    with torch.device("meta"):
        model = Transformer(args)
    plan = LLAMA.parallel_plan
    parts = [tensor_parallelize(model, tp, plan.tensor_parallel, plan.layers)]
    parts += [fully_shard_model(model, dp, layers=plan.layers)] if dp is not None else []
    Pretrained.open(folder, LLAMA, args).load_into(model, ParallelModel(model, None, parts), torch.device("cpu"))
    return model


@pytest.mark.parametrize("dp", [1, 3], ids=["tp2", "tp2xdp_shard3"])
def test_each_tp_rank_reads_exactly_its_block_the_vocabulary_padding_zero(tmp_path, monkeypatch, dp):
    """tp 2 (x FSDP 3 over the TP blocks): vocabulary 2047, so the last TP rank's embedding and output blocks end
    in a padding row, and FSDP's rows cut through heads and through that padding. Each rank's parameters are its
    block of the whole loaded model, bitwise, padding rows zero; every read covers the rank's block plus at most
    the rest of the two heads its q/k rows start and end in (a row-parallel block is read as columns)."""
    vocab, tp = 2047, 2
    hf_llama(vocab=vocab).save_pretrained(tmp_path / "hf")
    args = our_args(vocab=vocab)
    whole = load_ours(tmp_path / "hf", args).state_dict()
    reads: list[tuple[str, int]] = []
    convert = Llama3StateDictAdapter.from_hf_rows
    monkeypatch.setattr(
        Llama3StateDictAdapter,
        "from_hf_rows",
        lambda self, n, rows: reads.append((n, rows.numel())) or convert(self, n, rows),
    )
    blocks: dict[str, list[torch.Tensor]] = {}  # name -> the tp ranks' blocks (FSDP's shards stacked back)
    for t in range(tp):
        shards = []
        for d in range(dp):
            model = load_parallel(
                tmp_path / "hf", args, ShardGroup(t, tp, "unused"), ShardGroup(d, dp, "unused") if dp > 1 else None
            )
            local = dict(model.named_parameters())
            assert all(numel <= local[n].numel() + 2 * args.head_dim * args.dim for n, numel in reads), reads
            reads.clear()
            shards.append(local)
        for name in shards[0]:
            blocks.setdefault(name, []).append(torch.cat([s[name].detach() for s in shards]))
    for name, full in whole.items():
        dim = 1 if name.endswith(("wo.weight", "w2.weight")) else 0
        size = -(-full.shape[dim] // tp) if full.dim() > 1 else None
        if size is None:  # a norm: whole on every tp rank (FSDP's shards stacked back, padding cut)
            assert all(torch.equal(b[: full.shape[0]], full) for b in blocks[name]), name
            continue
        # FSDP's padding rows cut off: a TP block's own rows (dim 0), or the parameter's (row-parallel, dim 1).
        stacked = torch.cat([b[: size if dim == 0 else full.shape[0]] for b in blocks[name]], dim=dim)
        assert torch.equal(stacked.narrow(dim, 0, full.shape[dim]), full), name
        assert not stacked.narrow(dim, full.shape[dim], stacked.shape[dim] - full.shape[dim]).any(), name
    assert blocks["output.weight"][0].shape[0] >= 1024  # 1024 rows a tp rank, the last one padding on rank 1


# --------------------------------------------------------------------------- config.json and bad folders


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_hidden_layers", 3),
        ("num_key_value_heads", 4),
        ("intermediate_size", 512),
        ("vocab_size", 32000),
        ("rope_theta", 10000.0),
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
        ("tie_word_embeddings", True),
        ("rms_norm_eps", 1e-6),
        ("model_type", "mistral"),
    ],
)
def test_each_config_field_that_disagrees_is_named(hf_folder, field, value):
    config = json.loads((hf_folder / "config.json").read_text())
    assert Llama3StateDictAdapter(our_args()).config_mismatch(config) is None
    if field.startswith("rope"):  # transformers 5 writes both under rope_parameters; older files as two keys
        legacy = {**config, "rope_theta": 500000.0, field: value}
        legacy.pop("rope_parameters")
        config["rope_parameters"].update({"rope_theta": value} if field == "rope_theta" else value)
        mismatch = Llama3StateDictAdapter(our_args()).config_mismatch(legacy)
        assert mismatch is not None and mismatch.field == field
    else:
        config[field] = value
    mismatch = Llama3StateDictAdapter(our_args()).config_mismatch(config)
    assert mismatch is not None and mismatch.field == field
    assert mismatch.found == value or field == "rope_scaling"  # the scaling is compared in its normalized form


# Published config.json fields of meta-llama/Llama-3.2-1B and meta-llama/Meta-Llama-3-8B (the ones compared).
LLAMA_3_2_1B = {
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}
LLAMA_3_8B = {
    **LLAMA_3_2_1B,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "head_dim": 128,
    "intermediate_size": 14336,
    "rope_scaling": None,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(("flavor", "config"), [("1B", LLAMA_3_2_1B), ("8B", LLAMA_3_8B)])
def test_published_configs_match_their_flavors(flavor, config):
    adapter = Llama3StateDictAdapter(build_model_args("llama3", flavor))
    assert adapter.config_mismatch(config) is None
    assert adapter.config_mismatch({**config, "num_hidden_layers": 2}).field == "num_hidden_layers"


def _main_error(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err


def test_config_that_disagrees_is_one_line_exit_2_through_the_cli(tmp_path, hf_folder, capsys):
    """The command line's main(), in process (the subprocess around it adds only an interpreter start)."""
    args = ["--checkpoint.initial_load_path", str(hf_folder), *tiny_model(layers=3), *TINY_BATCH, *DETERMINISTIC]
    err = _main_error([*args, "--job.dump_folder", str(tmp_path / "run")], capsys)
    assert "num_hidden_layers is 2 there but 3 here" in err and "--model.n_layers 2" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_pickle_only_folder_is_refused_unread(tmp_path, capsys):
    folder = tmp_path / "bin-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_llama().config.to_dict()))
    marker = tmp_path / "pickle-ran"

    class Payload:  # unpickling this would create `marker`
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"x": Payload()}, folder / "pytorch_model.bin")
    base = [*tiny_model(), *TINY_BATCH, *DETERMINISTIC, "--job.dump_folder", str(tmp_path / "run")]
    err = _main_error([*base, "--checkpoint.initial_load_path", str(folder)], capsys)
    assert "pytorch_model.bin" in err and "only safetensors are read" in err
    assert not marker.exists()
    err = _main_error([*base, "--checkpoint.initial_load_path", str(tmp_path / "nowhere")], capsys)
    assert "is not a folder" in err


def test_index_naming_a_file_outside_the_folder_is_refused(tmp_path, hf_folder):
    folder = tmp_path / "bad-index"
    folder.mkdir()
    (folder / "config.json").write_text((hf_folder / "config.json").read_text())
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": {"model.norm.weight": "../model.safetensors"}}))
    with pytest.raises(UserError, match="not a .safetensors file in the folder"):
        HFFolder.open(folder)


def test_a_resume_wins_over_initial_load_path(tmp_path):
    """With checkpoint.resume the folder is not even opened: the run's own checkpoint is the starting point."""
    base = ["--checkpoint.initial_load_path", str(tmp_path / "missing"), "--checkpoint.enable", "true"]
    cfg, _ = load_config([*base, "--checkpoint.resume", "true"])
    assert initial_weights(cfg) is None
    cfg, _ = load_config(base)
    with pytest.raises(UserError, match="is not a folder"):
        initial_weights(cfg)


def test_initial_load_in_hf_false_is_refused_and_an_export_never_overwrites(tmp_path):
    from graph_trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="initial_load_in_hf = false"):
        load_config(["--checkpoint.initial_load_path", "x", "--checkpoint.initial_load_in_hf", "false"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists"):
        save_hf(Transformer(our_args()).state_dict(), Llama3StateDictAdapter(our_args()), tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp folder left behind


# --------------------------------------------------------------------------- end to end


def assert_exported_is_the_trained_model(checkpoint: Path, exported: Path, pretrained_folder: Path, args=None) -> None:
    """transformers' logits of the export equal ours of the checkpoint; every trained weight moved only a little
    from the pretrained one (a tensor read from the wrong place would be off by the weights' own size)."""
    args = args or our_args()
    trained = Transformer(args)
    trained.load_state_dict(full_model_state(checkpoint))
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, trained(tokens), atol=LOGITS_ATOL, rtol=0)
    pretrained = load_ours(pretrained_folder, args).state_dict()
    torch.manual_seed(0)
    random = Transformer(args).state_dict()
    # 3 AdamW steps move a weight by at most ~lr (8e-4) each; a random init differs by far more (~0.05 and up).
    for name, weight in trained.state_dict().items():
        assert (weight - pretrained[name]).abs().max() < 0.01, name
        assert (random[name] - pretrained[name]).abs().max() > 0.02 or "norm" in name, name  # norms: ones in both


@pytest.mark.integration
def test_the_documented_round_trip_runs_verbatim(tmp_path):
    """docs/hf_weights.md's commands, as written, one after the other: a Hugging Face model, 3 steps trained from it
    (one process, a step-*.pt checkpoint), exported with --format hf, loaded by transformers."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # `python` is this interpreter
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    script = " && ".join(HF_ROUND_TRIP)
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded 21 tensors" in result.stdout and result.stdout.splitlines()[-1] == "2 385344"
    out = tmp_path / "outputs"
    assert_exported_is_the_trained_model(
        out / "hf_run" / "checkpoint" / "step-00000003.pt", out / "hf_trained", out / "hf_tiny"
    )


@pytest.mark.integration
def test_fsdp_ranks_train_from_hf_and_the_sharded_checkpoint_exports_to_hf(tmp_path, hf_folder):
    """2 FSDP ranks through torchrun: each reads its own rows of the pretrained folder; 3 steps; the step-*.dcp
    checkpoint exported with --format hf by one process loads in transformers with our logits."""
    run = tmp_path / "run"
    train = [
        *trainer_command(2),
        "--checkpoint.initial_load_path",
        str(hf_folder),
        *tiny_model(),
        *TINY_BATCH,
        *DETERMINISTIC,
        "--parallelism.dp_shard",
        "2",
        "--training.steps",
        "3",
        "--checkpoint.enable",
        "true",
        "--job.dump_folder",
        str(run),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"from {hf_folder}" in result.stdout + result.stderr  # the load was logged
    checkpoint = run / "checkpoint" / "step-00000003.dcp"
    assert export_main([str(checkpoint), str(tmp_path / "exported"), "--format", "hf"]) == 0
    assert (tmp_path / "exported" / "config.json").is_file() and (tmp_path / "exported" / SINGLE_FILE).is_file()
    assert_exported_is_the_trained_model(checkpoint, tmp_path / "exported", hf_folder)


_PEAK_SCRIPT = (
    "import sys; from benchmarks.hf_load import load_and_measure; print(load_and_measure(sys.argv[1], 384, 4, 16384))"
)


@pytest.mark.integration
def test_peak_host_memory_while_loading_is_the_model_plus_one_tensor(tmp_path):
    """Load ~60 MB of weights in a fresh process: its peak resident memory grows by the model plus at most two
    copies of the largest tensor (read, then permuted), never by the model twice (what reading a whole file, or
    keeping one mapping open for all reads, costs)."""
    from benchmarks.hf_load import write_random_hf

    folder, model_bytes, largest = write_random_hf(tmp_path / "hf", dim=384, n_layers=4, vocab_size=16384)
    assert model_bytes > 50 * 2**20
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(folder)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # 16 MiB: allocator and Python objects made during the load (measured: under 8 MiB).
    bound = model_bytes + 2 * largest + 16 * 2**20
    assert 0.9 * model_bytes < report["peak_growth_bytes"] < bound, (report, model_bytes, largest)
    assert report["peak_growth_bytes"] < 1.5 * model_bytes  # so never the model twice


def test_an_export_removes_nothing_it_did_not_write(tmp_path):
    # Decoys named as an earlier temp folder of this process would be: an export creates its own and keeps them.
    from graph_trainer.runtime.fsutil import TEMP_SUFFIX

    decoys = [tmp_path / f".out.{os.getpid()}{TEMP_SUFFIX}", tmp_path / f".out.{TEMP_SUFFIX}"]
    for decoy in decoys:
        decoy.mkdir()
        (decoy / "keep.txt").write_text("user data")
    save_hf(Transformer(our_args()).state_dict(), Llama3StateDictAdapter(our_args()), tmp_path / "out")
    assert all((d / "keep.txt").read_text() == "user data" for d in decoys)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *(d.name for d in decoys)])
