"""The accelerators the planner knows, with the source of every figure, and a cluster built from them.

Every figure can be overridden on the command line (`--cluster.memory_gib`, `--cluster.peak_tflops`,
`--cluster.intra_gbps`, `--cluster.inter_gbps`). Bandwidths are per GPU and per direction, in GB/s
(10^9 bytes): NVLink's published "bidirectional" totals are halved, and the inter-node figure is one
InfiniBand NIC per GPU, as the DGX/HGX systems ship.
"""

from __future__ import annotations

import dataclasses

import torch

from graph_trainer.errors import UserError

# The parts of the cost model that belong to a card (docs/planner.md, "The cost model"), each from a public source
# that is not one of the published rows the planner is compared with.
HOPPER_MATMUL = 0.801
HOPPER_MATMUL_SOURCE = (
    "maximum achievable bf16 matmul FLOPS of an H100 SXM (700 W), 792.1 of 989 TFLOPS (CUDA 12.1): "
    "stas00/ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison table'"
)
# Eager PyTorch transformer training: tensor contractions are 99.8% of the FLOPs and 61.0% of the runtime, the
# normalizations and element-wise ops (which no FLOP counter counts) the other 39% (Ivanov et al., "Data Movement
# Is All You Need", MLSys 2021, Table 1, BERT on V100).
CONTRACTION_SHARE = 0.61
CONTRACTION_SHARE_SOURCE = "Ivanov et al., Data Movement Is All You Need (MLSys 2021), Table 1: 61.0% of runtime"


def power_capped_clock(watts: float, rated_watts: float) -> float:
    """The sustained clock of a card capped at `watts`, as a fraction of the same card's at `rated_watts`.

    Under a power cap the clock falls until the dynamic power a*C*V^2*f fits, and the voltage falls with the clock
    (DVFS), so the power goes as f^3 and the clock as the cube root of the power ratio. A physical model, not a
    measurement of the card: docs/planner.md says so where it is used.
    """
    return (watts / rated_watts) ** (1 / 3)


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator: memory (GiB, as torch reports it), dense bf16 peak (TFLOP/s, the datasheet's, which MFU is
    quoted against), links (GB/s per direction), and the parts of the cost model that belong to the card."""

    name: str
    memory_gib: float
    peak_tflops: float
    intra_gbps: float
    inter_gbps: float
    source: str
    # The fraction of peak a large bf16 matmul reaches on the card at its rated power (kernel level, measured).
    efficiency: float = HOPPER_MATMUL
    efficiency_source: str = HOPPER_MATMUL_SOURCE
    # The sustained clock against the one `efficiency` was measured at (below 1: a power-capped part).
    clock: float = 1.0
    clock_source: str = "rated power: the clock `efficiency` was measured at"
    # The share of an eager step's compute time its counted FLOPs (matmuls, attention) take; the rest is data
    # movement (norms, element-wise ops, the loss's softmax, the optimizer) that no FLOP counter counts.
    contraction_share: float = CONTRACTION_SHARE
    contraction_share_source: str = CONTRACTION_SHARE_SOURCE

    @property
    def matmul_tflops(self) -> float:
        """The rate the counted FLOPs run at: peak x kernel-level matmul efficiency x sustained clock."""
        return self.peak_tflops * self.efficiency * self.clock


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            "h100-80gb",
            79.1,
            989.4,
            450.0,
            50.0,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 80 GB HBM3, 989.4 dense BF16 TFLOPS, NVLink 900 GB/s "
            "bidirectional, 700 W); DGX H100: one 400 Gb/s ConnectX-7 per GPU; 79.1 GiB is torch's total_memory",
        ),
        Device(
            "h100-96gb",
            94.5,
            989.4,
            450.0,
            50.0,
            "H100 SXM5 96 GB variant (torchtitan's 2024-12 benchmark machine), run at a 500 W power limit against "
            "the 700 W the datasheet rates the SXM5 part at",
            clock=power_capped_clock(500, 700),
            clock_source="500 W against the 700 W part: (500/700)^(1/3) = 0.894 of its sustained clock "
            "(dynamic power ~ f^3 under DVFS; a physical model, not a measurement)",
        ),
        Device(
            "h200",
            139.8,
            989.4,
            450.0,
            50.0,
            "NVIDIA H200 datasheet (SXM: 141 GB HBM3e, 989 dense BF16 TFLOPS, NVLink 900 GB/s, 700 W); "
            "one 400 Gb/s NIC per GPU",
        ),
        Device(
            "a100-80gb",
            79.2,
            312.0,
            300.0,
            25.0,
            "NVIDIA A100 datasheet (SXM4 80 GB, 312 BF16 TFLOPS dense, NVLink 600 GB/s); DGX A100: one 200 Gb/s "
            "HDR NIC per GPU",
            efficiency=0.859,
            efficiency_source="maximum achievable bf16 matmul FLOPS of an A100 SXM, 267.9 of 312 TFLOPS: "
            "stas00/ml-engineering, compute/accelerator/README.md",
        ),
        Device(
            "b200",
            178.0,
            2250.0,
            900.0,
            50.0,
            "NVIDIA HGX B200 datasheet (180 GB HBM3e, 4.5 PFLOPS sparse FP16/BF16 per GPU = 2.25 dense, NVLink 5 "
            "1.8 TB/s); one 400 Gb/s NIC per GPU",
            efficiency_source="no published maximum achievable matmul FLOPS in that table: the H100 SXM's, "
            + HOPPER_MATMUL_SOURCE,
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`gpus` devices of one kind, `gpus_per_node` to a node."""

    device: Device
    gpus: int
    gpus_per_node: int

    @property
    def memory_bytes(self) -> int:
        return int(self.device.memory_gib * 1024**3)


def cpu_device() -> Device:
    """This machine's CPU as a 'device': the memory available now; a peak measured by one fp32 matmul; gloo
    over loopback at a nominal 5 GB/s (the CPU plan checks memory, its times are indicative only)."""
    import time

    from graph_trainer.plan.preflight import available_bytes

    n = 512
    a = torch.randn(n, n)
    torch.mm(a, a)
    start = time.perf_counter()
    for _ in range(8):
        torch.mm(a, a)
    tflops = 8 * 2 * n**3 / (time.perf_counter() - start) / 1e12
    return Device(
        "cpu",
        available_bytes(torch.device("cpu")) / 1024**3,
        tflops,
        5.0,
        5.0,
        "measured on this machine",
        1.0,
        "the peak is this machine's measured matmul rate",
        contraction_share=1.0,
        contraction_share_source="the CPU plan's times are indicative only: its FLOPs alone",
    )


def build_cluster(device: str, gpus: int, gpus_per_node: int, overrides: dict[str, float | None]) -> Cluster:
    """The cluster the options describe.

    Raises:
        UserError: an unknown device, or a GPU count that is not whole nodes.
    """
    if device == "cpu":
        base = cpu_device()
    elif device in DEVICES:
        base = DEVICES[device]
    else:
        raise UserError(f"--cluster.device {device!r} is unknown; choose one of {', '.join([*DEVICES, 'cpu'])}")
    if gpus < 1 or gpus_per_node < 1 or (gpus > gpus_per_node and gpus % gpus_per_node):
        raise UserError(
            f"--cluster.gpus {gpus} is not a whole number of nodes of --cluster.gpus_per_node {gpus_per_node}"
        )
    base = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    return Cluster(base, gpus, min(gpus_per_node, gpus))


__all__ = [
    "CONTRACTION_SHARE",
    "DEVICES",
    "HOPPER_MATMUL",
    "Cluster",
    "Device",
    "build_cluster",
    "cpu_device",
    "power_capped_clock",
]
