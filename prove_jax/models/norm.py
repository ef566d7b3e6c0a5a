"""RMSNorm, as HF's Qwen2/Qwen3 compute it: the mean square in float32, the weight applied in the
input's dtype. Over the residual stream (weight axis "embed"), and in Qwen3 over each query and
key head (weight axis "head_dim", replicated: every device holds whole heads' width)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from prove_jax.models.initializers import param


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs, axis: str = "embed"):
        self.eps = eps
        self.weight = param(rngs, (dim,), (axis,), param_dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim], normalised over its last axis."""
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * y.astype(x.dtype)
