"""A model family is one folder and one registry line: a third family, defined in this file, trains, plans and
checkpoints through the trainer's own command line with no other change.

`TinyGPT` is GPT-2-shaped, unlike both shipped families: learned positions instead of RoPE, LayerNorm with
biases, a GELU MLP, full multi-head attention. The trainer's processes register it the way `models/__init__.py`
registers the others (`MODELS[SPEC.name] = SPEC`) before the trainer's config schema is built, so its own args
(`n_positions_scale` included, a field no other family has) become `[model]` options with their help and limits.
Nothing here imports `graph_trainer` at module level: like a family under `models/`, the family is plain PyTorch.

Claims tested (6 and 8 blocks: the preflight and the dry run plan depth-free):
- `--help --model.name tiny_gpt` lists the family's own option; an out-of-range value is one line, exit 2;
- traced == eager bitwise (losses over 3 steps, final weights), the traced run resumed from its own step-2
  checkpoint for step 3, with the step's measured peak equal to the depth-free estimate;
- `--dry-run` at 8 blocks plans from 3 + 4 blocks.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.common.spec import ModelArgsError, ModelSpec, ParallelPlan, arg

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TinyGPTArgs:
    dim: int = arg(64, "model width", ge=1)
    n_layers: int = arg(6, "number of transformer blocks", ge=1)
    n_heads: int = arg(4, "attention heads", ge=1)
    vocab_size: int = arg(258, "vocabulary size (must cover the tokenizer's ids)", ge=1)
    max_seq_len: int = arg(256, "longest sequence the learned positions cover", ge=1)
    norm_eps: float = arg(1e-5, "LayerNorm epsilon", gt=0)
    n_positions_scale: float = arg(0.02, "std of the learned position embeddings at init", gt=0, le=1)

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ModelArgsError(f"model dim {self.dim} is not divisible by n_heads {self.n_heads}; pick one that is")


class Block(nn.Module):
    def __init__(self, args: TinyGPTArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(args.dim, args.norm_eps), nn.LayerNorm(args.dim, args.norm_eps)
        self.qkv, self.proj = nn.Linear(args.dim, 3 * args.dim), nn.Linear(args.dim, args.dim)
        self.fc, self.out = nn.Linear(args.dim, 4 * args.dim), nn.Linear(4 * args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.n_heads, -1).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(d, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    def __init__(self, args: TinyGPTArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.positions = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.hidden_states(tokens))

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)

    def init_buffers(self) -> None:
        pass  # no buffers: the positions are learned

    @torch.no_grad()
    def init_weights(self) -> None:
        if self.output.weight.device.type == "meta":
            return
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        nn.init.normal_(self.positions.weight, std=self.args.n_positions_scale)


def _num_params(args: TinyGPTArgs) -> int:
    block = 12 * args.dim * args.dim + 13 * args.dim  # qkv, proj, fc, out with biases; two LayerNorms
    return 2 * args.vocab_size * args.dim + args.max_seq_len * args.dim + args.n_layers * block + 2 * args.dim


def _flops_per_token(args: TinyGPTArgs, seq_len: int) -> float:
    matmuls = args.n_layers * 12 * args.dim * args.dim + args.vocab_size * args.dim
    return 6 * matmuls + 12 * args.n_layers * args.dim * seq_len  # attention scores and values, causal or not


SPEC = ModelSpec(
    name="tiny_gpt",
    args_cls=TinyGPTArgs,
    model_cls=TinyGPT,
    flavors={"debugmodel": TinyGPTArgs()},
    num_params=_num_params,
    flops_per_token=_flops_per_token,
    parallel_plan=ParallelPlan(layers="layers"),
)

# The trainer's command line in a fresh process with this family registered first, as models/__init__.py would.
_REGISTERED = (
    "import sys, models; from tests.models.test_model_family_seam import SPEC; models.MODELS[SPEC.name] = SPEC; "
    "from graph_trainer.__main__ import main; sys.exit(main(sys.argv[1:]))"
)
FAMILY = ["--model.name", "tiny_gpt", "--model.flavor", "debugmodel"]
RUN = [*FAMILY, "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.deterministic", "true"]
RUN += ["--metrics.enable_tensorboard", "false", "--training.steps", "3", "--lr_scheduler.decay_type", "none"]


def _trainer(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _REGISTERED, *argv],
        cwd=cwd,
        env={"PYTHONPATH": str(REPO), "PATH": "", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _summary(dump: Path) -> dict:
    return json.loads((dump / "summary.json").read_text())


def _losses(dump: Path) -> list[float]:
    return [step["loss"] for step in _summary(dump)["steps"]]


def test_the_family_is_the_models_and_counts_it_declares():
    args = TinyGPTArgs()
    model = TinyGPT(args)
    assert _num_params(args) == sum(p.numel() for p in model.parameters())
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, args.vocab_size)
    with pytest.raises(ModelArgsError, match="not divisible by n_heads"):
        TinyGPTArgs(n_heads=5)
    assert math.isfinite(_flops_per_token(args, 32))


def test_its_own_args_are_options_with_help_and_limits(tmp_path):
    shown = _trainer(*FAMILY, "--help", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "--model.n_positions_scale" in shown.stdout and "std of the learned position embeddings" in shown.stdout
    refused = _trainer(*RUN, "--model.n_positions_scale", "2", "--job.dump_folder", str(tmp_path / "x"), cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "model.n_positions_scale" in refused.stderr


@pytest.mark.integration
def test_it_trains_traced_as_eager_plans_depth_free_and_resumes_bitwise(tmp_path):
    """About 40 s on 2 cores: three short runs and a dry run, each its own process."""
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "1"]
    # The traced run in two parts: steps 1-2, then resumed from its step-2 checkpoint for step 3.
    runs = {
        "eager": [*RUN, "--compile.mode", "eager"],
        "first": [*RUN, "--compile.mode", "trace", *ckpt, "--training.steps", "2"],
    }
    for name, argv in runs.items():
        done = _trainer(*argv, "--job.dump_folder", str(tmp_path / name), cwd=tmp_path)
        assert done.returncode == 0, (name, done.stderr[-3000:])
    first = _losses(tmp_path / "first")
    resumed = _trainer(*RUN, "--compile.mode", "trace", *ckpt, "--checkpoint.resume", "true", "--job.dump_folder",
                       str(tmp_path / "first"), cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    eager = _losses(tmp_path / "eager")
    assert len(eager) == 3 and first == eager[:2] and _losses(tmp_path / "first")[-1:] == eager[2:]
    final = [_summary(tmp_path / name)["final"] for name in ("eager", "first")]
    assert final[0]["params_sha256"] == final[1]["params_sha256"]  # the same weights after step 3
    assert (
        "preflight: depth-free plan, models of 3 + 4 blocks traced for a model of 6" in resumed.stdout + resumed.stderr
    )
    steps = _summary(tmp_path / "first")["steps"]
    assert all(r["peak_active_bytes"] == r["estimated_peak_bytes"] for r in steps), steps
    dry = _trainer(*RUN, "--model.n_layers", "8", "--dry-run", "--job.dump_folder", str(tmp_path / "dry"),
                   cwd=tmp_path)  # fmt: skip
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "blocks traced: 3 + 4 for a model of 8" in dry.stdout + dry.stderr
