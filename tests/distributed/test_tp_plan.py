"""`parallelism.tp` planned on torch's fake process group (no process is launched, nothing is trained): the
collectives per layer and their bytes in one rank's plan, and the refusals (one line, exit 2) of the dry run.
Heads, kv heads, the FFN width and the sequence go through one check (`TensorParallel.allows`): the
kv heads case stands for them."""

from __future__ import annotations

import pytest

from graph_trainer.job_config.cli import load_config
from graph_trainer.passes.communication import communication_by_layer
from graph_trainer.plan.step_plan import plan_config
from tests.job_config.test_cli import _run
from tests.tiny import TINY_BATCH, tiny_model

BATCH, SEQ, DIM, LAYERS = 2, 32, 64, 2  # tests/tiny.py


def test_fake_process_group_plan_counts_tp_collectives_per_layer():
    """One rank of tp 2, AC none, fp32: per layer 4 all-gathers and 4 reduce-scatters of the whole sequence
    (B x S x dim fp32; forward and backward), tagged with the layer; the plan's bytes by kind add them up."""
    cfg, _ = load_config(["--config", "llama3_debug", *tiny_model(LAYERS), *TINY_BATCH, "--parallelism.tp", "2"])
    plan = plan_config(cfg)
    per_layer = communication_by_layer(plan.step_graph.traced.gm)
    whole = BATCH * SEQ * DIM * 4
    for layer in range(LAYERS):
        assert per_layer[(layer, "tp", "all_gather", "seq_gather")] == (4, 4 * whole)
        assert per_layer[(layer, "tp", "reduce_scatter", "seq_scatter")] == (4, 4 * whole)
    tp_gathers = sum(b for (_, kind, op, _), (_, b) in per_layer.items() if (kind, op) == ("tp", "all_gather"))
    assert plan.comm_bytes["tp all_gather"] == tp_gathers == (4 * LAYERS + 2) * whole  # + embedding, output


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["--parallelism.tp", "4", "--model.n_kv_heads", "2"], "model.n_kv_heads = 2 does not divide by"),
    ],
)
def test_heads_that_tp_does_not_divide_are_refused_in_one_line(tmp_path, overrides, expected):
    result = _run(["--config", "llama3_debug", "--dry-run", *overrides], tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr
