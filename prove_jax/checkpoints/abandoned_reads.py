"""Quieting the reads that a failed orbax restore abandons.

When a restore fails, the tensorstore reads it had in flight finish later on their own threads
and report the same error again, once per chunk (hundreds under load): asyncio's "Future
exception was never retrieved", "Exception ignored ... Event loop is closed" (orbax closed its
loop) and "... Encountered error while reading array index". Orbax's restore (0.12) offers no
way to cancel or await them, and they arrive at any later time, so a failed path stays quieted
for the rest of the process (`QUIETED`); `restore_attempt` is the one way in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

ABANDONED_READ_ERROR = "Encountered error while reading array index"


def _is_closed_loop_error(exc: BaseException | None) -> bool:
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _is_abandoned_read_error(exc: BaseException | None) -> bool:
    """Orbax's read coroutine re-raising a tensorstore error: what an abandoned read prints
    ("Exception ignored in: <coroutine ... _read_array_index_and_device_put>") when it is
    closed after the restore failed, once per chunk read in flight."""
    return exc is not None and str(exc).startswith(ABANDONED_READ_ERROR)


class QuietedPaths:
    """The paths of failed restores whose late reports are dropped, and what drops them: an
    asyncio log filter and an unraisable hook in front of the one it found, installed with the
    first path. Only those reports are dropped (the first and last kinds only for these paths)."""

    def __init__(self):
        self.paths: set[str] = set()

    def add(self, path: str) -> None:
        if not self.paths:
            logging.getLogger("asyncio").addFilter(self._keep_record)
            previous_hook = sys.unraisablehook

            def hook(unraisable):
                exc = unraisable.exc_value
                if _is_closed_loop_error(exc):
                    return
                if _is_abandoned_read_error(exc) and self._names_a_path(str(exc)):
                    return
                previous_hook(unraisable)
            sys.unraisablehook = hook
        self.paths.add(os.path.abspath(path))

    def _names_a_path(self, text: str) -> bool:
        return any(d in text for d in self.paths)

    def _keep_record(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("Future exception was never retrieved"):
            return True
        error = str(record.exc_info[1]) if record.exc_info and record.exc_info[1] else ""
        return not (self._names_a_path(message) or self._names_a_path(error))


QUIETED = QuietedPaths()  # the process's: late reports come whenever their reads finish


@contextlib.contextmanager
def restore_attempt(path: str):
    """Run an orbax restore of `path` inside this. A failed restore's abandoned reads can report
    into orbax's closed event loop before the exception reaches the caller, so those
    unraisables are held while the restore runs: dropped (and `path` added to `QUIETED`) when it
    raises, passed on when it returns. Anything else passes at once."""
    held = []
    passed_on = sys.unraisablehook

    def hold(unraisable):
        exc = unraisable.exc_value
        if _is_closed_loop_error(exc) or _is_abandoned_read_error(exc):
            held.append(unraisable)
        else:
            passed_on(unraisable)

    sys.unraisablehook = hold
    try:
        yield
    except Exception:
        sys.unraisablehook = passed_on
        QUIETED.add(path)
        raise
    finally:
        if sys.unraisablehook is hold:
            sys.unraisablehook = passed_on
    for unraisable in held:
        passed_on(unraisable)
