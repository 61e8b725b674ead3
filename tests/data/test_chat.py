"""Instruction and chat fine-tuning data (graph_trainer/data/chat.py): only the answers count, decided by the
chat template's rendering; whole rows packed; one line for every bad row; the global count divides the loss; and
the loss of a 6-layer Hugging Face folder's first step equals transformers' on the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graph_trainer import __main__ as cli
from graph_trainer.data.chat import ChatTemplate, Encoded, Row, encode_row, pack_rows, read_rows
from graph_trainer.data.loader import build_dataloader
from graph_trainer.data.packing import DOCUMENT_IDS, IGNORE_LABEL
from graph_trainer.data.tokenizer import ByteTokenizer
from graph_trainer.errors import UserError
from graph_trainer.job_config.cli import load_config
from tests.extras import import_extra
from tests.tiny import TINY

BYTE = ByteTokenizer()
EOT = "<|eot|>"
# Llama 3's shape of template: a header per turn, the turn's end token, the assistant's header as generation prompt.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}" + EOT + "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six."},
]


def byte_template() -> ChatTemplate:
    return ChatTemplate(TEMPLATE, "test template", {"bos_token": ""})


def counted_text(enc: Encoded) -> list[str]:
    """The counted runs of `enc`, decoded (byte tokens: each run is exactly its text)."""
    runs, run = [], []
    for token, counts in zip(enc.ids.tolist(), enc.counted.tolist(), strict=True):
        if counts:
            run.append(token)
        elif run:
            runs.append(BYTE.decode(run))
            run = []
    return runs + ([BYTE.decode(run)] if run else [])


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_only_the_answers_count_as_the_rendering_decides():
    enc = encode_row(Row({"messages": CHAT}, "x:1"), BYTE, byte_template())
    # The answer and the template's end of turn, nothing of the headers, the system or the user.
    assert counted_text(enc) == ["Four." + EOT, "Six." + EOT]
    assert BYTE.decode(enc.ids.tolist()) == byte_template().render(CHAT, add_generation_prompt=False)


def test_prompt_and_completion_count_the_completion_and_its_eos():
    enc = encode_row(Row({"prompt": "Q: 2+2? A: ", "completion": "4"}, "x:1"), BYTE, None)
    assert enc.ids.tolist() == [BYTE.bos_id, *b"Q: 2+2? A: ", *b"4", BYTE.eos_id]
    assert enc.counted.tolist() == [False] * 12 + [True, True]


def test_rows_are_packed_whole_cut_to_the_window_or_dropped_and_counted():
    def row(prompt: int, answer: int) -> Encoded:
        return Encoded(torch.arange(prompt + answer, dtype=torch.int32) + 1,
                       torch.tensor([False] * prompt + [True] * answer))  # fmt: skip

    # seq_len 7: windows of 8. Rows of 5, 4 (does not fit beside the first: a new window), 3 (fits beside it),
    # 12 (cut to 8), and 9 + 1 whose answer lies beyond the cut (dropped).
    packed = pack_rows(iter([row(3, 2), row(2, 2), row(1, 2), row(4, 8), row(9, 1)]), 7, pad_id=0)
    assert packed.windows.tolist() == [
        [1, 2, 3, 4, 5, 0, 0, 0],
        [1, 2, 3, 4, 1, 2, 3, 0],
        [1, 2, 3, 4, 5, 6, 7, 8],
    ]
    assert (packed.rows, packed.truncated, packed.dropped) == (4, 2, 1)
    # Each row and each run of padding is a document of its own (stream offsets: window w starts at 8 w).
    assert packed.document_starts.tolist() == [0, 5, 8, 12, 15, 16]
    from graph_trainer.data.loader import ShuffledWindows
    from graph_trainer.data.packing import PackedLoader

    order = ShuffledWindows(packed.windows, batch_size=3, seed=0, document_starts=packed.document_starts,
                            counted=packed.counted)  # fmt: skip
    loader = PackedLoader(order)
    batch = next(loader)
    by_row = {tuple(w): i for i, w in enumerate(packed.windows[:, :-1].long().tolist())}
    for b in range(3):
        w = by_row[tuple(batch["input"][b].tolist())]
        labels = batch["labels"][b]
        expected = torch.where(packed.counted[w, 1:], packed.windows[w, 1:].long(), IGNORE_LABEL)
        assert torch.equal(labels, expected)
    assert batch[DOCUMENT_IDS].shape == (3, 7)


@pytest.mark.parametrize(
    ("row", "named"),
    [
        ({"messages": CHAT[:2]}, "no assistant turn"),
        ({"question": "?", "answer": "!"}, "no 'messages', nor string 'prompt' and 'completion' (its fields: answer"),
        ({"messages": [{"role": "user"}]}, "message 0 has no string 'role' and 'content'"),
        ({"messages": [*CHAT[:2], {"role": "tool", "content": "x"}, CHAT[2]]}, "fails to render it: no tools here"),
    ],
)
def test_a_bad_row_is_one_line_naming_the_file_and_row(tmp_path, capsys, row, named):
    template = TEMPLATE.replace("{% for m in messages %}",
                                "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools "
                                "here') }}{% endif %}")  # fmt: skip
    (tmp_path / "template.jinja").write_text(template)
    rows = write_rows(tmp_path / "chats.jsonl", [{"messages": CHAT}] * 3 + [row])
    code = cli.main([*TINY, "--data.path", str(rows), "--data.chat_template", str(tmp_path / "template.jinja"),
                     "--training.steps", "1", "--job.dump_folder", str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {rows}:4: ") and named in err, err


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    # The last message is rendered apart from the others: the answers' tokens cannot be found by prefixes.
    rewriting = ChatTemplate("{% for m in messages %}{% if loop.last %}[{% endif %}{{ m['content'] }}{% endfor %}",
                             "rewriting", {})  # fmt: skip
    with pytest.raises(UserError, match="renders turn 2 differently once later turns follow"):
        encode_row(Row({"messages": CHAT}, "x:1"), BYTE, rewriting)


def test_messages_without_a_template_say_how_to_give_one():
    with pytest.raises(UserError, match="need a chat template.*set data.chat_template"):
        encode_row(Row({"messages": CHAT}, "x:1"), BYTE, None)


def test_the_data_path_alone_reads_instruction_rows_with_document_masking(tmp_path):
    rows = write_rows(tmp_path / "chats.jsonl", [{"prompt": "a", "completion": "b"}])
    cfg, _ = load_config(["--data.path", str(rows)])
    assert (cfg.data.source, cfg.data.document_masking) == ("chat", True)
    cfg, _ = load_config(["--data.path", str(rows), "--data.document_masking", "false"])
    assert (cfg.data.source, cfg.data.document_masking) == ("chat", False)  # what the user says wins
    text = write_rows(tmp_path / "docs.jsonl", [{"text": "a"}])
    cfg, _ = load_config(["--data.path", str(text)])
    assert (cfg.data.source, cfg.data.document_masking) == ("jsonl", False)
    # json and parquet rows too
    (tmp_path / "chats.json").write_text(json.dumps([{"messages": CHAT}]))
    assert load_config(["--data.path", str(tmp_path / "chats.json")])[0].data.source == "chat"
    import_extra("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "completion": "b"}] * 3), tmp_path / "rows.parquet")
    assert load_config(["--data.path", str(tmp_path / "rows.parquet")])[0].data.source == "chat"
    rows = list(read_rows(str(tmp_path / "rows.parquet")))
    assert [r.data for r in rows] == [{"prompt": "a", "completion": "b"}] * 3 and rows[2].where.endswith("row 3")


# --------------------------------------------------------------------------- the loss


def prompt_rows(n: int) -> list[dict]:
    """Rows whose counted tokens differ a lot: long prompts with short answers, and the other way round."""
    return [
        {"prompt": f"question {i}: " + "why " * (1 + 7 * (i % 2)), "completion": "because " * (1 + 6 * (i % 3 == 0))}
        for i in range(n)
    ]


@pytest.mark.parametrize("kind", ["eager", "traced"])
def test_the_global_count_divides_the_loss_not_a_mean_of_means(tmp_path, kind):
    """Two micro-batches, or two data-parallel ranks, holding very different numbers of counted tokens give the
    loss and gradients of the one batch made of both (the sum over counted tokens over their count); a mean of
    the two means does not. The ranks are simulated in one process: each divides by the count all-reduced over
    both (what the data-parallel `count_reduce` gives), and their gradients are averaged (what FSDP does)."""
    from graph_trainer.eager.step import EagerStep
    from graph_trainer.job_config.load import resolve_model_args
    from graph_trainer.tracer.executor import GraphStep
    from models.llama3 import Transformer

    rows = write_rows(tmp_path / "rows.jsonl", prompt_rows(16))
    loader = build_dataloader("chat", str(rows), BYTE, batch_size=2, seq_len=64, seed=0, document_masking=True)
    batch = next(loader)
    counts = [(batch["labels"][i] != IGNORE_LABEL).sum() for i in range(2)]
    assert max(counts) >= 2 * min(counts), counts  # very different counts
    torch.manual_seed(0)
    model = Transformer(resolve_model_args(load_config(TINY)[0]))

    def step(part: dict, **kw) -> tuple[float, list[torch.Tensor]]:
        loss = (EagerStep if kind == "eager" else GraphStep)(model, **kw)(part).loss.item()
        return loss, [p.grad.clone() for p in model.parameters()]

    whole, whole_grads = step(batch, count_tokens=True)
    halves = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(2)]
    total = sum(counts)

    def ranks(count_tokens: bool) -> tuple[float, list[torch.Tensor]]:
        runs = [step(h, count_tokens=count_tokens, count_reduce=lambda c: total / 2) for h in halves]
        loss = sum(loss for loss, _ in runs) / 2  # the logged loss: the ranks' mean, as for the gradients
        return loss, [(a + b) / 2 for a, b in zip(runs[0][1], runs[1][1], strict=True)]

    # The same sums in another order (per part, then added or averaged): float32 rounding, measured 0 (accumulated)
    # and 4.4e-8 (two ranks) relative on the loss, 6.0e-8 absolute on gradients of up to 0.45; bounds 1e-6.
    for loss, grads in (step(batch, count_tokens=True, accumulation_steps=2), ranks(count_tokens=True)):
        assert abs(loss - whole) <= 1e-6 * abs(whole), (loss, whole)
        for a, b in zip(grads, whole_grads, strict=True):
            assert (a - b).abs().max().item() <= 1e-6
    # Without the global count each rank divides by its own: a mean of means, measured 0.9% off on the loss and
    # 0.085 on a gradient, far beyond the rounding.
    loss, grads = ranks(count_tokens=False)
    assert abs(loss - whole) > 1e-3 * abs(whole)
    assert max((a - b).abs().max().item() for a, b in zip(grads, whole_grads, strict=True)) > 1e-4


def test_traced_equals_eager_bitwise_on_chat_batches(tmp_path):
    from graph_trainer.trainer import Trainer

    rows = write_rows(tmp_path / "rows.jsonl", prompt_rows(16))

    def run(*extra: str):
        cfg, _ = load_config([*TINY, "--data.path", str(rows), "--training.seq_len", "64", "--training.steps", "2",
                              "--job.dump_folder", str(tmp_path / "_".join(extra or ("traced",))), *extra])  # fmt: skip
        return Trainer(cfg).train()

    traced, eager = run(), run("--compile.mode", "eager")
    assert traced.losses == eager.losses
    assert traced.grads_sha256 == eager.grads_sha256 and traced.trace_count == 1


@pytest.mark.integration  # the README's three commands: a 6-layer stand-in written by transformers, 20 steps, export
def test_the_readme_fine_tune_gives_transformers_loss_on_the_answers_and_exports(tmp_path, monkeypatch):
    """The product promise, as the README types it: `--checkpoint.initial_load_path DIR --data.path chats.jsonl`
    and no model or data option. The folder is the model and the tokenizer, its chat template renders the rows,
    the first step's loss is transformers' on the same tokens with every label but the answers' at -100, the
    held-out chats are evaluated, and the export loads in transformers."""
    import os
    import subprocess
    import sys

    from graph_trainer.builder import build_data
    from graph_trainer.distributed.launch import single_process
    from tests.checkpoint.test_hf_weights import LOGITS_ATOL, LOSS_RTOL, transformers
    from tests.test_docs import CHAT_FINETUNE

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}  # fmt: skip
    (tmp_path / "examples").symlink_to(repo / "examples")  # the commands run from the repository root, outputs aside
    result = subprocess.run(["bash", "-c", " && ".join(CHAT_FINETUNE)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "preflight: depth-free plan, models of 3 + 4 blocks traced for a model of 6" in out
    assert "instruction data outputs/chat/chats.jsonl: 64 rows" in out and "0 dropped" in out
    summary = json.loads((tmp_path / "outputs/chat_run/summary.json").read_text())
    losses = [s["loss"] for s in summary["steps"]]
    assert summary["validation"] and losses[-1] < losses[0]
    assert all(0 < s["counted_fraction"] < 0.5 for s in summary["steps"])  # the answers only, logged each step
    assert "counted " in out

    # Step 1's loss against transformers, on the batch the run read first (the same loader, rebuilt).
    argv = shlex_argv(CHAT_FINETUNE[1])
    monkeypatch.chdir(tmp_path)  # the loader reads the relative paths the README typed
    cfg, _ = load_config(argv)
    batch = next(iter(build_data(cfg, single_process(cfg)).loader))
    # transformers has no document mask: each chat runs alone through it, its per-token losses summed, and the sum
    # divided by the batch's count of counted labels, as ours divides it.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "outputs/chat/model").eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for b, ids in enumerate(batch[DOCUMENT_IDS]):
            for doc in ids.unique():
                where = ids == doc
                logits = hf(batch["input"][b][where][None]).logits[0]
                labels = batch["labels"][b][where]
                total += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
                count += int((labels != IGNORE_LABEL).sum())
    theirs = total / count
    assert abs(losses[0] - theirs) <= LOSS_RTOL * theirs, (losses[0], theirs)
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "outputs/chat_tuned").eval()
    with torch.no_grad():
        moved = (tuned(batch["input"]).logits - hf(batch["input"]).logits).abs().max().item()
    assert moved > 100 * LOGITS_ATOL  # the export holds the fine-tuned weights, not the folder's


def shlex_argv(command: str) -> list[str]:
    """A documented `python -m graph_trainer ...` command's arguments."""
    import shlex

    return shlex.split(command)[3:]
