"""Where benchmark progress goes: stderr, flushed, so stdout stays the report's."""

from __future__ import annotations

import sys


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
