"""`dense`: the model's projections, and the forms a decode step's few rows run in on CPU, where
XLA's dot kernels are much faster for them than x @ w^T as written (benchmarks/step_cost.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from prove_jax.models.compute import DEFAULT_COMPUTE, ComputeOptions

# XLA:CPU covers a weight-major product's token rows in tiles of 8 and a ragged last tile costs
# about a whole one, so past 4 rows they are padded (benchmarks/step_cost.md, "unpadded").
DOT_ROW_TILE = 8
DOT_UNPADDED_MAX_ROWS = 4


def decode_matmul_form(compute: ComputeOptions = DEFAULT_COMPUTE) -> tuple[str, int]:
    """(form, most token rows it is used for) that `dense` applies under `compute`
    (`ComputeOptions.decode_form`: its explicit choice, else its platform's default)."""
    return compute.decode_form()


def dense(x: jax.Array, w: jax.Array, n_in: int = 1, compute: ComputeOptions = DEFAULT_COMPUTE,
          out_dtype=None) -> jax.Array:
    """x [..., *in] times w [*out, *in] -> [..., *out], in the form `decode_matmul_form` picks:
    weight_major w @ x^T (rows padded, `padded_dot_rows`), input_major x @ t(w) (the transpose
    is hoisted out of the decode loop, tests/decoding/test_decode_in_place.py), or plain. The
    barriers keep XLA from folding a form back into the plain one. `out_dtype`: the dot's
    accumulation and result dtype (None: the operands'), e.g. float32 logits from bfloat16
    weights."""
    dot = functools.partial(jnp.tensordot, preferred_element_type=out_dtype)
    x_in = tuple(range(x.ndim - n_in, x.ndim))
    w_in = tuple(range(w.ndim - n_in, w.ndim))
    lead = x.shape[:x.ndim - n_in]
    rows = math.prod(lead)
    form, max_rows = decode_matmul_form(compute)
    if rows > max_rows or form == "plain":
        return dot(x, w, axes=(x_in, w_in))
    if form == "input_major":
        w_t = jax.lax.optimization_barrier(jnp.transpose(w, w_in + tuple(range(w.ndim - n_in))))
        return dot(x, w_t, axes=(x_in, tuple(range(n_in))))
    x_rows = x.reshape(rows, *x.shape[x.ndim - n_in:])  # [R, *in]
    padded = padded_dot_rows(rows, compute)
    if padded != rows:
        x_rows = jnp.pad(x_rows, ((0, padded - rows),) + ((0, 0),) * n_in)
    y = jax.lax.optimization_barrier(  # [*out, R']
        dot(w, x_rows, axes=(w_in, tuple(range(1, n_in + 1)))))
    y = jnp.moveaxis(y[..., :rows], -1, 0)  # [R, *out]
    return y.reshape(*lead, *y.shape[1:])


def padded_dot_rows(rows: int, compute: ComputeOptions = DEFAULT_COMPUTE) -> int:
    """Token rows a weight-major product of `rows` rows runs with (see DOT_ROW_TILE)."""
    if not compute.pad_dot_rows or rows <= DOT_UNPADDED_MAX_ROWS:
        return rows
    return -(-rows // DOT_ROW_TILE) * DOT_ROW_TILE
