"""Errors that are the user's to fix.

Anything raised as a `UserError` reaches the user as one line on stderr and exit
code 2 (see `graph_trainer.__main__`); everything else is a bug and keeps its
traceback.
"""


class UserError(Exception):
    """A mistake in the user's input (config, flags, files); the message names the cause and the fix."""


class ConfigError(UserError):
    """A config file or command-line override is malformed or out of range."""
