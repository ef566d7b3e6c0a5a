"""A model weight: an `nnx.Param` carrying its logical axes, which `sharding.DEFAULT_RULES` maps
to mesh axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype,
          init: str = "normal") -> nnx.Param:
    """A weight of `shape`, initialised 'normal' (std 0.02, as HF's Qwen2), 'zeros' or 'ones'."""
    if init == "normal":
        value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:
        value = jnp.ones(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)
