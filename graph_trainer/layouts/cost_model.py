"""The predicted step time of one rank's plan, built from parts that each come from a public source, none of them
the published rows the planner is compared with (docs/planner.md, "The cost model", writes each part down).

- Compute: the plan's counted FLOPs (matmuls and attention, recompute included) run at the card's peak x its
  kernel-level matmul efficiency x its sustained clock (`Device.matmul_tflops`); the data movement no FLOP counter
  counts (norms, element-wise ops, the loss's softmax, the optimizer) takes the rest of an eager step's compute
  time, `Device.contraction_share` being the counted part's share. Nothing here is an end-to-end MFU: each loss is
  counted once, communication below.
- Collectives, as nccl-tests defines bus bandwidth (its doc/PERFORMANCE.md): over n ranks, all-gather and
  reduce-scatter take (n-1)/n x bytes / busbw, all-reduce twice that. A group within one node runs at NVLink's rate;
  a group across nodes runs at its ranks' NICs together (k ranks of the group in a node use k NICs, and NVLink
  carries the rest of the ring), at most NVLink's rate. Large messages reach the link rate (`BUS_EFFICIENCY`).
- Pipeline stages (`parallelism.pp`): a stage sends each micro-batch's activation to the next and its gradient
  back, point to point, at NVLink's rate while the whole pipeline sits in one node and at one NIC's rate once it
  spans nodes (the slowest boundary sets the pace), on the critical path. The bubble, the share of compute a rank
  idles while the schedule fills and drains (`idle`, from the parallelism's schedule model), is added to the step.
- Overlap, as FSDP2 runs: with `parallelism.fsdp_prefetch`, FSDP's all-gathers (issued a layer ahead) and
  reduce-scatters (on their own stream, while the layers before run their backward) hide behind compute, up to the
  compute time. Tensor parallelism's collectives sit on the critical path (plain TP, not async TP), and so do the
  rest: replication's and the gradient norm's all-reduces, expert parallelism's all-to-alls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from graph_trainer.distributed.parallelize import collective_rings
from graph_trainer.layouts.cluster import Cluster

# Bytes over the bus per byte of buffer, times (n-1)/n: nccl-tests' busbw factors (doc/PERFORMANCE.md).
BUS_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "all_to_all": 1.0}
# nccl-tests' bus bandwidth at large messages reaches the link rate on H100 systems: 460-480 GB/s all-reduce busbw
# on 8 x H100 SXM5 over 450 GB/s NVLink (docs.alayanew.com, "NCCL-tests in practice", 2026-05), 400-450 GB/s
# multi-node with 8 x 400 Gb/s NDR NICs a node (saturncloud.io, "Validating Multi-Node GPU Clusters with NCCL
# Tests"). The lower ends are the link rates, so the efficiency is 1.
BUS_EFFICIENCY = 1.0
# FSDP2's collectives that overlap compute (PyTorch's FSDP notes: all-gathers on their own stream, prefetched).
OVERLAPPED = ("fsdp all_gather", "fsdp reduce_scatter")
PREFETCH = "fsdp_prefetch"  # the option that issues them ahead (without it they are exposed)
POINT_TO_POINT = "send_recv"  # pipeline stages' sends to their neighbours (bytes sent a step, each way counted)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A step's predicted time: compute (counted FLOPs plus the data movement around them) and communication."""

    compute_s: float
    comm_s: dict[str, float]
    exposed_comm_s: float
    counted_s: float = 0.0  # the part of compute_s the counted FLOPs take at the matmul rate
    bubble_s: float = 0.0  # time idle in a pipeline schedule's fill and drain

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.bubble_s


def group_link_gbps(cluster: Cluster, group: int, stride: int) -> float:
    """The bus bandwidth (GB/s) of a ring over `group` ranks `stride` apart in rank order: NVLink within a node;
    across nodes, the NICs of the group's ranks in one node together, at most NVLink's rate."""
    device = cluster.device
    if group * stride <= cluster.gpus_per_node:
        return device.intra_gbps * BUS_EFFICIENCY
    per_node = max(1, cluster.gpus_per_node // stride)  # ranks of this group in one node, one NIC each
    return min(per_node * device.inter_gbps, device.intra_gbps) * BUS_EFFICIENCY


def point_to_point_gbps(cluster: Cluster, group: int, stride: int) -> float:
    """The rate (GB/s) of a send between neighbours along a dimension of `group` ranks `stride` apart: NVLink while
    the whole dimension sits in a node, else one NIC (each rank sends on its own)."""
    if group * stride <= cluster.gpus_per_node:
        return cluster.device.intra_gbps * BUS_EFFICIENCY
    return cluster.device.inter_gbps * BUS_EFFICIENCY


def step_time(
    cluster: Cluster,
    flops: int,
    comm: dict[str, int],
    degrees: dict[str, int],
    efficiency: float,
    options: Mapping[str, Any],
    *,
    idle: float = 0.0,
) -> StepTime:
    """The step time of a plan with `flops` and `comm` bytes by '<parallelism> <collective>' on a layout of
    `degrees` (mesh order: dp_replicate outermost, then dp_shard, then tp innermost; ep, when given, is carved out
    of dp_shard) with the [parallelism] `options` the step sets (`PREFETCH` overlaps FSDP's collectives).
    `efficiency`: the kernel-level matmul efficiency (the device's unless overridden). `idle`: the share of the
    compute time a pipeline schedule leaves the rank idle (its bubble)."""
    device = cluster.device
    counted = flops / (device.peak_tflops * 1e12 * efficiency * device.clock)
    compute = counted / device.contraction_share
    rings = collective_rings(degrees)  # (size, stride) of each parallelism's rings, from its mesh dimension
    times = {}
    for key, nbytes in comm.items():
        kind, _, collective = key.partition(" ")  # '<parallelism> <collective>' (passes/communication.py)
        n, stride = rings[kind]  # every collective's kind is a registered parallelism's
        if n <= 1:
            times[key] = 0.0
            continue
        if collective == POINT_TO_POINT:
            times[key] = nbytes / (point_to_point_gbps(cluster, n, stride) * 1e9)
            continue
        gbps = group_link_gbps(cluster, n, stride)
        times[key] = BUS_FACTOR.get(collective, 1.0) * (n - 1) / n * nbytes / (gbps * 1e9)
    overlapped = sum(times.get(key, 0.0) for key in OVERLAPPED) if options.get(PREFETCH) else 0.0
    hidden = min(overlapped, compute)
    return StepTime(compute, times, sum(times.values()) - hidden, counted, compute * idle)


__all__ = [
    "BUS_EFFICIENCY",
    "BUS_FACTOR",
    "OVERLAPPED",
    "POINT_TO_POINT",
    "StepTime",
    "group_link_gbps",
    "point_to_point_gbps",
    "step_time",
]
