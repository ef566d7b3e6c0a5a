"""Preemption: on SIGTERM every host saves the same step, then the run stops with PREEMPTED.

TPU maintenance events and spot reclaims send SIGTERM some time before they kill the job. A
checkpoint is one step of every host's shards, so the hosts must agree on the step they save:

- Several processes: JAX's preemption sync manager, started by `jax.distributed.initialize`
  (orbax's `CheckpointManager.reached_preemption` is the same call), catches SIGTERM on
  whichever host gets it. A background thread then has the hosts agree, through the
  coordination service, on the step after the furthest one any of them has reached. A step
  boundary only asks whether it is that step: a local lookup, with no collective and no wait
  for the devices, so it is asked at every step.
- One process: a Python SIGTERM handler sets a flag that the next step boundary reads.

The train loop saves the agreed step, waits until it is on disk, and raises `Preempted`; the
CLI exits with PREEMPTED. The relaunch resumes from that step like after any other stop.
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

import jax
from jax.experimental import multihost_utils

# EX_TEMPFAIL of sysexits.h, "temporary failure, retry later": the state is saved and the same
# command continues the run. Not 143 (128 + SIGTERM), which also means killed without a save.
PREEMPTED = 75


class Preempted(Exception):
    """A run that saved `step` on a preemption notice and stopped there (not an error: the
    relaunch continues it)."""

    def __init__(self, step: int, run_dir: str):
        super().__init__(f"preempted: saved step {step} to {run_dir}; relaunch the same command "
                         f"to continue")
        self.step = step
        self.run_dir = run_dir


class PreemptionWatch:
    """`with PreemptionWatch(start) as watch:` around the step loop; `watch.reached(step)` at
    every step boundary (each step once, in order, on every host) says whether to save there
    and stop.

    Steps are counted as the run counts them, as orbax's CheckpointManager also reports them
    to JAX's manager when it saves. That manager starts counting at 0, so a notice that comes
    while a resumed run restores or compiles agrees on step 1, which the run has passed: every
    host sees that on entry (all of them were still at 0) and saves the launch's first step.
    """

    def __init__(self, first_step: int, log: Callable[[str], None] = print):
        self.first_step = first_step
        self.log = log
        self.multihost = False
        self.signalled = False  # one process: SIGTERM came; several: a notice before the loop
        self._previous = None
        self._installed = False

    def __enter__(self) -> "PreemptionWatch":
        if jax.process_count() > 1:
            try:
                early = multihost_utils.reached_preemption_sync_point(1)
                multihost_utils.reached_preemption_sync_point(self.first_step)
            except RuntimeError:  # jax_enable_preemption_service is off: SIGTERM kills the job
                self.log("warning: the JAX preemption service is off (jax_enable_preemption_service"
                         "=false): a SIGTERM stops this run without saving; the newest checkpoint "
                         "stands")
                return self
            self.multihost = True
            self.signalled = early and self.first_step >= 1
        elif threading.current_thread() is threading.main_thread():  # signal.signal needs it
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            # None: the previous handler was not installed from Python
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None
                          else signal.SIG_DFL)
            self._installed = False

    def _on_sigterm(self, signum, frame) -> None:
        self.signalled = True

    def reached(self, step: int) -> bool:
        """Whether the hosts agreed to save `step` and stop: call it once for every step."""
        if self.multihost:
            return multihost_utils.reached_preemption_sync_point(step) or self.signalled
        return self.signalled
