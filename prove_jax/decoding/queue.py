"""Continuous batching inside the compiled loop: a queue of Q requests served by B rows.

A static batch steps until its slowest row is done, and with ProVe the rows drift apart (one
request commits 3.5 tokens per step, another 1.5), so a finished row would idle. Instead,
before every step, each finished row hands its request's results to the per-request outputs
(`harvest`) and takes the next queued request (`admit`: prefill of that one row, written over
the whole row of the batch state). Everything stays on device with static shapes: the queue is
a [Q, P] prompt array and a counter, outputs are [Q, N] buffers indexed by request.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from prove_jax.decoding.state import LoopState


@struct.dataclass
class QueueState:
    """Which request each row serves, the next request to admit, and per-request results."""
    req: jax.Array  # [B] request index served by each row
    next_req: jax.Array  # scalar int32
    tokens: jax.Array  # [Q, N] the request's token row (prompt + output) once harvested
    length: jax.Array  # [Q]
    forwards: jax.Array  # [Q]
    verifier_forwards: jax.Array  # [Q]
    accept_hist: jax.Array  # [Q, K + 1]
    step_commits: jax.Array | None  # [Q, N] with DecodeOptions.record_steps


def start(num_requests: int, state: LoopState) -> QueueState:
    """Rows 0..B-1 already hold requests 0..B-1 (state built from the first B prompts)."""
    b, n_slots = state.tokens.shape
    q = num_requests
    zeros = jnp.zeros((q,), jnp.int32)
    return QueueState(
        req=jnp.arange(b, dtype=jnp.int32), next_req=jnp.int32(b),
        tokens=jnp.zeros((q, n_slots), jnp.int32), length=zeros, forwards=zeros,
        verifier_forwards=zeros, accept_hist=jnp.zeros((q,) + state.accept_hist.shape[1:], jnp.int32),
        step_commits=None if state.step_commits is None else jnp.zeros((q, n_slots), jnp.int32))


def harvest(qs: QueueState, state: LoopState, rows: jax.Array) -> QueueState:
    """Copy the results of `rows` [R] into their requests' output slots."""
    dest = qs.req[rows]
    commits = qs.step_commits
    if commits is not None:
        commits = commits.at[dest].set(state.step_commits[rows])
    return qs.replace(
        tokens=qs.tokens.at[dest].set(state.tokens[rows]), length=qs.length.at[dest].set(state.length[rows]),
        forwards=qs.forwards.at[dest].set(state.forwards[rows]),
        verifier_forwards=qs.verifier_forwards.at[dest].set(state.verifier_forwards[rows]),
        accept_hist=qs.accept_hist.at[dest].set(state.accept_hist[rows]), step_commits=commits)


def put_row(state: LoopState, row: LoopState, index: jax.Array) -> LoopState:
    """`state` with batch row `index` replaced by the one-row state `row`; the scalars (the loop
    counter) are the batch's and stay."""
    return jax.tree.map(
        lambda full, one: full if full.ndim == 0 else jax.lax.dynamic_update_slice_in_dim(full, one, index, 0),
        state, row)


def refill(state: LoopState, qs: QueueState, num_requests: int,
           admit: Callable[[jax.Array], LoopState]) -> tuple[LoopState, QueueState]:
    """While a row is done and requests wait: harvest the row, then admit the next request.

    `admit(r)` returns the one-row state of request r right after its prefill.
    """
    def waiting(carry):
        st, q = carry
        return jnp.any(st.done) & (q.next_req < num_requests)

    def admit_one(carry):
        st, q = carry
        row = jnp.argmax(st.done).astype(jnp.int32)
        q = harvest(q, st, row[None])
        st = put_row(st, admit(q.next_req), row)
        return st, q.replace(req=q.req.at[row].set(q.next_req), next_req=q.next_req + 1)

    return jax.lax.while_loop(waiting, admit_one, (state, qs))


def finish(state: LoopState, qs: QueueState) -> QueueState:
    """Harvest every row (each still holds the last request it served)."""
    return harvest(qs, state, jnp.arange(state.tokens.shape[0]))
