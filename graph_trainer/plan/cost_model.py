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
    """The step time of a plan with `flops` and `comm` bytes by '<parallelism> <collective>' on a layout of
    `degrees` (mesh order: dp_replicate outermost, then dp_shard, then tp innermost; ep, when given, is carved out
    of dp_shard)."""
    compute = flops / (cluster.device.peak_tflops * 1e12 * efficiency)
    tp = degrees.get("tp", 1)
    shard = degrees.get("dp_shard", 1)
    replicate = degrees.get("dp_replicate", 1)
    groups = {  # (size, stride) of the ring each parallelism's collectives run on (tp innermost)
        "tp": (tp, 1),
        "fsdp": (shard, tp),
        # Replication all-reduces the gradients across replicas.
        "dp_replicate": (replicate, shard * tp),
        # Expert parallelism's all-to-alls run over ep ranks carved out of dp_shard (its inner part), tp apart.
        "ep": (degrees.get("ep", 1), tp),
    }
    times = {}
    for key, nbytes in comm.items():
        kind, _, collective = key.partition(" ")  # '<parallelism> <collective>' (passes/communication.py)
        n, stride = groups.get(kind, (shard, tp))
        if n <= 1:
            times[key] = 0.0
            continue
        gbps = group_link_gbps(cluster, n, stride)
        times[key] = RING_FACTOR.get(collective, 1.0) * (n - 1) / n * nbytes / (gbps * 1e9)
    hidden = min(times.get("fsdp all_gather", 0.0), compute) if prefetch else 0.0
    return StepTime(compute, times, sum(times.values()) - hidden)


__all__ = ["StepTime", "group_link_gbps", "step_time"]
