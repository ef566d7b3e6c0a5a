"""The base of every error a user can cause: command-line tools print it as one line and exit 2.

Each sub-package raises its own subclass (ConfigError, CheckpointError, DecodeError, ...), which
also derives from the builtin it used to be (ValueError or RuntimeError), so `except ValueError`
keeps working. Anything else that escapes a tool is a bug and keeps its traceback.
"""


class ProveJaxError(Exception):
    """Bad input, a bad checkpoint or a bad setting: the message names the problem and the fix."""
