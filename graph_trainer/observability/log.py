"""The `graph_trainer` logger: progress messages as plain lines on stdout, from rank 0 only.

Modules log through `get_logger(__name__)` (children of the `graph_trainer`
logger) instead of taking a print callback. `configure_console(rank)` is what
the trainer calls: it prints INFO and above as bare message lines on rank 0
(the console looks as it always did) and only warnings and errors on the other
ranks. Applications that configure logging themselves can skip it, or change
the `graph_trainer` logger's level and handlers afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

LOGGER_NAME = "graph_trainer"


def get_logger(name: str) -> logging.Logger:
    """The logger for module `name` (`__name__`), under the `graph_trainer` logger."""
    if name != LOGGER_NAME and not name.startswith(LOGGER_NAME + "."):
        name = f"{LOGGER_NAME}.{name}"
    return logging.getLogger(name)


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is at the time of the message (so redirection and capture work)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property always reads sys.stdout
        pass


def configure_console(rank: int = 0) -> None:
    """Print `graph_trainer` messages on stdout: INFO and above on rank 0, WARNING and above elsewhere.

    Idempotent: calling it again only updates the level for `rank`.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
        logger.addHandler(_StdoutHandler())
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Within the block, `graph_trainer` logs warnings and errors only (e.g. for what-if plans nobody runs)."""
    logger = logging.getLogger(LOGGER_NAME)
    level = logger.level
    logger.setLevel(max(logging.WARNING, level))
    try:
        yield
    finally:
        logger.setLevel(level)
