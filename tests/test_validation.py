"""Validation: the evaluation step's own graph (forward and loss only), eager = traced bitwise, and the
held-out loss and perplexity in summary.json, TensorBoard and on the console."""

from __future__ import annotations

import json
import math
from itertools import islice
from pathlib import Path

import pytest
import torch

from graph_trainer import __main__ as cli
from graph_trainer.builder import build_data, build_job
from graph_trainer.distributed.launch import single_process
from graph_trainer.eager.eval_step import EagerEvalStep
from graph_trainer.errors import ConfigError
from graph_trainer.job_config.cli import load_config
from graph_trainer.runtime.device import set_determinism
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.eval_step import GraphEvalStep
from tests.tiny import TINY

VALIDATE = ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2"]


def _job(*extra: str):
    cfg, _ = load_config(["--config", "llama3_debug.toml", *TINY, *VALIDATE, *extra])
    mesh = single_process(cfg)
    data = build_data(cfg, mesh)
    set_determinism(cfg.training.seed, cfg.training.deterministic, mesh.device)
    return build_job(cfg, mesh, vocab_needed=data.tokenizer.vocab_size), data


def test_the_eval_graph_is_forward_and_loss_only_and_equals_eager_bitwise():
    # Dropout on: the evaluation runs in eval mode, so neither side draws a random number.
    job, data = _job("--model.dropout", "0.25")
    traced = job.build_eval_step()
    assert isinstance(traced, GraphEvalStep)
    eager = EagerEvalStep(job.model, loss_fn=job.loss_fn)
    for batch in islice(data.validation, 3):
        assert torch.equal(traced(batch), eager(batch))
    assert traced.trace_count == 1  # one graph for every batch of the same shape
    assert job.model.training  # the evaluation left the model in training mode
    gm, layout = traced.traced.gm, traced.traced.layout
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params, buffers = list(job.model.parameters()), list(job.model.buffers())
    assert len(placeholders) == len(params) + len(buffers) + 2  # + input, labels; no optimizer state, no scalars
    assert layout.num_opt_state == 0 and layout.num_scalars == 0
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert all(node_meta.is_forward(n) for n in ops)  # no backward, no optimizer phase
    assert not any(node_meta.is_random(n) for n in ops)
    (out,) = gm.graph.output_node().args[0]
    assert out.meta["val"].shape == () and not out.meta["val"].requires_grad
    assert traced.report().estimated_peak_bytes > 0


def test_validation_splits_and_paths_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(ConfigError, match='data.source = "synthetic" has no text to hold out'):
        _job("--data.source", "synthetic")
    with pytest.raises(ConfigError, match='validation.path is set but data.source = "embedded" reads no file'):
        _job("--validation.dataset_path", str(tmp_path))  # torchtitan's name for validation.path


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


@pytest.mark.integration
def test_eager_and_traced_runs_validate_to_the_same_bits_and_report_them_everywhere(tmp_path, capsys):
    """4 steps, an evaluation after steps 2 and 4, eager and traced; the traced run with TensorBoard on."""
    args = ["--config", "llama3_debug.toml", *TINY, *VALIDATE, "--training.steps", "4"]
    traced_dir, eager_dir = tmp_path / "traced", tmp_path / "eager"
    assert cli.main([*args, "--job.dump_folder", str(traced_dir), "--metrics.enable_tensorboard", "true"]) == 0
    console = capsys.readouterr().out
    assert cli.main([*args, "--job.dump_folder", str(eager_dir), "--compile.mode", "eager"]) == 0
    traced, eager = _summary(traced_dir)["validation"], _summary(eager_dir)["validation"]
    assert [v["step"] for v in traced] == [2, 4]
    for t, e in zip(traced, eager, strict=True):
        # summary.json keeps floats exact (shortest repr), so equal numbers here are equal bits.
        assert t["loss"] == e["loss"] and t["batch_losses"] == e["batch_losses"]
        assert t["perplexity"] == math.exp(t["loss"])
        assert t["estimated_peak_bytes"] == t["peak_active_bytes"]  # CPU: estimate and measurement to the byte
        assert t["trace_count"] == 1
        assert f"validation after step {t['step']}  loss {t['loss']:7.4f}" in console
    assert traced[1]["loss"] < traced[0]["loss"]  # training on the kept documents helps on the held-out ones

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(traced_dir / "tb")).Reload()
    logged = [s.value for s in events.Scalars("validation_metrics/loss")]
    assert logged == [v["loss"] for v in traced]  # float32 losses: TensorBoard's float32 holds them exactly
    assert "validation_metrics/perplexity" in events.Tags()["scalars"]
    assert "validation_memory/estimated_peak(GiB)" in events.Tags()["scalars"]


def test_resume_refuses_a_changed_validation_split_and_honours_the_rest(tmp_path):
    from graph_trainer.errors import UserError
    from graph_trainer.job_config.resume import compare_on_resume, stored_config
    from graph_trainer.job_config.schema import JobConfig

    def config(enable: bool, path: str = "", every: int = 20, freq: int = 10) -> JobConfig:
        cfg = JobConfig()
        cfg.data.source, cfg.data.path = "jsonl", "train.jsonl"
        v = cfg.validation
        v.enable, v.path, v.holdout_every, v.freq = enable, path, every, freq
        return cfg

    split = stored_config(config(True))
    with pytest.raises(
        UserError, match="with no document held out .checkpoint: every 20th document held out for validation"
    ):
        compare_on_resume(split, config(False), tmp_path)
    with pytest.raises(UserError, match="--validation.holdout_every 20"):
        compare_on_resume(split, config(True, every=10), tmp_path)
    with pytest.raises(
        UserError, match="with every 20th document held out for validation .checkpoint: no document held out"
    ):
        compare_on_resume(stored_config(config(False)), config(True), tmp_path)
    # The training stream is unchanged: a held-out file added or changed, the frequency changed.
    assert compare_on_resume(stored_config(config(False)), config(True, path="val.jsonl"), tmp_path)
    assert compare_on_resume(split, config(True, freq=5), tmp_path) == [
        "validation.freq: 10 in the checkpoint, 5 now (honoured)"
    ]


def test_a_datasets_run_reshards_at_the_same_global_batch_and_not_at_another(tmp_path):
    """Each sequence of the global batch reads its own rows (data/hf_datasets.py), so its positions carry over to
    any data-parallel degree at the same global batch; another global batch is refused in one line."""
    from graph_trainer.errors import UserError
    from graph_trainer.job_config.resume import compare_on_resume, stored_config
    from graph_trainer.job_config.schema import JobConfig

    def config(dp_shard: int, batch: int) -> JobConfig:
        cfg = JobConfig()
        cfg.data.source, cfg.data.path = "hf_datasets", "data/"
        cfg.parallelism.dp_shard, cfg.training.local_batch_size = dp_shard, batch
        return cfg

    lines = compare_on_resume(stored_config(config(2, 4)), config(4, 2), tmp_path, reshardable=True)
    assert any("resharded: the global batch of 8" in line for line in lines), lines
    with pytest.raises(UserError, match=r"the global batch .* would be 16 instead of 8"):
        compare_on_resume(stored_config(config(2, 4)), config(4, 4), tmp_path, reshardable=True)
