"""Wall-clock timing on a shared machine: one jitted call, and interleaved rounds of many.

Calibration (`decoding/calibrate.py`) and the scripts in benchmarks/ time the same way, so their
numbers compare: each candidate runs in turn every round, and the fastest run counts, since load
on a shared machine only ever adds time.
"""

from __future__ import annotations

import time

import jax


def timed(fn, *args) -> float:
    """Wall seconds of one call of a jitted `fn`, waiting for its results."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def fastest_interleaved(runs: dict, repeats: int, keep=None, warm_up: bool = True) -> dict:
    """{key: seconds} from callables that each run once and return the seconds they took.

    Every callable runs once first (compile, warm up; `warm_up=False` when the caller did),
    then `repeats` rounds call them in turn, so a load change hits them alike; the fastest run
    counts (a shared machine only adds time). `keep({key: seconds})`, when given, is asked after
    the first round which keys are worth the other rounds; the rest keep their one timing.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warm_up:
        for fn in runs.values():
            fn()
    best = {key: float("inf") for key in runs}
    timing = list(runs)
    for i in range(repeats):
        for key in timing:
            best[key] = min(best[key], runs[key]())
        if i == 0 and keep is not None:
            kept = set(keep(dict(best)))
            timing = [key for key in timing if key in kept]
    return best
