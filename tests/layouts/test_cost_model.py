"""The cost model counts each loss once (docs/planner.md, "The cost model"): the counted FLOPs at the kernel-level
matmul rate and the card's sustained clock, the data movement around them as its share of compute, collectives at
nccl-tests' bus bandwidth, and only the overlap FSDP2 has (its all-gathers and reduce-scatters; TP stays exposed)."""

from __future__ import annotations

import dataclasses

import pytest

from graph_trainer.layouts.cluster import DEVICES, Cluster, power_capped_clock
from graph_trainer.layouts.cost_model import group_link_gbps, step_time

H100 = DEVICES["h100-80gb"]
FLOPS = 10**15
GIB = 2**30


def _time(device=H100, comm=None, degrees=None, prefetch=True, gpus=8):
    cluster = Cluster(device, gpus, 8)
    options = {"fsdp_prefetch": prefetch}
    return step_time(cluster, FLOPS, comm or {}, degrees or {"dp_shard": gpus}, device.efficiency, options)


def test_the_500_watt_card_runs_at_its_power_capped_clock():
    """The h100-96gb is the 700 W part's silicon at 500 W: the same FLOPs take 1 / (500/700)^(1/3) as long."""
    capped = DEVICES["h100-96gb"]
    assert capped.clock == power_capped_clock(500, 700) < 1 == H100.clock
    ratio = _time(capped).compute_s / _time(H100).compute_s
    assert ratio == pytest.approx((700 / 500) ** (1 / 3), rel=1e-12)  # both are the same formula: rounding only


def test_compute_is_the_counted_flops_at_the_matmul_rate_plus_their_data_movement():
    t = _time()
    assert t.counted_s == pytest.approx(FLOPS / (H100.matmul_tflops * 1e12), rel=1e-12)
    assert t.compute_s == pytest.approx(t.counted_s / H100.contraction_share, rel=1e-12)
    # No end-to-end MFU inside: the kernel-level efficiency alone sets the counted part.
    slower = dataclasses.replace(H100, efficiency=H100.efficiency / 2)
    assert _time(slower).counted_s == pytest.approx(2 * t.counted_s, rel=1e-12)


def test_fsdp_collectives_overlap_compute_and_tensor_parallel_ones_do_not():
    """FSDP2 overlaps its all-gathers (prefetched) and its reduce-scatters (own stream) with compute; plain TP's
    collectives sit on the critical path."""
    fsdp = {"fsdp all_gather": GIB, "fsdp reduce_scatter": GIB}
    t = _time(comm=fsdp)
    assert sum(t.comm_s.values()) > 0 and t.exposed_comm_s == 0.0
    assert _time(comm=fsdp, prefetch=False).exposed_comm_s == pytest.approx(sum(t.comm_s.values()))
    tp = _time(comm={"tp all_gather": GIB, "tp reduce_scatter": GIB}, degrees={"tp": 8})
    assert tp.exposed_comm_s == pytest.approx(sum(tp.comm_s.values())) and tp.exposed_comm_s > 0


def test_overlap_hides_at_most_the_compute_time():
    t = _time(comm={"fsdp reduce_scatter": 10**6 * GIB})
    assert t.exposed_comm_s == pytest.approx(t.comm_s["fsdp reduce_scatter"] - t.compute_s)


def test_a_group_across_nodes_runs_at_its_ranks_nics_together():
    """nccl-tests' bus bandwidth: NVLink within a node; across nodes, the NICs of the group's ranks in one node
    (one each), at most NVLink's rate."""
    cluster = Cluster(H100, 128, 8)
    assert group_link_gbps(cluster, 8, 1) == H100.intra_gbps  # one node
    assert group_link_gbps(cluster, 128, 1) == min(8 * H100.inter_gbps, H100.intra_gbps)  # 8 NICs a node: 400
    assert group_link_gbps(cluster, 16, 8) == H100.inter_gbps  # one rank a node (FSDP over tp 8): one NIC
    assert group_link_gbps(cluster, 32, 2) == 4 * H100.inter_gbps  # four ranks a node


def test_each_collective_is_priced_on_the_ring_its_parallelism_declares():
    """The rings come from the parallelisms (each declares its mesh dimension, or its ring) and the mesh order
    (dp_replicate, dp_shard, tp innermost; ep the inner part of dp_shard), not from a table in the cost model."""
    from graph_trainer.distributed.parallelize import collective_rings

    degrees = {"dp_replicate": 2, "dp_shard": 4, "tp": 8, "ep": 2}
    rings = {"tp": (8, 1), "fsdp": (4, 8), "dp_replicate": (2, 32), "ep": (2, 8), "expert_balance": (4, 8)}
    rings["pp"] = (1, 64)  # outermost: its stages' sends would cross the whole 64-rank layout (degree 1 here)
    assert collective_rings(degrees) == rings  # the MoE counts: no dimension of their own, the shards' ring


def test_a_pipeline_send_runs_on_nvlink_inside_a_node_and_on_one_nic_once_the_pipeline_spans_nodes():
    """Stage s's rank sends to rank + world / pp: within a node while the whole pipeline fits one, else over one NIC
    (each rank its own), whatever the ranks beside it do."""
    sent = {"pp send_recv": 10 * GIB}
    inside = _time(comm=sent, degrees={"pp": 2, "dp_shard": 4})  # stride 4: both stages in one node of 8
    across = _time(comm=sent, degrees={"pp": 2, "dp_shard": 8}, gpus=16)  # stride 8: the next node
    assert inside.comm_s["pp send_recv"] == pytest.approx(10 * GIB / (H100.intra_gbps * 1e9), rel=1e-12)
    assert across.comm_s["pp send_recv"] == pytest.approx(10 * GIB / (H100.inter_gbps * 1e9), rel=1e-12)
    # On the critical path: nothing hides it, prefetch or not.
    assert across.exposed_comm_s == pytest.approx(across.comm_s["pp send_recv"], rel=1e-12)


def test_the_bubble_is_the_idle_share_of_compute_added_to_the_step():
    cluster = Cluster(H100, 8, 8)
    busy = step_time(cluster, FLOPS, {}, {"pp": 8}, H100.efficiency, {})
    idle = step_time(cluster, FLOPS, {}, {"pp": 8}, H100.efficiency, {}, idle=7 / 16)
    assert idle.bubble_s == pytest.approx(busy.compute_s * 7 / 16, rel=1e-12) and busy.bubble_s == 0
    assert idle.total_s == pytest.approx(busy.total_s + idle.bubble_s, rel=1e-12)


def test_the_schedule_model_of_each_searched_schedule():
    """Position 0 of P = 4 stage positions, 8 micro-batches of one sequence (docs/planner.md, "Pipeline
    parallelism"): 1F1B holds P micro-batches of 1 / P of the model, GPipe all 8, Interleaved1F1B (2 stages a rank)
    its (2 - 1) 4 + 2 (4 - 1) = 10 warm-up forwards and one more of 1 / 8 each; the bubble is (P - 1) / (v M)."""
    from graph_trainer.distributed.pipeline import PipelineParallel

    def model(schedule):
        return PipelineParallel.schedule_model({"pp": 4, "dp_shard": 2}, {"pp_schedule": schedule}, 8, 100)

    one, gpipe, looped = model("1F1B"), model("GPipe"), model("Interleaved1F1B")
    assert (one.in_flight, gpipe.in_flight, looped.in_flight) == (1.0, 2.0, 11 / 8)
    assert (one.idle, gpipe.idle, looped.idle) == (3 / 8, 3 / 8, 3 / 16)
    assert one.work == 2 and one.state == 1 / 4 and one.micro_batch == 1
    # Every micro-batch's activation out and its gradient back, once a stage; a receive buffer each, kept.
    assert (one.p2p_bytes, looped.p2p_bytes, one.held_bytes) == (1600, 3200, 800)
    assert PipelineParallel.schedule_model({"pp": 1, "dp_shard": 8}, {}, 8, 100) is None
