"""`--profile DIR`: a `jax.profiler` trace of a few steps after warm-up.

The trace (`DIR/plugins/profile/<run>/<host>.xplane.pb`) opens in xprof or TensorBoard's
profile plugin. Warm-up steps (the first compiles them) are left out; each traced step is a
`StepTraceAnnotation` named for what it is (`decode_chunk`, `train_step`, ...), so the
profiler's step view splits the trace at them, and the compiled programs appear under their
jit names (`jit(run_chunk)`, ...).
"""

from __future__ import annotations

import contextlib
import os

import jax

DEFAULT_WARMUP = 2
DEFAULT_STEPS = 3


class StepProfile:
    """Wrap each step in `with profile.step():`; steps `warmup` .. `warmup + steps - 1` are
    traced into `directory`. A profile with no directory does nothing (callers wrap always)."""

    def __init__(self, directory: str | None, name: str, warmup: int = DEFAULT_WARMUP,
                 steps: int = DEFAULT_STEPS):
        if warmup < 0 or steps < 1:
            raise ValueError("profile: warm-up steps must be >= 0 and traced steps >= 1, got "
                             f"{warmup}, {steps}")
        if directory is not None and os.path.exists(directory) and not os.path.isdir(directory):
            raise NotADirectoryError(f"--profile {directory}: exists and is not a directory")
        self.directory, self.name, self.warmup, self.steps = directory, name, warmup, steps
        self.count = 0
        self.active = False
        self.traced = 0

    @contextlib.contextmanager
    def step(self, sync=None):
        """One step. `sync` (optional): called at the end of a traced step to wait for its
        device work, so the trace holds it whole before it stops."""
        if self.directory is None:
            yield
            return
        index = self.count
        self.count += 1
        if index == self.warmup and not self.active:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.active = True
        if not self.active:
            yield
            return
        with jax.profiler.StepTraceAnnotation(self.name, step_num=index):
            yield
            if sync is not None:
                sync()
        self.traced += 1
        if self.traced >= self.steps:
            self.close()

    def close(self) -> None:
        """Stop the trace if it runs (a run with fewer steps than warm-up + traced ones ends it
        here)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False

    def __enter__(self) -> "StepProfile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def trace_files(directory: str) -> list[str]:
    """The xplane files a trace wrote under `directory`."""
    out = []
    for root, _, files in os.walk(directory):
        out += [os.path.join(root, f) for f in files if f.endswith(".xplane.pb")]
    return sorted(out)
