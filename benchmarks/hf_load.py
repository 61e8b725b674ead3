"""Load time and peak host memory of reading Hugging Face weights into the model (checkpoint.initial_load_path).

    python benchmarks/hf_load.py                          # Llama-3.2 1B dimensions, 4 layers, bf16 files
    python benchmarks/hf_load.py --layers 16              # all 16 layers: 4.6 GiB in float32
    python benchmarks/hf_load.py --file-dtype float32 --naive
    python -m benchmarks.hf_load --doc                    # docs/hf_weights.md's rows -> benchmarks/results/

Writes a random model of the 1B flavor's shape (RoPE scaling, tied embeddings; `--dim`, `--layers`,
`--vocab` change it) as a Hugging Face folder in a temporary place, then loads it in a fresh process
and reports the seconds and the growth of the peak resident memory (VmHWM, reset before the load through
/proc/self/clear_refs) against the model's own size. `--naive` also measures the one-liner this loader
replaces (materialize the model, `safetensors.torch.load_file`, `load_state_dict`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: `python benchmarks/hf_load.py`

import torch  # noqa: E402

from benchmarks import results  # noqa: E402
from graph_trainer.checkpoint.hf import Pretrained, save_hf  # noqa: E402
from graph_trainer.distributed.parallelism import ParallelModel  # noqa: E402
from graph_trainer.job_config.model_args import build_model_args  # noqa: E402
from models import MODELS  # noqa: E402
from models.llama3 import Llama3StateDictAdapter, Transformer  # noqa: E402


def bench_args(dim: int, n_layers: int, vocab_size: int):
    """The 1B flavor (tied embeddings, RoPE scaling, 32 heads, 8 KV heads) at another width, depth, vocabulary."""
    return build_model_args("llama3", "1B", {"dim": dim, "n_layers": n_layers, "vocab_size": vocab_size})


def write_random_hf(
    folder: Path, *, dim: int, n_layers: int, vocab_size: int, dtype: torch.dtype = torch.float32
) -> tuple[Path, int, int]:
    """A random model as a Hugging Face folder. Returns (folder, bytes of the loaded float32 model, bytes of its
    largest float32 tensor)."""
    args = bench_args(dim, n_layers, vocab_size)
    torch.manual_seed(0)
    model = Transformer(args)
    save_hf(model.state_dict(), Llama3StateDictAdapter(args), folder, dtype=dtype)
    params = list(model.parameters())  # tied weights once
    return folder, sum(p.numel() * 4 for p in params), max(p.numel() * 4 for p in params)


def _status(key: str) -> int:
    """A /proc/self/status memory figure (kB there) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def load_and_measure(
    folder: str,
    dim: int,
    n_layers: int,
    vocab_size: int,
    naive: bool = False,
    rank: tuple[int, int, int, int] | None = None,
) -> str:
    """In a fresh process: load `folder` into the meta-built model; JSON with seconds and peak RSS growth.

    `naive`: the one-liner instead (materialize the model, read the whole file, `load_state_dict`), timed from the
    same meta model, so both figures include allocating the model's memory. `rank` = (tp rank, tp, dp rank, dp):
    the model split as that rank of tensor parallelism, then FSDP-sharded as that rank of dp_shard, as a rank of
    a `tp x dp_shard` run holds it (splitting and loading need no process group), so the load reads only its part.
    `model_bytes` is then that rank's part."""
    args = bench_args(dim, n_layers, vocab_size)
    with torch.device("meta"):
        model = Transformer(args)
    parallel = ParallelModel(model, None) if rank is None else _split(model, *rank)
    _reset_peak()
    before = _status("VmRSS")
    start = time.perf_counter()
    if naive:
        _naive_load(model, args, Path(folder))
    else:
        Pretrained.open(folder, MODELS["llama3"], args).load_into(model, parallel, "cpu")
    seconds = time.perf_counter() - start
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    report = {"seconds": seconds, "peak_growth_bytes": _status("VmHWM") - before, "model_bytes": model_bytes}
    return json.dumps(report)


def _split(model: Transformer, tp_rank: int, tp: int, dp_rank: int, dp: int) -> ParallelModel:
    """`model` (on meta) split as rank `tp_rank` of tp, then sharded as rank `dp_rank` of dp_shard."""
    from graph_trainer.distributed.fsdp import ShardGroup, fully_shard_model
    from graph_trainer.distributed.tp import tensor_parallelize

    plan = MODELS["llama3"].parallel_plan
    parts = [tensor_parallelize(model, ShardGroup(tp_rank, tp, "unused"), plan.tensor_parallel, plan.layers)]
    parts.append(fully_shard_model(model, ShardGroup(dp_rank, dp, "unused"), layers=plan.layers))
    return ParallelModel(model, None, parts)


def _naive_load(model: Transformer, args, folder: Path) -> None:
    from safetensors.torch import load_file

    model.to_empty(device="cpu")
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # to_empty unties them
    model.init_buffers()
    model.load_state_dict(Llama3StateDictAdapter(args).from_hf(load_file(folder / "model.safetensors")))


def _measure(folder: Path, a: argparse.Namespace, naive: bool) -> dict:
    code = (
        "import sys; from benchmarks.hf_load import load_and_measure; "
        f"print(load_and_measure(sys.argv[1], {a.dim}, {a.layers}, {a.vocab}, naive={naive}))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(folder)], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


# docs/hf_weights.md's rows (`--doc`): (label, layers, file dtype, also the naive load).
DOC_ROWS = (
    ("1B dims, 16 layers (`--layers 16`)", 16, "bfloat16", False),
    ("1B dims, 4 layers (`--naive`)", 4, "bfloat16", True),
    ("1B dims, 4 layers, float32 files", 4, "float32", True),
)


def measure_loads(a: argparse.Namespace, folder: Path, layers: int, file_dtype: str, naive: bool) -> dict:
    """Write (or reuse) the random model in `folder` and load it `a.repeat` times each way, alternating:
    {"model_bytes": float32 size, loader name: [its measurements]}."""
    setting = argparse.Namespace(**{**vars(a), "layers": layers})
    model_bytes = sum(p.numel() * 4 for p in _meta_params(setting))
    if not folder.exists():
        start = time.perf_counter()
        write_random_hf(folder, dim=a.dim, n_layers=layers, vocab_size=a.vocab, dtype=getattr(torch, file_dtype))
        print(f"wrote {folder} in {time.perf_counter() - start:.1f} s")
    file_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(
        f"model: dim {a.dim}, {layers} layers, vocab {a.vocab}: {model_bytes / 2**30:.2f} GiB in float32; "
        f"files {file_bytes / 2**30:.2f} GiB"
    )
    found: dict = {"model_bytes": model_bytes}
    for _ in range(a.repeat):
        for what in ("this loader", "load_file + load_state_dict") if naive else ("this loader",):
            r = _measure(folder, setting, what != "this loader")
            found.setdefault(what, []).append(r)
            growth = r["peak_growth_bytes"]
            print(
                f"{what}: {r['seconds']:.2f} s, peak RSS growth {growth / 2**30:.2f} GiB "
                f"= {growth / model_bytes:.2f} x the model"
            )
    return found


def _span(xs: list[float], fmt: str) -> str:
    """`4.9 - 5.3` over repeated measurements, or one figure when they round alike."""
    lo, hi = format(min(xs), fmt), format(max(xs), fmt)
    return lo if lo == hi else f"{lo} - {hi}"


def save_doc_rows(a: argparse.Namespace, tmp: Path) -> None:
    """Measure `DOC_ROWS` and save them as docs/hf_weights.md's table."""
    rows, data = [], {}
    for label, layers, file_dtype, naive in DOC_ROWS:
        found = data[label] = measure_loads(a, tmp / f"{layers}_{file_dtype}", layers, file_dtype, naive)
        size = found["model_bytes"]
        for i, what in enumerate(w for w in found if w != "model_bytes"):
            growth = max(r["peak_growth_bytes"] for r in found[what])
            rows.append(
                [label if i == 0 else "", f"{size / 2**30:.2f} GiB" if i == 0 else "", what]
                + [_span([r["seconds"] for r in found[what]], ".1f")]
                + [f"{growth / 2**30:.2f} GiB ({growth / size:.2f} x)"]
            )
    header = ["model", "float32 size", "loader", "seconds", "peak RSS growth"]
    results.save("hf_load", {"hf_load": results.markdown_table(header, rows)}, data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--file-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--naive", action="store_true", help="also measure load_file + load_state_dict")
    parser.add_argument("--repeat", type=int, default=2, help="measurements of each, alternating (noise shows)")
    parser.add_argument("--folder", type=Path, help="write the model here, or reuse it (default: a temp folder)")
    parser.add_argument("--doc", action="store_true", help="measure docs/hf_weights.md's rows and save them")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gt_hf_bench_") as tmp:
        if a.doc:
            save_doc_rows(a, Path(tmp))
        else:
            measure_loads(a, a.folder or Path(tmp) / "hf", a.layers, a.file_dtype, a.naive)


def _meta_params(a: argparse.Namespace) -> list[torch.nn.Parameter]:
    with torch.device("meta"):
        return list(Transformer(bench_args(a.dim, a.layers, a.vocab)).parameters())


if __name__ == "__main__":
    main()
