"""What a failed orbax restore says: the first line of its error without the TensorStore spec
dump, the parameter it is about, and on several hosts whether another host failed first."""

from __future__ import annotations

import re

import jax

from prove_jax.checkpoints.abandoned_reads import ABANDONED_READ_ERROR


# The TensorStore spec in an orbax read error: the parameter's directory is its kvstore path
# ('path': '.../params/NAME/' in orbax's dump, "path":"..." in tensorstore's JSON, its quotes
# escaped in a [tensorstore_spec='...'] suffix; in OCDBT the last path is the key, NAME/).
_SPEC_PATH = re.compile(r"""\\*['"]path\\*['"]\s*:\s*\\*['"]([^'"\\]+)""")


def _parameter_of(text: str) -> str | None:
    """The parameter an orbax/tensorstore read error is about, from the last kvstore path in its
    spec (None when the message has no such path or it names the params directory itself)."""
    paths = _SPEC_PATH.findall(text)
    if not paths:
        return None
    name = paths[-1].rstrip("/").rsplit("/", 1)[-1]
    return name if name and name != "params" else None


def restore_error_reason(e: BaseException) -> str:
    """The first line of an orbax/tensorstore restore error, without its spec dump (hundreds of
    characters of JSON). For orbax's "Encountered error while reading array index ...", which
    names only a slice, the cause's reason is given, and the parameter is named from the spec."""
    text = str(e).strip()
    reason = text.splitlines()[0] if text else type(e).__name__
    for dump in (" See full TensorStore", " [tensorstore_spec="):
        reason = reason.split(dump)[0]
    cause = e.__cause__
    if reason.startswith(ABANDONED_READ_ERROR) and cause is not None and str(cause).strip():
        reason = restore_error_reason(cause)
    param = _parameter_of(text)
    if param and f"parameter {param}" not in reason:
        reason = f"parameter {param}: {reason}"
    return reason[:300]


def restore_failure(path: str, e: BaseException,
                    what: str = "a damaged or incomplete checkpoint") -> str:
    """The error for a restore of `path` that raised `e`. On several hosts a restore is a
    collective read: when another host failed before it (a missing file there, say), this one
    times out waiting for it, which says nothing about this checkpoint."""
    reason = restore_error_reason(e)
    if jax.process_count() > 1 and "DEADLINE_EXCEEDED" in reason:
        return (f"cannot restore {path}: the other hosts did not join the read in time (a host "
                f"that failed first says why in its own log): {reason}")
    return f"cannot restore {path} ({what}): {reason}"
