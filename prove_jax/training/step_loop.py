"""The loop over training steps that every trained thing here runs (the model, loop.py; the
commit head, commit_head_training.py): fetch the global batch, step, log, refuse a non-finite
loss, and in a run that checkpoints, save and heed a preemption notice (preemption.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from prove_jax.profiling import StepProfile
from prove_jax.training.batches import next_global_batch
from prove_jax.training.errors import TrainError
from prove_jax.training.metrics import Goodput
from prove_jax.training.preemption import PreemptionWatch


@dataclasses.dataclass
class Steps:
    """What one run's steps are: the compiled step, the data, and what a logged step writes."""
    step_fn: Callable  # compiled (state, batch) -> (state, metrics with "loss")
    data_iter: object  # this host's rows of each global batch (batches.py)
    mesh: object
    record: Callable[[int, dict], dict]  # (step, metrics) -> the record it wrote and showed
    log_every: int  # steps logged: every log_every-th and the last ...
    log_first: bool  # ... and the launch's first (the model's run, whose bar starts there)
    check_batch: Callable[[int, dict], None] | None = None  # (step, global batch): refuse one


def run_steps(steps: Steps, state: dict, start: int, end: int, goodput: Goodput,
              log: Callable[[str], None], saves=None,
              profile: str | None = None) -> tuple[dict, list[dict], int | None]:
    """Steps start+1..end. Returns (state, the logged records, the step saved on a preemption
    notice or None). `saves`, for a run that checkpoints (its state then holds "params"):
    `due(step, end)`, `save(step, state, preempted)`, `wait()`; without it nothing is saved and
    SIGTERM is left alone. `profile`: a directory for a jax.profiler trace of a few steps."""
    records, preempted_at = [], None
    tracing = StepProfile(profile, "train_step")
    watch = PreemptionWatch(start, log) if saves is not None else contextlib.nullcontext()
    try:
        with jax.set_mesh(steps.mesh), watch as preemption:
            goodput.begin_steps()
            for step in range(start, end):
                done = step + 1
                with goodput.timing("data_wait"):
                    batch = next_global_batch(steps.data_iter, steps.mesh)
                if steps.check_batch is not None:
                    steps.check_batch(done, batch)
                # traced: the step whole
                with tracing.step(sync=lambda: jax.block_until_ready(state)):
                    state, metrics = steps.step_fn(state, batch)
                # asked at every step on every host (JAX's manager agrees on a step it was
                # told); the last step saves as usual
                preempted = preemption is not None and preemption.reached(done) and done < end
                saving = saves is not None and (saves.due(done, end) or preempted)
                if (done % steps.log_every == 0 or done == end
                        or (steps.log_first and done == start + 1)):
                    rec = steps.record(done, metrics)
                    records.append(rec)
                    check_finite(done, rec["loss"], state["params"] if saving else None)
                elif saving:  # never checkpoint a diverged state, logged step or not
                    check_finite(done, float(metrics["loss"]), state["params"])
                if saving:
                    jax.block_until_ready(state)  # the step's compute counts as a step's
                    with goodput.timing("checkpoint"):
                        saves.save(done, state, preempted)
                if preempted:  # the kill follows the notice: the checkpoint only, then stop
                    saves.wait()
                    preempted_at = done
                    break
            goodput.end_steps()
        if saves is not None:
            saves.wait()
    finally:
        tracing.close()
    return state, records, preempted_at


@jax.jit
def _all_finite(params) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))


def check_finite(step: int, loss: float, params) -> None:
    """Refuse to go on (or save) from a diverged state: the step's loss (computed before its
    update) and the updated weights themselves must be finite."""
    if not math.isfinite(loss):
        raise TrainError(f"loss is {loss} at step {step}; stopping (lower optimizer.lr or set "
                         f"optimizer.clip_norm)")
    if params is not None and not bool(_all_finite(params)):
        raise TrainError(f"the weights became non-finite at step {step}; stopping without saving "
                         f"them (lower optimizer.lr or set optimizer.clip_norm)")
