"""Progress lines while the planner works: what it is on, of how many, and the time since it began.

A 70B search plans for minutes; without a word the user cannot tell a slow search from a stuck one. A line is said
at most every `every_s` seconds (not one per item: a small model's items take a fraction of a second each).
"""

from __future__ import annotations

import time
from collections.abc import Callable

EVERY_S = 10.0  # one line per ten seconds at most: a 70B screen says about one per shape, a small search none


class Progress:
    """Say, now and then, which item of how many a stage is on (`__call__` before each item)."""

    def __init__(
        self,
        say: Callable[[str], None] = print,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.say, self.every_s, self.clock = say, every_s, clock
        self.start = self._last = clock()

    def __call__(self, stage: str, index: int, total: int, what: str) -> None:
        """Item `index` (1-based) of `total` of `stage` is starting: say so if `every_s` passed since the last line."""
        now = self.clock()
        if now - self._last < self.every_s:
            return
        self._last = now
        self.say(f"{stage} {index}/{total}: {what} ({now - self.start:.0f} s elapsed)")


def silent(stage: str, index: int, total: int, what: str) -> None:
    """A progress that says nothing (library callers that print their own)."""


__all__ = ["EVERY_S", "Progress", "silent"]
