"""What every command-line entry point does around its `main`: Ctrl-C is one line and exit 130.

An interrupt can come while XLA still runs work on its own threads (a dispatched train step, a
compile). The interpreter's teardown can then crash in native code after our message (SIGSEGV,
exit -11 instead of 130). Everything worth keeping is on disk by then (checkpoints are closed by
the trainer, outputs are written atomically, benchmark partial reports are written after each
batch size), so after an interrupt the process leaves without that teardown.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn

INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT
BAD_INPUT = 2  # a user-facing error: bad flags, input or checkpoints (argparse's code too)


def fail(error: BaseException) -> int:
    """Report a user-facing error as one line on stderr; returns BAD_INPUT for `main` to return."""
    print(f"error: {error}", file=sys.stderr)
    return BAD_INPUT


def run_cli(main: Callable[[], int]) -> NoReturn:
    """`sys.exit(main())`, with Ctrl-C as "interrupted" on stderr and exit 130 (a `main` that
    reports the interrupt itself returns 130)."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = INTERRUPTED
    if code == INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED)
    sys.exit(code)
