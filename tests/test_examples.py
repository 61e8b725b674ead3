"""docs/tracer_api.md's "Bring your own model" example: shown verbatim, runs, and is bitwise equal to eager."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graph_trainer.eager.step import EagerStep
from graph_trainer.optimizer import GraphAdamW
from graph_trainer.passes import memory_policy_transform
from graph_trainer.tracer import GraphStep, trace_step
from tests.extras import child_pythonpath

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "bring_your_own_model.py"


def _example():
    spec = importlib.util.spec_from_file_location("bring_your_own_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tracer_api_page_shows_the_example_verbatim():
    page = (REPO / "docs" / "tracer_api.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```\n" in page


@pytest.mark.integration  # the example in a subprocess (the docs' command, verbatim)
def test_example_runs_as_a_script_and_traces_once():
    env = {
        **os.environ,
        "PYTHONPATH": child_pythonpath(REPO),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, env=env, cwd=REPO / "examples"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:5]] == [f"step {i}" for i in range(1, 6)]
    assert lines[-2].startswith("planned peak ") and lines[-1] == "traced 1 time(s)"


def test_example_step_is_bitwise_equal_to_eager_and_leaves_the_frozen_embedding_alone():
    ex = _example()
    torch.use_deterministic_algorithms(True)
    try:
        model_e, adamw_e = ex.build()
        model_t, adamw_t = ex.build()
        frozen = model_t.embed.weight.clone()
        eager = EagerStep(model_e, loss_fn=ex.loss_fn, max_norm=1.0)
        graph = GraphStep(
            model_t,
            loss_fn=ex.loss_fn,
            max_norm=1.0,
            optimizer=GraphAdamW(adamw_t),
            layers="blocks",
            transform=memory_policy_transform("full"),
        )
        for batch in ex.batches(3):
            loss_e, norm_e = eager(batch)
            adamw_e.step()
            loss_t, norm_t = graph(batch)
            assert torch.equal(loss_e, loss_t) and torch.equal(norm_e, norm_t)
    finally:
        torch.use_deterministic_algorithms(False)
    for (name, pe), pt in zip(model_e.named_parameters(), model_t.parameters(), strict=True):
        assert torch.equal(pe, pt), name
    assert torch.equal(model_t.embed.weight, frozen) and model_t.embed.weight.grad is None
    # `full` on the named blocks really recomputes: the graph saves less for the backward than with "none".
    no_ac = memory_policy_transform("none")(
        trace_step(model_t, next(ex.batches(1)), loss_fn=ex.loss_fn, max_norm=1.0, optimizer=GraphAdamW(adamw_t))
    )
    assert graph.memory_estimate.saved_bytes < 0.5 * no_ac.memory_estimate.saved_bytes
