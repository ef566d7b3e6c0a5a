"""Token ids from and into a model: the greedy token, and ids a model has embedding rows for."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """logits [..., V] -> int32 [...], exactly `jnp.argmax` (first index of the largest; NaN
    counts as largest; tests/models/test_greedy_tokens.py), as two plain reductions because
    XLA:CPU does not vectorise argmax's (value, index) one (benchmarks/argmax.md)."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    holds_top = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(holds_top, index, logits.shape[-1] - 1), axis=-1)


def readable_tokens(tokens: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """(tokens with ids past the model's `vocab_size` embedding rows replaced by 0, bool mask of
    the ids it has rows for). Models sharing a tokenizer can differ in padded rows (Qwen2.5-32B
    152,064, Qwen2.5-3B 151,936); an id past the verifier's rows would gather NaN and poison its
    cache, so it is fed as 0 and the caller rejects it."""
    inside = tokens < vocab_size
    return jnp.where(inside, tokens, 0), inside
