"""JAX's persistent compilation cache, pointed at the config's `compilation_cache_dir`.

A compiled program is stored under a key of its HLO, compile options, devices and jax/XLA
versions, so a relaunch of the same run (same config, mesh and versions) reads the train step
instead of compiling it again: minutes for a 32B model (benchmarks/tpu_compile.md). Every
program is stored, however fast it compiled: a relaunch then also skips the small ones.
"""

from __future__ import annotations

import os

import jax
from jax._src import compilation_cache as _jax_cache  # reset_cache: jax reads the folder once


def use_compilation_cache(path: str | None) -> str | None:
    """Compile through the persistent cache in `path` from now on (created if missing); None
    leaves JAX's settings alone. Returns the folder in use before (None: none)."""
    previous = jax.config.jax_compilation_cache_dir
    if path is None:
        return previous
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if previous != path:
        jax.config.update("jax_compilation_cache_dir", path)
        _jax_cache.reset_cache()  # JAX opens the folder at its first compile and keeps it
    return previous
