"""SIGINT and SIGTERM: stop at a step boundary, save, and say how to continue.

Schedulers send SIGTERM before they kill a job, and Ctrl-C sends SIGINT. While
the training loop runs (`StopRequest`), either signal only sets a flag: the
current step finishes, the trainer writes a checkpoint (when checkpointing is on)
and `summary.json` records `status = "interrupted"`. Outside the loop (start-up,
preflight) a signal unwinds at once, as Ctrl-C always did. A second SIGINT during
the loop stops at once too: the last written checkpoint is still complete
(saves are atomic). SIGTERM never forces, because torchrun answers Ctrl-C by
sending its workers SIGTERM after the terminal's SIGINT.

With several ranks the flag is combined over all of them once a step (one
all-reduce of one integer), so every rank stops after the same step even when
only one of them was signalled.

Exit codes: 128 + the signal number, as shells report a death by signal
(130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only when needed, so --help stays fast
    import torch

# A child of the `graph_trainer` logger (graph_trainer.observability.log), named without importing it: runtime is
# the layer below observability.
logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The process exit code for a run stopped by `signum` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal; `message` says what was saved and how to continue.

    A KeyboardInterrupt, so that code catching Exception lets it through.
    """

    def __init__(self, signum: int, message: str | None = None) -> None:
        self.signum = signum
        self.message = message or f"interrupted by {signal.Signals(signum).name}"
        super().__init__(self.message)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def unwind_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C (finally blocks run, one line, exit 143) instead of killing the process.

    Call once from the command line's main thread; the training loop defers it further (`StopRequest`).
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupted)


class StopRequest:
    """While entered, SIGINT/SIGTERM set a flag that the loop reads between steps (see the module doc).

    Installs handlers only in the main thread (Python delivers signals there);
    restores the previous handlers on exit.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            force = "; press Ctrl-C again to stop at once" if signum == signal.SIGINT else ""
            logger.warning(f"{signal.Signals(signum).name} received: finishing this step, then saving{force}")
        elif signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise Interrupted(signum)

    def agreed(self, group: torch.distributed.ProcessGroup | None, device: torch.device) -> int | None:
        """The signal any rank received (the same answer on every rank), or None to go on.

        With a process group this is a collective: every rank must call it once per step.
        """
        if group is None:
            return self.signum
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum or 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        value = int(flag.item())
        return value or None
