"""The predicted step time of one rank's plan: compute at a stated fraction of peak, collectives by algorithm and
link, and only the overlap the executor has (docs/planner.md writes the model down).

- Compute: the plan's FLOPs (recompute included) / (peak x `efficiency`).
- Collectives, ring algorithm over a group of n ranks: all-gather and reduce-scatter move (n-1)/n of the full
  buffer over each rank's link, all-reduce twice that. A group whose ranks sit in one node uses the intra-node
  link, else the inter-node one (its slowest hop).
- Overlap: with `parallelism.fsdp_prefetch`, FSDP's all-gathers are issued a layer ahead and hide behind
  compute; nothing else overlaps (reduce-scatters, all-reduces and the norm's all-reduce wait in line).
"""

from __future__ import annotations

import dataclasses

from graph_trainer.plan.cluster import Cluster

RING_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "all_to_all": 1.0}


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: dict[str, float]
    exposed_comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s


def group_link_gbps(cluster: Cluster, group: int, stride: int) -> float:
    """The link a ring over `group` ranks, `stride` apart in rank order, runs at (GB/s per direction)."""
    within_node = group * stride <= cluster.gpus_per_node
    return cluster.device.intra_gbps if within_node else cluster.device.inter_gbps


def step_time(
    cluster: Cluster, flops: int, comm: dict[str, int], degrees: dict[str, int], efficiency: float, prefetch: bool
) -> StepTime:
    """The step time of a plan with `flops` and `comm` bytes per kind on a layout of `degrees` (mesh order:
    dp_replicate outermost, then dp_shard, then tp innermost)."""
    compute = flops / (cluster.device.peak_tflops * 1e12 * efficiency)
    tp = degrees.get("tp", 1)
    shard = degrees.get("dp_shard", 1)
    replicate = degrees.get("dp_replicate", 1)
    groups = {  # (size, stride) of the ring each kind runs on
        "all_gather": (shard, tp),
        "reduce_scatter": (shard, tp),
        # Replication all-reduces the gradients across replicas (the norm's small all-reduce is within them).
        "all_reduce": (replicate, shard * tp) if replicate > 1 else (shard, tp),
        "all_to_all": (shard, tp),
    }
    times = {}
    for kind, nbytes in comm.items():
        n, stride = groups.get(kind, (shard, tp))
        if n <= 1:
            times[kind] = 0.0
            continue
        gbps = group_link_gbps(cluster, n, stride)
        times[kind] = RING_FACTOR.get(kind, 1.0) * (n - 1) / n * nbytes / (gbps * 1e9)
    hidden = min(times.get("all_gather", 0.0), compute) if prefetch else 0.0
    return StepTime(compute, times, sum(times.values()) - hidden)


__all__ = ["StepTime", "group_link_gbps", "step_time"]
