"""data.source = "hf_datasets": formats, lanes (one a row of the global batch) packed in order, the same global
batch at any data-parallel degree, exact resume (on other ranks too), and its one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch

from graph_trainer import __main__ as cli
from graph_trainer.data.hf_datasets import Shuffle, build_hf_loader
from graph_trainer.data.loader import pack_windows, tokenize_documents
from graph_trainer.data.tokenizer import ByteTokenizer
from graph_trainer.errors import ConfigError, UserError
from graph_trainer.job_config.cli import load_config
from tests.extras import import_extra
from tests.tiny import TINY

datasets = import_extra("datasets")

BYTE = ByteTokenizer()
# Rows of uneven lengths, one empty (it adds no token, not even EOS), so windows cross row boundaries.
ROWS = [f"row {i}: " + "abcdefghij" * (i % 7) for i in range(40)]
ROWS[5] = ""


def write(folder: Path, fmt: str, rows: list[str] = ROWS, column: str = "text", files: int = 1) -> Path:
    """`rows` as `files` files of format `fmt` (parquet, jsonl, arrow) in `folder`; the file, or the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(rows) // files)
    for k in range(files):
        part = datasets.Dataset.from_dict({column: rows[k * per : (k + 1) * per], "n": list(range(per))[: len(rows)]})
        path = folder / f"part-{k}.{fmt}"
        if fmt == "parquet":
            part.to_parquet(str(path))
        elif fmt == "jsonl":
            part.to_json(str(path))
        else:  # an Arrow stream file, as `datasets` caches write them
            import pyarrow as pa

            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, part.data.schema) as writer:
                writer.write_table(part.data.table)
    return folder / "part-0.parquet" if files == 1 and fmt == "parquet" else folder


def loader(path: Path, streaming: bool, **kw):
    args = dict(text_column="text", streaming=streaming, batch_size=2, seq_len=16)
    return build_hf_loader(str(path), BYTE, **(args | kw))


def expected_batches(lanes: list[list[str]], n: int, seq_len: int = 16) -> list[torch.Tensor]:
    """The first n batches whose row j is lane j's rows packed in order, each lane running on into its next pass."""
    per_lane = []
    for rows in lanes:
        stream = tokenize_documents(iter(rows), BYTE)
        per_lane.append(pack_windows(stream.repeat(n * (seq_len + 1) // stream.numel() + 1), seq_len)[:n])
    return [torch.stack([w[i] for w in per_lane]).long() for i in range(n)]


def assert_batches(got, expected):
    for g, w in zip(got, expected, strict=True):
        assert torch.equal(g["input"], w[:, :-1]) and torch.equal(g["labels"], w[:, 1:])


HALVES = [ROWS[:20], ROWS[20:]]  # two lanes of a loaded dataset, or of a stream of two files: contiguous parts
ALTERNATE = [ROWS[0::2], ROWS[1::2]]  # two lanes of a one-file stream: every second row


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "arrow"])
@pytest.mark.parametrize("streaming", [False, True])
def test_every_format_loaded_or_streamed_packs_the_rows_in_order_across_passes(tmp_path, fmt, streaming):
    path = write(tmp_path / fmt, fmt, files=2 if fmt == "jsonl" else 1)  # a folder of 2 jsonl files too
    n = 40  # 40 x 17 tokens a lane: more than the ~575 of its rows, so each lane wraps into its next pass
    lanes = ALTERNATE if streaming and fmt != "jsonl" else HALVES
    assert_batches(list(islice(loader(path, streaming), n)), expected_batches(lanes, n))


def test_a_null_text_is_an_empty_row(tmp_path):
    rows = ["first row " * 4, None, "third row " * 4]
    datasets.Dataset.from_dict({"text": rows}).to_parquet(str(tmp_path / "nulls.parquet"))
    got = list(islice(loader(tmp_path / "nulls.parquet", True, batch_size=1), 4))
    assert_batches(got, expected_batches([[r or "" for r in rows]], 4))


def test_a_save_to_disk_folder_is_read(tmp_path):
    datasets.Dataset.from_dict({"text": ROWS}).save_to_disk(str(tmp_path / "saved"))
    assert_batches(list(islice(loader(tmp_path / "saved", False), 5)), expected_batches(HALVES, 5))


def _lane_rows(loader_, epoch: int = 0) -> list[list[str]]:
    return [list(lane.rows(0, epoch)) for lane in loader_.order.lanes]


@pytest.mark.parametrize("streaming", [False, True])
def test_data_parallel_ranks_read_disjoint_lanes_that_cover_the_rows(tmp_path, streaming):
    path = write(tmp_path, "parquet", files=2)
    lanes = [rows for rank in range(2) for rows in _lane_rows(loader(path, streaming, data_rank=rank, data_size=2))]
    assert len(lanes) == 4 and all(lanes)
    assert sum(len(rows) for rows in lanes) == len(ROWS) and sorted(r for rows in lanes for r in rows) == sorted(ROWS)


@pytest.mark.parametrize("streaming", [False, True])
def test_the_global_batch_is_the_same_sequences_at_any_data_parallel_degree_and_resumes_across_them(
    tmp_path, streaming
):
    """A global batch of 4 sequences read by 1 rank x 4, 2 ranks x 2 or 4 ranks x 1: the same rows every step, and a
    position saved at one degree resumes at another onto exactly the batches the run would have read. 38 rows: 4
    lanes do not divide them (lanes cut from each rank's rows would then differ from lanes cut from all rows)."""
    path = write(tmp_path, "jsonl", rows=ROWS[:38], files=2)

    def ranks(n: int, **kw) -> list:
        return [loader(path, streaming, batch_size=4 // n, data_rank=r, data_size=n, **kw) for r in range(n)]

    def global_batches(loaders: list, steps: int) -> list[torch.Tensor]:
        return [torch.cat([next(it)["input"] for it in loaders]) for _ in range(steps)]

    whole = global_batches(ranks(1), 12)
    assert all(torch.equal(a, b) for a, b in zip(global_batches(ranks(2), 12), whole, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(global_batches(ranks(4), 12), whole, strict=True))
    two = ranks(2)
    global_batches(two, 5)
    positions = [lane.position() for it in two for lane in it.order.lanes]  # what `gather` collects, in rank order
    state = json.loads(json.dumps({"lanes": 4, "positions": positions}))
    four = ranks(4)
    for it in four:
        it.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(global_batches(four, 7), whole[5:], strict=True))


@pytest.mark.parametrize("streaming", [False, True])
def test_resume_at_any_batch_yields_exactly_the_batches_the_run_would_have_read(tmp_path, streaming):
    path = write(tmp_path, "parquet")
    whole = list(islice(loader(path, streaming), 45))
    for k in (0, 1, 7, 33, 34, 40):  # 33-34: around the end of the first pass
        first = loader(path, streaming)
        list(islice(first, k))
        state = first.state_dict()
        assert state["lanes"] == 2 and len(state["positions"]) == 2
        resumed = loader(path, streaming)
        resumed.load_state_dict(json.loads(json.dumps(state)))  # plain values only (weights_only-safe)
        for got, want in zip(islice(resumed, 5), whole[k : k + 5], strict=True):
            assert torch.equal(got["input"], want["input"]) and torch.equal(got["labels"], want["labels"])


SHUFFLED = dict(shuffle=Shuffle(seed=3, buffer=8))  # a buffer smaller than a slice: the stream is only locally mixed
# jsonl, not parquet: a shuffled parquet stream sleeps 5 s at the end of every pass (`datasets` waits out an Arrow
# thread-shutdown bug, apache/arrow#45214), which would cost these tests a minute and says nothing of ours.


@pytest.mark.parametrize("streaming", [False, True])
def test_shuffled_passes_deal_every_row_once_each_in_its_own_order(tmp_path, streaming):
    path = write(tmp_path, "jsonl", files=2)
    lanes = [lane.rows for lane in loader(path, streaming, batch_size=2, **SHUFFLED).order.lanes]
    passes = [[list(rows(0, epoch)) for rows in lanes] for epoch in range(3)]
    for two in passes:  # every row once per pass, in one lane: the lanes stay disjoint
        assert two[0] and two[1] and sorted(two[0] + two[1]) == sorted(ROWS)
    in_order = list(loader(path, streaming).order.lanes[0].rows(0, 0))
    assert passes[0][0] != in_order and passes[1][0] != passes[0][0]  # shuffled, and anew each pass
    assert passes[0][0] == list(lanes[0](0, 0))  # the order is the seed's and the pass's alone
    assert list(lanes[0](5, 1)) == passes[1][0][5:]  # so a resume at row 5 of pass 1 reads what the pass would have


@pytest.mark.parametrize("streaming", [False, True])
def test_a_shuffled_run_resumes_at_any_batch_exactly(tmp_path, streaming):
    path = write(tmp_path, "jsonl", files=2)
    whole = list(islice(loader(path, streaming, **SHUFFLED), 45))
    assert not all(
        torch.equal(g, w[:, :-1])
        for g, w in zip((b["input"] for b in whole), expected_batches(HALVES, 45), strict=True)
    )
    for k in (1, 33, 40):  # inside the first pass, around its end, inside the second
        first = loader(path, streaming, **SHUFFLED)
        list(islice(first, k))
        resumed = loader(path, streaming, **SHUFFLED)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        for got, want in zip(islice(resumed, 5), whole[k : k + 5], strict=True):
            assert torch.equal(got["input"], want["input"]) and torch.equal(got["labels"], want["labels"])


def test_shuffle_on_a_source_that_always_shuffles_is_refused():
    with pytest.raises(ConfigError, match="data.source = 'embedded' always shuffles its windows"):
        load_config(["--config", "llama3_debug.toml", "--data.shuffle", "true"])


def test_a_position_saved_at_another_global_batch_or_per_rank_is_refused(tmp_path):
    path = write(tmp_path, "parquet")
    state = {"lanes": 4, "positions": [{"epoch": 0, "doc": 3, "token": 0}] * 4}
    with pytest.raises(UserError, match="belong to a global batch of 4 sequences, this job's is 2"):
        loader(path, False).load_state_dict(state)
    per_rank = {"data_ranks": 2, "positions": [{"epoch": 0, "doc": 3, "token": 0}] * 2}  # before lanes
    with pytest.raises(UserError, match="written per data-parallel rank"):
        loader(path, False).load_state_dict(per_rank)


def test_a_position_written_by_the_other_order_is_refused_in_one_line(tmp_path):
    """Both kinds of source resume through one loader (`PackedLoader`), whose state names the order that wrote it: a
    datasets run never reads an in-memory source's position as its own, nor the other way round."""
    from graph_trainer.data.loader import build_dataloader

    path = write(tmp_path, "parquet")
    in_memory = build_dataloader("embedded", "", BYTE, batch_size=2, seq_len=16, seed=0)
    lanes = loader(path, False)
    for reader, writer in ((lanes, in_memory), (in_memory, lanes)):
        with pytest.raises(UserError, match="resume with the data.source it was saved with") as e:
            reader.load_state_dict(writer.state_dict())
        assert "\n" not in str(e.value) and writer.order.name in str(e.value)
    with pytest.raises(UserError, match="was not written for in-memory windows"):  # written before the tag
        in_memory.load_state_dict({"lanes": 2, "positions": []})


def test_the_holdout_rule_splits_rows_by_index(tmp_path):
    path = write(tmp_path, "parquet")
    held = list(loader(path, True, batch_size=1, holdout=(4, True)).order.lanes[0].rows(0, 0))
    kept = list(loader(path, False, batch_size=1, holdout=(4, False)).order.lanes[0].rows(0, 0))
    assert held == [r for i, r in enumerate(ROWS) if i % 4 == 3]
    assert kept == [r for i, r in enumerate(ROWS) if i % 4 != 3]


def _args(tmp_path: Path, *args: str) -> list[str]:
    base = ["--config", "llama3_debug.toml", *TINY, "--training.steps", "1", "--data.source", "hf_datasets"]
    return [*base, "--job.dump_folder", str(tmp_path / "run"), *args]


@pytest.mark.integration  # a subprocess: ~10 s of imports
def test_a_missing_column_exits_2_with_one_line_from_the_command_line(tmp_path):
    path = write(tmp_path / "data", "parquet", column="body")
    cmd = [sys.executable, "-m", "graph_trainer", *_args(tmp_path, "--data.path", str(path))]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: data.path '{path}' has no column 'text' (its columns: body, n); "
        "set data.text_column to the column holding the text"
    ]
    assert not (tmp_path / "run").exists()  # refused before the first write


@pytest.mark.parametrize(
    "make, extra, message",
    [
        (lambda d: write(d, "parquet"), ["--data.text_column", "n"], "column 'n' holds int, not text"),
        (lambda d: _file(d / "x.parquet", b"not parquet at all"), [], "cannot be read as a dataset"),
        (lambda d: _file(d / "x.jsonl", b"{not json\n"), ["--data.streaming", "true"], "cannot be read as a dataset"),
        (lambda d: _file(d / "notes.txt", b"plain text"), [], "is not a .parquet/.json/.jsonl/.arrow file"),
        (lambda d: d / "missing.parquet", [], "does not exist"),
    ],
)
def test_bad_datasets_exit_2_with_one_line(tmp_path, capsys, make, extra, message):
    """The same entry point as `python -m graph_trainer`, in this process (a subprocess costs ~10 s here)."""
    path = make(tmp_path / "data")
    assert cli.main(_args(tmp_path, "--data.path", str(path), *extra)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def _file(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


@pytest.mark.integration
def test_sigkill_then_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    """The CLI on a streamed parquet folder with a validation split, a checkpoint every step: killed with SIGKILL
    after step 3, resumed, it ends with the losses, validation losses and parameters of a run never killed."""
    from tests.checkpoint.test_run_folder import TINY as RUN_TINY
    from tests.test_run_lifecycle import CKPT, EXACT, start, summary, wait_for_step

    path = write(tmp_path / "data", "parquet", rows=ROWS * 3, files=2)
    args = [*EXACT, *CKPT, "--training.steps", "6", "--data.source", "hf_datasets", "--data.path", str(path)]
    args += ["--data.streaming", "true", "--validation.enable", "true", "--validation.freq", "3"]
    args += ["--validation.steps", "1", "--validation.holdout_every", "4"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert cli.main([*RUN_TINY, *args, "--job.dump_folder", str(straight)]) == 0  # in this process: faster
    proc = start(*args, "--job.dump_folder", str(killed), cwd=tmp_path)
    wait_for_step(proc, 3)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -9
    assert any((killed / "checkpoint").glob("step-*.pt"))  # so exit 0 below is a resume (else it is exit 2)
    assert cli.main([*RUN_TINY, *args, "--job.dump_folder", str(killed), "--checkpoint.resume"]) == 0
    want, got = summary(straight), summary(killed)
    assert [s["loss"] for s in got["steps"]] == [s["loss"] for s in want["steps"]]
    assert [v["loss"] for v in got["validation"]] == [v["loss"] for v in want["validation"]]
    assert [v["step"] for v in want["validation"]] == [3, 6]
    assert got["final"]["params_sha256"] == want["final"]["params_sha256"]


def _two_rank_worker(rank: int, port: int, out: str, data: str, parallel: list[str]) -> None:
    from tests.multiprocess import train_runs

    args = ["--config", "llama3_debug.toml", *TINY, *parallel, "--data.source", "hf_datasets"]
    args += ["--data.path", data, "--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2"]
    args += ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--lr_scheduler.decay_type", "none"]
    runs = {
        "straight": ["--training.steps", "4"],
        "first": ["--training.steps", "2", "--job.dump_folder", f"{out}/resumed"],
        "resumed": ["--training.steps", "4", "--job.dump_folder", f"{out}/resumed", "--checkpoint.resume"],
    }
    results = {}
    for name, trainer, result in train_runs(rank, 2, port, runs, args, out):
        results[name] = result
        if name == "straight":  # the logged validation loss is the mean over the two data-parallel ranks
            mine = torch.tensor(trainer.validator.records[-1]["batch_losses"]).mean()
            both = mine.clone()
            torch.distributed.all_reduce(both)
            assert trainer.validator.records[-1]["loss"] == (both / 2).item()
            assert trainer.validator.records[-1]["loss"] != mine.item()  # the ranks held different batches
            # The eval graph traced exactly once; the eager case has no trace to count.
            traced = "eager" not in parallel
            assert trainer.validator.step.report().trace_count == (1 if traced else None)
    assert results["resumed"].losses == results["straight"].losses[2:]
    assert results["resumed"].params_sha256 == results["straight"].params_sha256
    if rank == 0:
        want = json.loads(Path(out, "straight", "summary.json").read_text())["validation"]
        got = json.loads(Path(out, "resumed", "summary.json").read_text())["validation"]
        keys = ("step", "loss", "perplexity", "batch_losses", "estimated_peak_bytes")
        assert [v["step"] for v in got] == [2, 4]
        assert [[v.get(k) for k in keys] for v in got] == [[v.get(k) for k in keys] for v in want]


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "parallel",
    [
        ["--parallelism.dp_shard", "2"],  # every rank writes its state: FSDP's eval graph gathers the weights
        # Only rank 0 writes the checkpoint: it must hold rank 1's position too. Eager: the point is the data.
        ["--parallelism.dp_replicate", "2", "--compile.mode", "eager"],
    ],
    ids=["dp_shard", "dp_replicate"],
)
def test_two_ranks_read_their_lanes_validate_together_and_resume_bitwise(tmp_path, parallel):
    """2 data-parallel ranks on a parquet folder: 4 steps straight against 2 steps then a resume to 4, validated."""
    from tests.multiprocess import free_port, spawn_ranks

    data = write(tmp_path / "data", "parquet", rows=ROWS * 3, files=2)
    spawn_ranks(_two_rank_worker, 2, (free_port(), str(tmp_path), str(data), parallel), timeout_s=600)


def test_the_docs_commands_parse_and_the_example_dataset_is_written(tmp_path):
    """docs/data_and_validation.md's trainer commands are valid configurations (they were run verbatim by hand:
    see the report of issue 22), and examples/make_dataset.py writes the files they read."""
    import runpy
    import shlex

    from graph_trainer.job_config.cli import load_config

    repo = Path(__file__).resolve().parents[2]
    doc = (repo / "docs" / "data_and_validation.md").read_text()
    commands = [shlex.split(line) for line in doc.splitlines() if line.startswith(("python -m ", "torchrun "))]
    assert len(commands) >= 5
    for argv in commands:
        cfg, _ = load_config(argv[argv.index("--config") :])
        assert cfg.data.source in ("hf_datasets", "embedded")
    runpy.run_path(str(repo / "examples" / "make_dataset.py"), run_name="make_dataset")["main"](str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    rows = [json.loads(line) for line in (tmp_path / "val.jsonl").read_text().splitlines()]
    assert len(rows) == 15 and all(isinstance(r["text"], str) for r in rows)


def test_a_stream_whose_files_the_lanes_do_not_divide_is_said_once(tmp_path, caplog):
    """Each lane then reads the whole stream (`split_dataset_by_node` keeps every G-th row): the rank's reading grows
    with its lanes, which the user must hear of, with the fix."""
    caplog.set_level("WARNING", logger="graph_trainer")
    loader(write(tmp_path / "one", "jsonl", files=1), True)  # 1 file, 2 lanes
    said = [r.getMessage() for r in caplog.records if "do not divide" in r.getMessage()]
    assert len(said) == 1 and "a stream of 1 file(s)" in said[0] and "reads it 2 times" in said[0], said
    caplog.clear()
    loader(write(tmp_path / "two", "jsonl", files=2), True)  # 2 files, 2 lanes: one file each
    loader(write(tmp_path / "two", "jsonl", files=2), False)  # loaded: cut by rows, never re-read
    assert not [r for r in caplog.records if "do not divide" in r.getMessage()]
