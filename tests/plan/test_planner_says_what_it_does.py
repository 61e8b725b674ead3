"""Nothing the planner does is silent: a whole-depth fallback is one line naming where the blocks differ (dry run,
preflight, search), `--plan.require_depth_free` makes it an error, the search counts what it skips or fails to
plan, says how far it is, and its --help reads like the trainer's."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from graph_trainer.distributed.mesh import Mesh, ParallelDims
from graph_trainer.job_config.cli import load_config
from graph_trainer.layouts.cluster import DEVICES
from graph_trainer.layouts.progress import Progress
from graph_trainer.plan import dry_run as dry_run_module
from graph_trainer.plan.__main__ import main
from graph_trainer.plan.dry_run import dry_run
from graph_trainer.plan.preflight import preflight
from models.llama3.model import TransformerBlock

# 6 blocks: deep enough for the depth-free plan (traced at 3 and 4), the smallest model that takes it (DECISIONS.md).
SIX = ["--config", "llama3_debug", "--model.n_layers", "6", "--training.seq_len", "32", "--training.local_batch_size",
       "2"]  # fmt: skip
FALLBACK = "planning the whole depth (6 blocks"


@pytest.fixture
def block_2_differs(monkeypatch):
    """A model whose block 2 does one op more than the others (a doubling of its output): at 4 blocks it is a middle
    block, so the short traces cannot prove the blocks identical."""
    forward = TransformerBlock.forward

    def doubled(self, *args):
        out = forward(self, *args)
        return out * 2.0 if self.layer_id == 2 else out

    monkeypatch.setattr(TransformerBlock, "forward", doubled)


def _one_line(text: str) -> str:
    (line,) = [x for x in text.splitlines() if x.startswith(FALLBACK)]
    return line


def test_the_dry_run_says_the_fallback_in_one_line_naming_block_node_and_field(block_2_differs, monkeypatch):
    cfg, _ = load_config([*SIX, "--activation_checkpoint.mode", "none"])
    monkeypatch.setattr(dry_run_module, "AC_MODES", ("none",))  # one mode is enough to see the line (and cheaper)
    lines: list[str] = []
    dry_run(cfg, print_fn=lines.append)
    line = _one_line("\n".join(lines))
    assert "block 2 of the 4-block graph as traced differs from block 1 at its node" in line
    assert "(aten.mul.Tensor), field op: aten.mul.Tensor vs" in line and "--plan.require_depth_free" in line
    assert [x for x in lines if "blocks traced:" in x] == [
        "blocks traced: all 6, once for all modes"
    ]  # it did trace the whole depth


def test_the_preflight_says_the_fallback_as_a_warning_on_rank_0_only(monkeypatch):
    """Where the trainer's console is (`configure_console`: rank 0 prints warnings, the others would repeat it)."""
    from graph_trainer.errors import UserError
    from graph_trainer.plan import preflight as preflight_module

    def plan_modes(cfg, mesh, modes, *, log_passes, on_fallback):  # the line the depth-free plan would give
        on_fallback(f"{FALLBACK}, slower ...): the short traces do not prove the blocks identical: ...")
        return dict.fromkeys(modes, UserError("stop here"))

    monkeypatch.setattr(preflight_module, "plan_modes", plan_modes)
    cfg, _ = load_config(SIX)
    said: list[tuple[int, str]] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: said.append((record.levelno, record.getMessage()))
    logger = logging.getLogger("graph_trainer")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        for rank in (0, 1):
            with pytest.raises(UserError, match="stop here"):
                preflight(cfg, Mesh(ParallelDims(), rank, torch.device("cpu")))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [level for level, line in said if line.startswith(FALLBACK)] == [logging.WARNING, logging.DEBUG]


def test_require_depth_free_makes_the_fallback_an_error_exit_2(block_2_differs, capsys, tmp_path):
    """The search, which exited 0 after a silent fallback (the dry run and the preflight share `fall_back`)."""
    code = main([*SIX, "--plan.require_depth_free", "true", "--cluster.device", "cpu", "--cluster.gpus", "1",
                 "--cluster.gpus_per_node", "1", "--batch.global_seqs", "2", "--search.ac_modes", "none",
                 "--out", str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "plan.require_depth_free: the 6 blocks of llama3/debugmodel cannot be planned depth-free" in err
    assert "block 2 of the 4-block graph" in err and "drop --plan.require_depth_free" in err


@pytest.mark.integration
def test_the_search_says_its_fallback_once_and_counts_depth_free_and_whole_depth_plans(
    block_2_differs, capsys, tmp_path
):
    code = main([*SIX, "--cluster.device", "cpu", "--cluster.gpus", "1", "--cluster.gpus_per_node", "1",
                 "--batch.global_seqs", "1", "--search.ac_modes", "none", "--search.exact", "1",
                 "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "block 2 of the 4-block graph as traced differs from block 1" in _one_line(out)
    assert "0 depth-free plans, 1 whole-depth" in out
    plans = json.loads((tmp_path / "plan.json").read_text())["plans"]
    assert (plans["depth_free"], plans["whole_depth"]) == (0, 1)
    assert plans["whole_depth_why"][0]["why"] == _one_line(out)


def test_skipped_layouts_and_refused_candidates_are_one_counted_line_each_listed_in_plan_json(
    capsys, tmp_path, monkeypatch
):
    from graph_trainer.errors import ConfigError
    from graph_trainer.layouts import search

    def refuse_accumulation(trial):  # so that some candidates are refused by the trainer
        if trial.training.global_batch_size != -1:
            raise ConfigError("training.global_batch_size is refused here: drop it")

    monkeypatch.setattr(search, "validate", refuse_accumulation)
    # Everything is pruned (the state alone is over the memory): the lines and plan.json come without any plan.
    # 2 kv heads: tp 4 is the one layout of 4 GPUs the model refuses.
    code = main(["--config", "llama3_debug", "--model.n_kv_heads", "2", "--cluster.gpus", "4",
                 "--cluster.gpus_per_node", "4", "--batch.global_seqs", "8", "--cluster.memory_gib", "0.0001",
                 "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 2
    data = json.loads((tmp_path / "plan.json").read_text())
    (layouts,) = [x for x in out.splitlines() if x.startswith("skipped") and "layouts the model" in x]
    assert layouts.startswith(f"skipped {len(data['skipped_layouts'])} layouts") and len(data["skipped_layouts"]) == 1
    assert data["skipped_layouts"][0].startswith("tp 4: model.n_kv_heads = 2 does not divide by parallelism.tp = 4")
    (cands,) = [x for x in out.splitlines() if x.startswith("skipped") and "candidates the trainer" in x]
    assert cands.startswith(f"skipped {sum(data['refused_candidates'].values())} candidates the trainer refuses")
    assert all("global_batch_size is refused" in what for what in data["refused_candidates"])
    assert str(tmp_path / "plan.json") in layouts and str(tmp_path / "plan.json") in cands


@pytest.mark.integration
def test_candidates_whose_plan_fails_are_counted_and_listed(capsys, tmp_path):
    """An infeasible `memory_budget` fails every budget candidate's plan; the none candidates still plan and rank."""
    # 2 blocks: what fails is the budget, at any depth (the whole trace's own pass refuses it: the cheapest plan).
    code = main(["--config", "llama3_debug", "--model.n_layers", "2", "--training.seq_len", "32", "--cluster.device",
                 "cpu", "--cluster.gpus", "1", "--cluster.gpus_per_node", "1", "--batch.global_seqs", "2",
                 "--search.ac_modes", "none", "budget", "--search.exact", "1", "--activation_checkpoint.memory_budget",
                 "0.01", "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    failed = json.loads((tmp_path / "plan.json").read_text())["unplannable"]
    (line,) = [x for x in out.splitlines() if "could not be planned" in x]
    assert line.startswith(f"{len(failed)} candidates could not be planned") and len(failed) == 2  # 1 x 2 and 2 x 1
    assert all(f["stage"] == "screen" and "memory_budget 0.01 is infeasible" in f["error"] for f in failed)
    assert all(", AC budget 0.01, " in f["candidate"] for f in failed)  # the budget it was planned to


def test_progress_says_stage_item_of_total_and_elapsed_at_most_every_interval():
    now = [100.0]
    lines: list[str] = []
    progress = Progress(lines.append, every_s=10.0, clock=lambda: now[0])
    for t, i in ((101.0, 1), (105.0, 2), (111.0, 3), (112.0, 4), (125.0, 5)):
        now[0] = t
        progress("screen: shape", i, 5, f"shape {i}")
    assert lines == ["screen: shape 3/5: shape 3 (11 s elapsed)", "screen: shape 5/5: shape 5 (25 s elapsed)"]


def test_help_has_a_description_defaults_config_and_the_device_names(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # as one line: argparse wraps to the terminal's width
    assert info.value.code == 0
    assert "Find the fastest layout of a model that fits a cluster" in out
    assert "--config NAME_OR_PATH" in out and "llama3_70b" in out
    assert all(name in out for name in DEVICES) and "cpu (this machine)" in out
    assert "(default: 8)" in out and "(default: none selective full)" in out and "(default: outputs/plan)" in out
    assert "--plan.require_depth_free" in out


def test_the_search_says_the_first_fallback_and_counts_the_rest():
    """One line however many shapes fall back (each is listed in plan.json), and the counts add up."""
    from graph_trainer.layouts import search

    cfg, _ = load_config(SIX)
    said: list[str] = []
    plans = search.Plans(cfg, torch.device("cpu"), say=said.append)
    plans._count("dp_shard 2, ...", [f"{FALLBACK}, ...): first"])
    plans._count("tp 2, ...", [f"{FALLBACK}, ...): second"])
    plans._count("one process, ...", [])
    assert said == [f"{FALLBACK}, ...): first"]
    assert (plans.depth_free, len(plans.full), plans.calls) == (1, 2, 3)
    assert [f["shape"] for f in plans.full] == ["dp_shard 2, ...", "tp 2, ..."]


def test_the_difference_names_the_first_node_that_differs_and_its_field():
    from graph_trainer.plan.block_plan import _first_difference, _Signature

    node = _Signature("aten.mm.default", (((4, 4), torch.float32),), "forward", "layers.#.attention.wq", False, False)
    wider = node._replace(outputs=(((4, 8), torch.float32),))
    assert _first_difference([node, wider], [node, node]) == (
        "at its node 1 (aten.mm.default), field output shapes and dtypes: "
        "(((4, 8), torch.float32),) vs (((4, 4), torch.float32),)"
    )
    assert _first_difference([node], [node, wider]) == (
        "at its node 1 (aten.mm.default), field op: one has 1 nodes, the other 2"
    )


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ([], "memory_budget 1MiB (the device's memory"),
        # The default value given on purpose is the user's (it was read off the value, and replaced by the device's).
        (["--activation_checkpoint.memory_budget", "0.5"], "memory_budget 0.5 (yours)"),
    ],
)
def test_the_budget_searched_is_the_users_when_given_even_at_its_default(capsys, tmp_path, given, says):
    """The planner fills in the device's memory as the AC budget only where the user gave none: given is read off the
    command line and the config file, not off the value. (A memory so small that every candidate is pruned: the
    line comes before any plan.)"""
    argv = ["--config", "llama3_debug", "--cluster.device", "cpu", "--cluster.gpus", "2", "--cluster.gpus_per_node",
            "2", "--cluster.memory_gib", "0.001", "--search.ac_modes", "budget", "--out", str(tmp_path)]  # fmt: skip
    main([*argv, *given])
    assert f"AC budget planned to --activation_checkpoint.{says}" in capsys.readouterr().out
