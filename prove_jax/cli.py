"""What every command-line entry point does around its `main`: Ctrl-C is one line and exit 130.

An interrupt can come while XLA still runs work on its own threads (a dispatched train step, a
compile). The interpreter's teardown then crashes in native code after our message (SIGSEGV,
exit -11 instead of 130, in 3 of 3 tiny training runs stopped mid-run). Everything worth keeping
is on disk by then (checkpoints are closed by the trainer, outputs are written atomically,
benchmark partial reports are written after each batch size), so after an interrupt the process
leaves without that teardown.

Ctrl-C is also counted (`interrupt_pending`), and `trainer.train` checks the count every
step: once, in the test of this, a training run given SIGINT mid-run went on to its last step
and exited 0 (1 run in about 70 that day, not reproduced in about 100 tries since). Where its
KeyboardInterrupt was lost was not found; code that drops the errors of the Python it calls
(a `__del__`, a native callback) would do it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, NoReturn

INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT
_interrupts = 0  # Ctrl-C seen under run_cli


def _on_sigint(signum, frame):
    """Ctrl-C under `run_cli`: counted, then KeyboardInterrupt as Python's default handler does."""
    global _interrupts
    _interrupts += 1
    raise KeyboardInterrupt


def interrupt_pending() -> bool:
    """Whether Ctrl-C came while `run_cli` ran (always False outside it: library use keeps
    Python's own handler)."""
    return _interrupts > 0


def run_cli(main: Callable[[], int]) -> NoReturn:
    """`sys.exit(main())`, with Ctrl-C as "interrupted" on stderr and exit 130 (a `main` that
    reports the interrupt itself returns 130)."""
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
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
