"""The public stage API (`graph_trainer.stages`): trace -> transform -> compile, the route the executor and the
planner share.

Claims tested:
- a trace run through the clean-up stage, then the stages after it, is the graph (code and estimate) the whole
  pipeline makes, and the graph the executor's step installs;
- the registry's passes run in stage order, and the clean-up passes read no option (what lets the planner clean a
  trace once for every AC mode);
- the `full` pass's attention choice is the one `choose_attention` makes on the graphs `compared_graphs` gives: the
  planner asks the pass, and both choose alike (deep models recompute attention, shallow ones save it);
- the compile stage returns the graph as it is without a compile backend.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from graph_trainer import stages
from graph_trainer.builder import build_job
from graph_trainer.distributed.mesh import Mesh, ParallelDims
from graph_trainer.job_config.cli import load_config
from graph_trainer.passes import CLEAN_UP, REGISTRY, STAGES
from graph_trainer.passes.activation_checkpoint import (
    ATTENTION_CHOICES,
    attention_choices,
    choose_attention,
    compared_graphs,
    pin_attention,
)
from graph_trainer.passes.pipeline import CLEAN_UP as PIPELINE_CLEAN_UP
from graph_trainer.plan.step_plan import meta_batch
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.graph_utils import copy_graph, graph_module, is_attention
from graph_trainer.tracer.memory_estimate import estimate_peak_memory

SMALL = ["--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2", "--training.seq_len", "64"]


def _job(layers: int, *extra: str):
    cfg, _ = load_config(["--config", "llama3_debug", *SMALL, "--model.n_layers", str(layers), *extra])
    return build_job(cfg, Mesh(ParallelDims(), 0, torch.device("cpu")), materialize=False)


def _copy(traced):
    return dataclasses.replace(traced, gm=graph_module(traced.gm, copy_graph(traced.gm.graph)))


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_the_clean_up_stage_then_the_rest_is_the_whole_pipeline_and_the_executors_graph(mode):
    job = _job(2, "--activation_checkpoint.mode", mode)
    batch = meta_batch(job.cfg)
    traced = stages.trace(job, batch)
    whole = stages.transform(job, _copy(traced))
    clean = stages.transform(job, _copy(traced), until=CLEAN_UP)
    assert clean.memory_estimate is None  # a part of the pipeline: the graph alone
    rest = stages.transform(job, clean.traced, after=CLEAN_UP)
    assert rest.traced.gm.code == whole.traced.gm.code
    assert rest.memory_estimate == whole.memory_estimate
    executor = job.graph_step(until=stages.TRANSFORM)
    executor.prepare(batch)
    assert executor.traced.gm.code == whole.traced.gm.code
    assert executor.memory_estimate == whole.memory_estimate
    assert stages.compile(job, whole) is whole  # compile.backend "none": the graph as it is


def test_the_registry_runs_in_stage_order_and_the_clean_up_passes_read_no_option():
    assert CLEAN_UP is PIPELINE_CLEAN_UP and STAGES[0] == CLEAN_UP
    order = [STAGES.index(p.stage) for p in REGISTRY]
    assert order == sorted(order), [(p.name, p.stage) for p in REGISTRY]
    clean_up = [p for p in REGISTRY if p.stage == CLEAN_UP]
    assert clean_up and all(not p.reads for p in clean_up), [(p.name, p.reads) for p in clean_up]


def _attention_saved(gm: torch.fx.GraphModule) -> bool:
    tags = {
        n.meta.get(node_meta.RECOMPUTE)
        for n in gm.graph.nodes
        if is_attention(n.target) and node_meta.is_forward(n) and not node_meta.is_rematerialized(n)
    }
    assert len(tags) == 1, tags  # every layer's attention alike
    return tags.pop().name == "MUST_SAVE"


@pytest.mark.parametrize("layers", [2, 12])
def test_the_full_passes_attention_choice_is_the_one_its_compared_graphs_give(layers):
    """What the planner asks of the pass (`compared_graphs`, `choose_attention`) is what the pass does: at 2
    blocks it saves attention, at 12 it recomputes it (measured: the two choices' peaks cross between)."""
    job = _job(layers, "--activation_checkpoint.mode", "full")
    ac = job.cfg.activation_checkpoint
    assert attention_choices(ac) == ATTENTION_CHOICES
    clean = stages.transform(job, stages.trace(job, meta_batch(job.cfg)), until=CLEAN_UP).traced
    categories = clean.layout.categories
    graphs = compared_graphs(clean.gm, ac)
    assert set(graphs) == set(ATTENTION_CHOICES)
    assert not any(node_meta.RECOMPUTE in n.meta for n in clean.gm.graph.nodes)  # its tags are cleared
    peaks = {
        c: estimate_peak_memory(graph_module(clean.gm, g), input_categories=categories).peak_bytes
        for c, g in graphs.items()
    }
    choice = choose_attention(peaks)
    assert choice == ("save" if layers == 2 else "recompute"), peaks
    chosen = stages.transform(job, _copy(clean), after=CLEAN_UP).traced.gm
    assert _attention_saved(chosen) == (choice == "save")
    # Each choice pinned (how the planner plans it) is the graph compared for it: without FSDP, no pass follows.
    for option in ATTENTION_CHOICES:
        pinned = job.with_config(dataclasses.replace(job.cfg, activation_checkpoint=pin_attention(ac, option)))
        result = stages.transform(pinned, _copy(clean), after=CLEAN_UP)
        assert result.memory_estimate.peak_bytes == peaks[option]
        assert _attention_saved(result.traced.gm) == (option == "save")


def test_choose_attention_saves_on_a_tie_and_takes_the_lower_peak():
    assert choose_attention({"save": 5, "recompute": 5}) == "save"
    assert choose_attention({"save": 6, "recompute": 5}) == "recompute"
    assert choose_attention({"save": 4, "recompute": 5}) == "save"


def test_the_documented_stage_example_runs_as_written(capsys):
    """docs/tracer_api.md's example of the stages runs verbatim and prints the planned peak."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "tracer_api.md").read_text()
    section = page[page.index("## A job's step, stage by stage") :]
    code = section[
        section.index("```python\n") + len("```python\n") : section.index("```\n", section.index("```python"))
    ]
    exec(compile(code, "docs/tracer_api.md", "exec"), {})
    # The last line: a trainer run earlier in this process may have sent the passes' log to stdout too.
    assert re.fullmatch(r"planned step peak: \d+\.\d MiB", capsys.readouterr().out.splitlines()[-1])


def test_a_stage_that_does_not_exist_is_refused_by_name():
    from graph_trainer.passes import build_pipeline

    job = _job(2)
    with pytest.raises(ValueError, match="no pipeline stage 'cleanup'; the stages are clean-up, decide, apply"):
        build_pipeline(job.cfg, dump_dir=None).part(until="cleanup")
    with pytest.raises(ValueError, match="until must be one of 'trace', 'transform', 'compile'; got 'compiled'"):
        stages.step_transform(job, until="compiled")
