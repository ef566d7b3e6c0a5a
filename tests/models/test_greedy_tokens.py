"""`tokens.greedy_tokens` is jnp.argmax, bit for bit: the lossless modes' exactness rests on it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prove_jax.models.tokens import greedy_tokens


@pytest.mark.parametrize("shape", [(7,), (1, 1), (3, 5, 33), (16, 4096)])
def test_equals_argmax_with_ties_infinities_and_nans(shape):
    rng = np.random.default_rng(sum(shape))
    # few distinct values, so most rows have their maximum several times: the first must win
    x = rng.integers(-3, 3, size=shape).astype(np.float32)
    x.reshape(-1, shape[-1])[0] = -np.inf  # a row of -inf: index 0
    if x.size // shape[-1] > 2:
        rows = x.reshape(-1, shape[-1])
        rows[1, -1] = np.nan  # a NaN counts as the maximum
        rows[2, :] = np.nan
        rows[-1, shape[-1] // 2] = np.inf
    want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
    got = jax.jit(greedy_tokens)(jnp.asarray(x))
    assert got.dtype == jnp.int32 and got.shape == shape[:-1]
    np.testing.assert_array_equal(np.asarray(got), want)


def test_equals_argmax_on_float_logits():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 9, 1000), jnp.float32)
    np.testing.assert_array_equal(np.asarray(greedy_tokens(x)), np.asarray(jnp.argmax(x, -1)))
    bf = x.astype(jnp.bfloat16)  # coarse values: many exact ties
    np.testing.assert_array_equal(np.asarray(greedy_tokens(bf)), np.asarray(jnp.argmax(bf, -1)))
