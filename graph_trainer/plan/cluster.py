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


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator: memory (GiB, as torch reports it), dense bf16 peak (TFLOP/s), links (GB/s per direction)."""

    name: str
    memory_gib: float
    peak_tflops: float
    intra_gbps: float
    inter_gbps: float
    source: str
    # The fraction of peak the step's compute runs at: one calibration constant per device (docs/planner.md).
    efficiency: float = 0.40
    efficiency_source: str = (
        "Llama 3 paper (arXiv 2407.21783, Table 4): 38-43% BF16 MFU pre-training 405B on 8K-16K H100s; "
        "not fitted to any row it is compared with"
    )


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
            "bidirectional); DGX H100: one 400 Gb/s ConnectX-7 per GPU; 79.1 GiB is torch's total_memory",
        ),
        Device(
            "h100-96gb",
            94.5,
            989.4,
            450.0,
            50.0,
            "H100 SXM5 96 GB HBM3 variant (torchtitan's 2024-12 benchmark machine, 500 W power limit: its "
            "sustained clock, hence peak, is lower than the 700 W part's 989.4 TFLOPS used here)",
        ),
        Device(
            "h200",
            139.8,
            989.4,
            450.0,
            50.0,
            "NVIDIA H200 datasheet (SXM: 141 GB HBM3e, 989 dense BF16 TFLOPS, NVLink 900 GB/s); "
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
        ),
        Device(
            "b200",
            178.0,
            2250.0,
            900.0,
            50.0,
            "NVIDIA HGX B200 datasheet (180 GB HBM3e, 4.5 PFLOPS sparse FP16/BF16 per GPU = 2.25 dense, NVLink 5 "
            "1.8 TB/s); one 400 Gb/s NIC per GPU",
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


__all__ = ["DEVICES", "Cluster", "Device", "build_cluster", "cpu_device"]
