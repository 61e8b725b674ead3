"""Errors that are the user's to fix.

Anything raised as a `UserError` reaches the user as one line on stderr and exit
code 2 (see `graph_trainer.__main__`), a `WriteFailed` as one line and exit code 74;
everything else is a bug and keeps its traceback.
"""

import difflib


class UserError(Exception):
    """A mistake in the user's input (config, flags, files); the message names the cause and the fix."""


class ConfigError(UserError):
    """A config file or command-line override is malformed or out of range."""


class WriteFailed(Exception):
    """A run stopped because a write failed (a full disk, a quota, an I/O error): not the user's input, but
    theirs to fix. The message names the file's folder, the cause, what was kept and how to continue; the
    command line reports it in one line with its own exit code (see `graph_trainer.__main__`)."""


class TrainingDiverged(Exception):
    """The run blew up (non-finite or exploding values); nothing was saved for the failing step.

    Not a user error: `__main__` reports it in one line with its own exit code, 3.
    """


def closest_match(given: str, candidates: list[str], *, ignore_case: bool = False) -> str | None:
    """The candidate `given` was most likely meant to be (difflib's closest), or None if none is close."""
    if not ignore_case:
        close = difflib.get_close_matches(given, candidates, n=1)
        return close[0] if close else None
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(given.lower(), list(by_lower), n=1)
    return by_lower[close[0]] if close else None


def did_you_mean(given: str, candidates: list[str]) -> str:
    """The tail " (did you mean 'x'?)" for the closest candidate, or "" when none is close."""
    close = closest_match(given, candidates)
    return f" (did you mean '{close}'?)" if close else ""
