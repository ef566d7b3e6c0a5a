"""A step compiled for the run's shapes before any weight is read, and refused, with the sizes,
when the devices cannot hold it: the train step and the commit-head step alike."""

from __future__ import annotations

import time
from typing import Callable

import jax

from prove_jax import memory
from prove_jax.training.errors import TrainError


def compile_checked(jitted, abstract_args: tuple, mesh, *, name: str, what: str, advice: str,
                    log: Callable[[str], None]):
    """`jitted` lowered for `abstract_args` (ShapeDtypeStructs with shardings) on `mesh` and
    compiled; logs how long that took ("compiled the NAME in ...") and raises TrainError when
    `what` (a step of these shapes) needs more memory than the devices have free."""
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = jitted.lower(*abstract_args).compile()
    log(f"compiled the {name} in {time.perf_counter() - t0:.1f}s")
    memory.check_fits(compiled, memory.local_devices(mesh), what, error=TrainError,
                      with_arguments=True, advice=advice)
    return compiled
