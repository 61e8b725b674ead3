"""Which compile options run together: checked before anything is traced or compiled.

Its own module, without Inductor: importing `torch._inductor` costs seconds of start-up in every process, and
a job that does not compile must not pay it to have its options checked.
"""

from __future__ import annotations

import torch

from graph_trainer.errors import ConfigError

BACKENDS = ("none", "inductor")


def check_compile_config(
    backend: str, cudagraphs: bool, mode: str, device: torch.device, *, regional: bool = False
) -> None:
    """Refuse combinations that cannot run, naming the fix.

    Raises:
        ConfigError: an unknown backend, a compile backend with the eager step,
            or CUDA graphs without inductor, off CUDA or with a regional compile.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"compile.backend must be one of {'|'.join(BACKENDS)}, got {backend!r}")
    if backend != "none" and mode != "trace":
        raise ConfigError(
            f"compile.backend = '{backend}' compiles the traced step; set compile.mode = 'trace' "
            "or compile.backend = 'none'"
        )
    if cudagraphs and backend != "inductor":
        raise ConfigError("compile.cudagraphs = true needs compile.backend = 'inductor'")
    if cudagraphs and device.type != "cuda":
        raise ConfigError(
            f"compile.cudagraphs = true needs a CUDA device, but the job runs on {device.type}; "
            "set compile.cudagraphs = false"
        )
    if cudagraphs and regional:
        # One CUDA graph per region would re-record for each layer's own parameter addresses.
        raise ConfigError(
            "compile.cudagraphs = true replays the whole step as one CUDA graph, but compile.regional "
            "= true cuts it into regions; set compile.regional = false"
        )
