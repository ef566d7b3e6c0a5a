"""A run's log lines: every host runs the same code, host 0 alone prints."""

from __future__ import annotations

import sys

from prove_jax import distributed


def log_main(msg: str) -> None:
    """A line on stderr from host 0 only."""
    if distributed.is_main_process():
        print(msg, file=sys.stderr, flush=True)
