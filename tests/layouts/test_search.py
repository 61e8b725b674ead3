"""`python -m graph_trainer.plan`: the search space, 'nothing fits', and (integration) a plan that runs as planned."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from graph_trainer.job_config.cli import load_config
from graph_trainer.layouts import search
from graph_trainer.layouts.cluster import DEVICES, Cluster
from graph_trainer.plan.__main__ import main

REPO = Path(__file__).resolve().parents[2]
DEBUG = ["--config", "llama3_debug", "--model.n_layers", "2", "--training.seq_len", "64"]


def test_factorizations_cover_every_product_once():
    got = list(search.factorizations(8, ("dp_replicate", "dp_shard", "tp")))
    assert len(got) == 10  # ordered triples with product 8: the divisor function's 3-fold convolution
    assert all(d["dp_replicate"] * d["dp_shard"] * d["tp"] == 8 for d in got)
    assert len({tuple(d.items()) for d in got}) == len(got)


def test_a_layout_that_breaks_divisibility_is_never_proposed():
    cfg, _ = load_config(DEBUG)  # 16 heads, 16 KV heads
    assert "does not divide" in search.model_allows(cfg, {"tp": 3}, 8)
    assert "spans nodes" in search.model_allows(cfg, {"tp": 16}, 8)
    assert search.model_allows(cfg, {"tp": 4}, 8) is None
    # The trainer's own check (distributed/tp.py's `indivisible`), so the sequence and the split widths count too:
    # a search at seq_len 66 once proposed tp 4, and the trainer stopped it.
    odd, _ = load_config([*DEBUG[:-1], "66"])
    assert search.model_allows(odd, {"tp": 4}, 8) == "training.seq_len = 66 does not divide by parallelism.tp = 4"
    assert search.model_allows(odd, {"tp": 2}, 8) is None
    assert "tp 4: training.seq_len = 66 does not divide" in "\n".join(
        search.layouts(odd, Cluster(DEVICES["h100-80gb"], 4, 4))[1]
    )
    cluster = Cluster(DEVICES["h100-80gb"], 8, 8)
    layouts, skipped = search.layouts(cfg, cluster)
    for cand in search.candidates(cfg, layouts, 12, ("none",), (0,), (False,)).cands:  # 12 sequences: dp must divide
        d = dict(cand.degrees)
        assert 12 % (d.get("dp_replicate", 1) * d.get("dp_shard", 1)) == 0
        assert search.model_allows(cfg, d, 8) is None
    # HSDP is a layout the trainer runs (tests/distributed/test_hsdp.py): searched, never skipped.
    assert {"pp": 1, "dp_replicate": 2, "dp_shard": 4, "tp": 1} in layouts
    assert not any(line.startswith("dp_replicate 2 x dp_shard 4") for line in skipped)


def test_the_search_reads_each_parallelisms_facts_off_its_class(monkeypatch):
    """The search names no parallelism (tests/test_architecture.py): what a degree means comes from the class. So
    a fact changed on a class changes the search, with nothing in layouts/ touched: FSDP declared node-bound makes
    dp_shard 16 on nodes of 8 a skipped layout, in its own words; replication given a searched option doubles the
    candidates of a replicated layout and puts the option in their commands."""
    from graph_trainer.distributed.fsdp import FSDP
    from graph_trainer.distributed.replicate import Replicate

    cfg, _ = load_config(DEBUG)
    assert search.model_allows(cfg, {"dp_replicate": 1, "dp_shard": 16, "tp": 1}, 8) is None
    monkeypatch.setattr(FSDP, "within_node", True)
    assert search.model_allows(cfg, {"dp_replicate": 1, "dp_shard": 16, "tp": 1}, 8) == "dp_shard 16 spans nodes"
    monkeypatch.undo()

    replicated = [{"dp_replicate": 2, "dp_shard": 1, "tp": 1}]
    before = search.candidates(cfg, replicated, 2, ("none",), (0,), (False,)).cands
    offer = classmethod(lambda cls, degrees, acc, offered: {"deterministic_comms": (False, True)})
    monkeypatch.setattr(Replicate, "search_options", offer, raising=False)
    monkeypatch.setattr(search, "_DEFAULTS", dataclasses.replace(search._DEFAULTS))
    object.__setattr__(search._DEFAULTS, "deterministic_comms", False)
    monkeypatch.setattr(search, "trainer_refuses", lambda cfg, cand: None)
    after = search.candidates(cfg, replicated, 2, ("none",), (0,), (False,)).cands
    assert len(after) == 2 * len(before)
    assert sum("--parallelism.deterministic_comms true" in c.overrides() for c in after) == len(before)


def test_the_candidate_generator_takes_the_degrees_the_schema_offers(monkeypatch):
    """The seam for tensor parallelism: once the schema has `parallelism.tp`, tp joins the factorizations."""
    assert {"dp_replicate", "dp_shard"} <= set(search.offered_degrees())
    monkeypatch.setattr(search, "offered_degrees", lambda: ("dp_replicate", "dp_shard", "tp"))
    cfg, _ = load_config(DEBUG)
    layouts, _ = search.layouts(cfg, Cluster(DEVICES["h100-80gb"], 4, 4))
    assert {"dp_replicate": 1, "dp_shard": 1, "tp": 4} in layouts


def test_nothing_fits_exits_2_with_the_gpu_count_that_would(capsys, tmp_path):
    code = main([*DEBUG, "--cluster.device", "h100-80gb", "--cluster.gpus", "4", "--cluster.memory_gib", "0.0001",
                 "--out", str(tmp_path)])  # fmt: skip
    assert code == 2
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("nothing fits"))
    assert "--cluster.gpus" in line and "--cluster.memory_gib" in line
    # Sizes below a GiB are said as they are, and the memory suggested would hold the state: "0 GiB each" and
    # "--cluster.memory_gib 0" were printed here.
    assert "(0.0001 GiB each)" in line, line
    need = float(line.split("alone need ")[1].split(" GiB")[0])
    suggested = float(line.split("--cluster.memory_gib ")[1].split()[0])
    assert 0 < need < suggested, line


def test_an_unknown_device_is_one_line_exit_2(capsys):
    assert main([*DEBUG, "--cluster.device", "h100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "h100-80gb" in err


@pytest.mark.integration
@pytest.mark.parametrize("ranks", [4])  # one small row in CI (docs/tests.md); 2 ranks is the same path, smaller
def test_the_best_cpu_plan_runs_through_its_command_at_the_planned_peak(tmp_path, ranks):
    out = tmp_path / "plan"
    proc = subprocess.run(
        [sys.executable, "-m", "graph_trainer.plan", *DEBUG, "--cluster.device", "cpu", "--cluster.gpus", str(ranks),
         "--cluster.gpus_per_node", str(ranks), "--search.exact", "2", "--out", str(out),
         "--batch.global_seqs", str(2 * ranks)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((out / "plan.json").read_text())
    best = plan["ranked"][0]
    argv = shlex.split(plan["command"])
    argv[0] = sys.executable
    run = tmp_path / "run"
    argv += ["--training.steps", "2", "--job.dump_folder", str(run), "--metrics.enable_tensorboard", "false"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = json.loads((run / "summary.json").read_text())["steps"]
    planned = best["peak_bytes"]
    for step in steps:
        # Rank 0's measured step peak equals the plan (made without launching anything) to the byte, or exceeds
        # it by no more than what gloo's worker thread freed late that step (tests/multiprocess.assert_peaks_match).
        late = step.get("late_free_bytes", 0)
        assert step["peak_active_bytes"] == planned or 0 < step["peak_active_bytes"] - planned <= late, step
        assert step["estimated_peak_bytes"] == planned, step  # the trainer's own estimate is the plan's


@pytest.mark.parametrize(
    ("sync", "tp", "replicas"), [("micro_batch", 1, 1), ("step", 1, 1), ("micro_batch", 2, 1), ("micro_batch", 1, 2)]
)
def test_the_accumulated_plan_equals_the_whole_accumulating_plan(sync, tp, replicas):
    """The planner plans one micro-step and adds what lives across micro-steps (plan/accumulate.py): to the byte
    what planning the accumulating step whole gives, whatever the number of micro-steps (HSDP too: replicas 2)."""
    import torch

    from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
    from graph_trainer.plan.accumulate import accumulated
    from graph_trainer.plan.block_plan import plan_modes

    cfg, _ = load_config(DEBUG)
    micro = search.Candidate((("dp_replicate", replicas), ("dp_shard", 2), ("tp", tp)), "none", 2, 0, False)
    plans = search.Plans(cfg, torch.device("cpu"))
    for steps in (3,):  # one count: the accumulated buffers scale with it, and 3 exercises the "other" batches
        cand = dataclasses.replace(micro, accumulation=steps, options=(("fsdp_grad_sync", sync),))
        acc_cfg = cand.apply(cfg)
        with planning_mesh(ParallelDims.from_config(acc_cfg.parallelism), torch.device("cpu")) as mesh:
            whole = plan_modes(acc_cfg, mesh, ["none", "full"])
        for mode in ("none", "full"):
            options = {"fsdp_grad_sync": sync}
            got = accumulated(plans.get(cand, ["none", "full"])[mode], steps, options, dict(cand.degrees))
            assert got.flops == whole[mode].flops
            if sync == "micro_batch":  # exact: the micro-step's graph is the planned one
                assert (got.peak_bytes, got.peak_location) == (whole[mode].peak_bytes, whole[mode].peak_location)
            else:  # upper bound: the deferred sync makes no sharded gradients during the micro-steps
                assert got.approximate
                assert 0 <= got.peak_bytes - whole[mode].peak_bytes <= got.peak_by_category["parameter"]
    assert plans.calls == 1  # one micro-step plan served both modes


def test_the_search_crosses_local_batch_with_accumulation_and_both_grad_syncs():
    cfg, _ = load_config(DEBUG)
    space = search.candidates(cfg, [{"dp_replicate": 1, "dp_shard": 2, "tp": 1}], 8, ("none",), (0,), (False,))
    got = {(c.local_batch, c.accumulation, dict(c.options).get("fsdp_grad_sync", "micro_batch")) for c in space.cands}
    assert got == {(4, 1, "micro_batch"), (2, 2, "micro_batch"), (2, 2, "step"), (1, 4, "micro_batch"),
                   (1, 4, "step")}  # fmt: skip
    assert all(c.global_batch == 8 for c in space.cands)


def test_every_proposed_layout_passes_the_trainers_gate(monkeypatch):
    """One gate (`trainer_refuses`, the trainer's own checks): tp with accumulation is proposed since the trainer
    takes it, and whatever the trainer refuses is skipped and counted, never proposed."""
    from graph_trainer.errors import ConfigError

    cfg, _ = load_config(DEBUG)
    tp = [{"dp_replicate": 1, "dp_shard": 1, "tp": 2}]
    space = search.candidates(cfg, tp, 4, ("none",), (0,), (False,))
    assert {c.accumulation for c in space.cands} == {1, 2, 4} and not space.refused
    for cand in space.cands:
        assert search.trainer_refuses(cfg, cand) is None

    def refuse_accumulation(trial):  # as the trainer did before tp composed with accumulation
        if trial.training.global_batch_size != -1:
            raise ConfigError("training.global_batch_size with parallelism.tp > 1 is not supported yet: drop it")

    monkeypatch.setattr(search, "validate", refuse_accumulation)
    space = search.candidates(cfg, tp, 4, ("none",), (0,), (False,))
    assert {c.accumulation for c in space.cands} == {1}
    assert list(space.refused.values()) == [2]  # local batch 1 x 4 and 2 x 2


def test_expert_parallel_degrees_follow_the_expert_count():
    """ep, carved out of dp_shard, is offered at the divisors of dp_shard that divide the routed experts."""
    from graph_trainer.distributed import layout

    cfg, _ = load_config(["--config", "deepseek_v3_debug"])
    experts = getattr(search.resolve_model_args(cfg), "n_routed_experts", 0)
    choices = layout.carved_choices(search.resolve_model_args(cfg), {"dp_replicate": 1, "dp_shard": 8, "tp": 1})
    degrees = [c.get("ep", 1) for c in choices]
    assert degrees[0] == 1 and all(8 % e == 0 and experts % e == 0 for e in degrees[1:])
    assert (len(degrees) > 1) == bool(experts)
    llama, _ = load_config(DEBUG)
    assert layout.carved_choices(search.resolve_model_args(llama), {"dp_shard": 8}) == [{}]


def test_the_search_skips_with_the_words_each_parallelism_refuses_with(tmp_path):
    """The one check per parallelism (`Parallelism.allows`): the search's skip and the trainer's refusal are the
    same sentence, for tp (kv heads) and for ep (the experts dp_shard must divide)."""
    ds, _ = load_config(["--config", "deepseek_v3_debug", "--model.n_routed_experts", "6"])
    shard4 = (("dp_replicate", 1), ("dp_shard", 4), ("tp", 1))
    why = search.trainer_refuses(ds, search.Candidate((*shard4, ("ep", 2)), "none", 1, 0, False))
    assert why == "parallelism.dp_shard = 4 does not divide the 6 routed experts"
    assert search.trainer_refuses(ds, search.Candidate(shard4, "none", 1, 0, False)) is None
    llama, _ = load_config([*DEBUG, "--model.n_kv_heads", "2", "--job.dump_folder", str(tmp_path)])
    why = search.model_allows(llama, {"tp": 4}, 8)
    assert why == "model.n_kv_heads = 2 does not divide by parallelism.tp = 4"
    from tests.job_config.test_cli import _run

    refused = _run([*DEBUG, "--model.n_kv_heads", "2", "--parallelism.tp", "4", "--dry-run"], tmp_path)
    assert refused.returncode == 2 and why in refused.stderr


def test_nothing_fits_names_the_activations_when_the_state_fits():
    """The line blames what does not fit: with the state under the memory but the smallest local batch's
    activations over it, it names the activations, and more GPUs cannot help when they alone exceed it."""
    from graph_trainer.layouts.cluster import Cluster, Device
    from graph_trainer.layouts.report import nothing_fits

    cfg, _ = load_config(DEBUG)
    cand = search.Candidate((("dp_replicate", 1), ("dp_shard", 4), ("tp", 1)), "full", 1, 0, False)
    state = search.state_bytes(cfg, cand)
    device = Device("tiny", (state + 10 * 2**20) / 2**30, 1.0, 1.0, 1.0, "test")
    cluster = Cluster(device, 4, 4)
    over = search.Screened(cand, state + 2 * cluster.memory_bytes, None)  # activations alone above the memory
    line = nothing_fits(cfg, cluster, 4, [cand], [over], [])
    assert "activations at the smallest local batch" in line and "nor does pipeline parallelism" in line
    some = search.Screened(cand, cluster.memory_bytes + 2**20, None)  # state + activations just above it
    line = nothing_fits(cfg, cluster, 4, [cand], [some], [])
    assert "of activations" in line and "--cluster.gpus 8" in line and "pipeline" not in line


# Deep enough for the depth-free plan (whose `budget` is an upper bound), one CPU "GPU", a global batch of 2.
BUDGET_ONLY = ["--config", "llama3_debug", "--model.n_layers", "5", "--training.seq_len", "64", "--cluster.device",
               "cpu", "--cluster.gpus", "1", "--cluster.gpus_per_node", "1", "--batch.global_seqs", "2",
               "--search.ac_modes", "budget", "--search.exact", "1"]  # fmt: skip


@pytest.mark.integration
def test_a_budget_search_ranks_budgets_solved_at_their_own_batch(capsys, tmp_path):
    """Every ranked row is an exact plan. A budget read off a grid of batches is an upper bound; the exact stage
    solves each row's budget at its own batch, so a search of budget alone, at the user's own budget (said, and
    kept), ranks exact budget rows. (Before the per-batch solve, both rows here were listed apart as upper bounds,
    and nothing was ranked.)"""
    # all of the no-AC activation memory: feasible
    code = main([*BUDGET_ONLY, "--activation_checkpoint.memory_budget", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "not ranked, an upper bound only" not in out
    assert out.count(" (yours): each layout's fewest recompute FLOPs under it") == 1
    ranked = json.loads((tmp_path / "plan.json").read_text())["ranked"]
    assert ranked and all(r["ac_mode"] == "budget" and not r["peak_approximate"] for r in ranked)


@pytest.mark.integration
def test_a_search_whose_candidates_are_all_refused_says_why_in_one_line(capsys, tmp_path):
    """Not a memory verdict: when no candidate can be planned (an infeasible budget), the search says which and why.
    2 blocks: traced whole, so the exact policy itself refuses (the depth-free plan of a deeper model takes the
    budget as an upper bound and leaves the refusal to the trace)."""
    argv = [*BUDGET_ONLY, "--model.n_layers", "2", "--activation_checkpoint.memory_budget", "0.01"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no candidate could be planned" in err and "memory_budget 0.01 is infeasible" in err


def test_the_gate_runs_at_every_ac_mode_and_update_placement():
    """The search's gate runs per AC mode and update placement, so every candidate it proposes is one the trainer
    takes, and the rest are counted refused in the trainer's words. (It ran at the first mode only, and the 8B on 8
    search with budget among its modes ranked dp_shard 8 under AC budget with the prefetch on, a plan the trainer
    refused then. The budget now keeps room for the prefetch's gathers and for the eager update's state, and the
    trainer takes both.)"""
    from graph_trainer.layouts.cluster import build_cluster
    from graph_trainer.layouts.cost_model import PREFETCH

    cluster = build_cluster("h100-80gb", 8, 8, {})
    for size in ([], ["--activation_checkpoint.memory_budget", "70GiB"]):
        cfg, _ = load_config(["--config", "llama3_8b", *size])
        found, _ = search.layouts(cfg, cluster)
        space = search.candidates(cfg, found, 8, ("none", "budget"), (1024,), (False, True), {PREFETCH: (True, False)})
        budget = [c for c in space.cands if c.ac_mode == "budget"]
        assert budget and all(search.trainer_refuses(cfg, c) is None for c in space.cands)
        sharded = [c for c in budget if dict(c.degrees).get("dp_shard", 1) > 1]
        assert {dict(c.options).get(PREFETCH) for c in sharded} == {True, False}
        # The whole step's peak, accumulating or not, the update in the graph or eager after it: all taken (a size
        # beside accumulation was refused until the policy left room for what accumulation holds beside the graph).
        assert {c.trace_optimizer for c in budget} == {True, False}
        assert {c.accumulation > 1 for c in budget} == {True, False}
        assert not [what for what in space.refused if "is a whole-step peak" in what]


@pytest.mark.integration
@pytest.mark.slow(
    held_by="tests/layouts/test_search.py::test_a_budget_search_ranks_budgets_solved_at_their_own_batch"
)  # 131 s; and test_activation_checkpoint's accumulating size budget
def test_the_budget_is_searched_at_the_devices_memory_and_trains_at_its_planned_peak_accumulating(tmp_path):
    """AC budget in the search plans each layout to the device's memory (`memory_budget` set to it, said in one
    line), solved exactly at each ranked row's own batch; with accumulation, at the memory less what accumulation
    holds beside each micro-step (`Plans._beside`), as the trainer solves its micro-step graph. The best row
    accumulates (1 x 4 at dp_shard 2, where no AC peaks at 86,021,368 B, above the 81 MiB), fits, and trains on two
    ranks at its planned peak, to the byte. (A size budget with accumulation was refused until the policy left room
    for what accumulation holds beside the graph; read at the size itself, the row would be over it by those bytes.)"""
    from graph_trainer.distributed.launch import trainer_command

    six = ["--config", "llama3_debug", "--model.n_layers", "6", "--training.seq_len", "256"]
    out = tmp_path / "plan"
    proc = subprocess.run(
        [sys.executable, "-m", "graph_trainer.plan", *six, "--cluster.device", "cpu", "--cluster.gpus", "2",
         "--cluster.gpus_per_node", "2", "--cluster.memory_gib", "0.08", "--search.ac_modes", "budget",
         "--search.exact", "1", "--batch.global_seqs", "8", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("AC budget planned to --activation_checkpoint.memory_budget 81MiB (the device's") == 1
    row = json.loads((out / "plan.json").read_text())["ranked"][0]
    assert (row["ac_mode"], row["memory_budget"], row["peak_approximate"]) == ("budget", "81MiB", False)
    assert row["accumulation"] > 1 and row["peak_bytes"] <= 81 * 2**20
    run = tmp_path / "run"
    options = [a for o in row["overrides"] for a in o.split()]
    argv = [*trainer_command(2), *six, *options, "--training.steps", "2", "--job.dump_folder", str(run)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    print(
        f"{row['layout']}, {row['local_batch']} x {row['accumulation']}, budget 81MiB: planned {row['peak_bytes']:,} B"
    )
    for step in json.loads((run / "summary.json").read_text())["steps"]:
        assert step["peak_active_bytes"] == row["peak_bytes"] == step["estimated_peak_bytes"], step


@pytest.mark.integration
def test_a_pipeline_wins_across_a_slow_network_and_trains_at_its_planned_peak(tmp_path):
    """Two nodes of one GPU each, 10 MB/s apart: data parallelism would move the gradients (or FSDP's gathers) over
    that link every step, a pipeline only each micro-batch's activation. The search ranks pp first, and its peak is
    the exact stage plan's. The plan's options run on two local ranks: rank 0 (position 0, which holds the most
    under 1F1B) measures that peak, to the byte or by what gloo's worker thread freed late."""
    from graph_trainer.distributed.launch import trainer_command

    six = ["--config", "llama3_debug", "--model.n_layers", "6", "--training.seq_len", "64"]  # stages of 3 blocks
    out = tmp_path / "plan"
    proc = subprocess.run(
        [sys.executable, "-m", "graph_trainer.plan", *six, "--cluster.device", "cpu", "--cluster.gpus", "2",
         "--cluster.gpus_per_node", "1", "--cluster.inter_gbps", "0.01", "--search.ac_modes", "selective",
         "--search.pp", "true",
         "--search.exact", "2", "--batch.global_seqs", "8", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((out / "plan.json").read_text())
    best = plan["ranked"][0]
    assert best["layout"] == "pp 2" and best["pp_schedule"] == "1F1B" and not best["peak_approximate"], best
    assert best["peak_at"][1] == "pp rank 0" and best["bubble_s"] > 0 and best["comm_gib"]["pp send_recv"] > 0
    assert "--parallelism.pp 2" in plan["command"]
    # Accumulation beside pp is refused, counted, in the trainer's own words.
    assert any("pp > 1 with gradient accumulation" in why for why in plan["refused_candidates"])
    run = tmp_path / "run"
    options = [a for o in best["overrides"] for a in o.split()]
    argv = [*trainer_command(2), *six, *options, "--training.steps", "2", "--job.dump_folder", str(run)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for step in json.loads((run / "summary.json").read_text())["steps"][1:]:  # the first step makes torch's buffers
        late = step.get("late_free_bytes", 0)
        assert (
            step["peak_active_bytes"] == best["peak_bytes"]
            or 0 < step["peak_active_bytes"] - best["peak_bytes"] <= late
        )
        assert step["estimated_peak_bytes"] == best["peak_bytes"], step


def test_pipeline_layouts_screen_on_references_of_their_own():
    """A pipeline's share of the state lets a small dp_shard through pruning; its one-process reference can then
    peak in the AdamW update. As the reference of the layouts without a pipeline it screened Llama-3 405B's
    dp_shard 64 x tp 8 at 14.7 GiB against an exact 41.3 (-64%): the stages are keyed apart."""
    from graph_trainer.distributed import layout

    piped_key, piped_ref = layout.reference({"pp": 32, "dp_shard": 2, "tp": 8})
    flat_key, flat_ref = layout.reference({"pp": 1, "dp_shard": 64, "tp": 8})
    assert piped_key != flat_key and piped_ref["pp"] == 1 == flat_ref["pp"]
    assert layout.reference({"pp": 32, "dp_shard": 4, "tp": 8})[0] == piped_key  # FSDP's degrees still share one


def test_a_budget_row_that_recomputes_nothing_is_shown_once_as_none():
    """Where no AC fits, the budget recomputes nothing and its exact plan is the none row's: left out of the
    ranking (the planner says so once). A budget row that recomputes, or whose none row is not planned, stays."""
    from graph_trainer.plan.step_plan import StepPlan

    shard2 = (("dp_replicate", 1), ("dp_shard", 2), ("tp", 1))

    def row(mode: str, batch: int, flops: int) -> search.Screened:
        cand = search.Candidate(shard2, mode, batch, 0, False, memory_budget="80GiB" if mode == "budget" else "")
        plan = StepPlan(mode, 10 * 2**30, 0, {}, "", flops, 1000, 0.0)
        return search.Screened(cand, plan.peak_bytes, None, exact=plan)

    none, same, recomputes, alone = (
        row("none", 1, 100),
        row("budget", 1, 100),
        row("budget", 2, 90),
        row("budget", 4, 80),
    )
    assert search.repeats_of_none([none, same, recomputes, alone, row("none", 2, 100)]) == [same]


@pytest.mark.parametrize("gib", [0.0001, 0.0203, 0.3, 1.0, 5.3025, 61.0, 80.4, 123.4])
def test_a_suggested_memory_is_never_below_what_it_must_hold(gib):
    """`--cluster.memory_gib` suggestions round up (two significant digits below 10 GiB, a whole GiB above): to the
    nearest whole GiB, 5.3 needed was suggested as 5 and a debug model's 0.02 as 0."""
    from graph_trainer.observability.units import GIB, gib_at_least

    suggested = float(gib_at_least(gib * GIB))
    assert gib <= suggested <= gib * 1.1 + 1e-12, suggested
