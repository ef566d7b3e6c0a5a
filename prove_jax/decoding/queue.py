"""Continuous batching inside the compiled loop: a queue of Q requests served by B rows.

ProVe rows drift apart (one commits 3.5 tokens per step, another 1.5), so in a static batch a
finished row would idle. Before every step each finished row hands its results to the
per-request outputs (`harvest`) and takes the next request (`admit`, a one-row prefill written
over the row). The queue is a [Q, P] prompt array and a counter; outputs are [Q, N] buffers.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from prove_jax.decoding.sampling import RowSampling
from prove_jax.decoding.state import Logprobs, LoopState
from prove_jax.models.paged import PagedKVCache


@struct.dataclass
class Requests:
    """The queue's requests as arrays, [Q, ...] each; what `decode_loop` serves."""
    prompts: jax.Array  # [Q, P] int32, padded
    prompt_len: jax.Array  # [Q]
    max_new: jax.Array  # [Q] budget; 0 marks padding (never admitted)
    stop_ids: jax.Array  # [Q, S] EOS and the request's stop_token_ids, -1 pads
    sampling: RowSampling | None  # None: every request greedy

    def rows(self, start: int, count: int) -> "Requests":
        """Requests start .. start+count-1 (static)."""
        return jax.tree.map(lambda x: x[start: start + count], self)

    def one(self, index: jax.Array) -> "Requests":
        """Request `index` (traced) as a queue of one."""
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, index, 1, 0), self)


@struct.dataclass
class QueueState:
    """Which request each row serves, the next request to admit, and per-request results."""
    request: jax.Array  # [B] request index served by each row
    next_request: jax.Array  # scalar int32
    tokens: jax.Array  # [Q, N] the request's token row (prompt + output) once harvested
    length: jax.Array  # [Q]
    forwards: jax.Array  # [Q]
    verifier_forwards: jax.Array  # [Q]
    accept_hist: jax.Array  # [Q, K + 1]
    step_commits: jax.Array | None  # [Q, N] with DecodeOptions.record_steps
    logprobs: Logprobs | None  # [Q, N, ...] with DecodeOptions.logprobs


def start(num_requests: int, state: LoopState, admitted: jax.Array | None = None) -> QueueState:
    """Rows 0..B-1 already hold requests 0..B-1 (state built from the first B prompts); with
    `admitted` [B] (a prefix: what a paged pool could hold), only those, and the others wait."""
    rows, n_slots = state.tokens.shape
    zeros = jnp.zeros((num_requests,), jnp.int32)
    request = jnp.arange(rows, dtype=jnp.int32)
    next_request = jnp.int32(rows)
    if admitted is not None:  # a row that took none hands nothing out (past the queue: dropped)
        request = jnp.where(admitted, request, num_requests)
        next_request = jnp.sum(admitted.astype(jnp.int32))
    return QueueState(
        request=request,
        next_request=next_request,
        tokens=jnp.zeros((num_requests, n_slots), jnp.int32),
        length=zeros,
        forwards=zeros,
        verifier_forwards=zeros,
        accept_hist=jnp.zeros((num_requests,) + state.accept_hist.shape[1:], jnp.int32),
        step_commits=(
            None if state.step_commits is None else jnp.zeros((num_requests, n_slots), jnp.int32)
        ),
        logprobs=(
            None
            if state.logprobs is None
            else Logprobs.zeros(num_requests, n_slots, state.logprobs.top_ids.shape[-1])
        ),
    )


def harvest(queue_state: QueueState, state: LoopState, rows: jax.Array) -> QueueState:
    """Copy the results of `rows` [R] into their requests' output slots (a row serving none,
    past the queue: dropped)."""
    dest = queue_state.request[rows]
    commits = queue_state.step_commits
    if commits is not None:
        commits = commits.at[dest].set(state.step_commits[rows], mode="drop")
    logprobs = queue_state.logprobs
    if logprobs is not None:
        logprobs = jax.tree.map(
            lambda out, row: out.at[dest].set(row[rows], mode="drop"), logprobs, state.logprobs
        )
    return queue_state.replace(
        logprobs=logprobs,
        tokens=queue_state.tokens.at[dest].set(state.tokens[rows], mode="drop"),
        length=queue_state.length.at[dest].set(state.length[rows], mode="drop"),
        forwards=queue_state.forwards.at[dest].set(state.forwards[rows], mode="drop"),
        verifier_forwards=queue_state.verifier_forwards.at[dest].set(
            state.verifier_forwards[rows], mode="drop"
        ),
        accept_hist=queue_state.accept_hist.at[dest].set(state.accept_hist[rows], mode="drop"),
        step_commits=commits,
    )


def put_state(state: LoopState, part: LoopState, rows: jax.Array, put) -> LoopState:
    """`state` with `put(full, part)` applied to each per-row leaf; a paged pool (the proposer's,
    and the verifier's on the same pages) is the admitted rows' (their prefill wrote into it),
    with their page tables put at `rows` [R]."""
    if not isinstance(state.cache, PagedKVCache):
        return jax.tree.map(put, state, part)
    merged = jax.tree.map(put, state.replace(cache=None, verifier_cache=None),
                          part.replace(cache=None, verifier_cache=None))
    cache = state.cache.put_rows(part.cache, rows)
    verifier_cache = part.verifier_cache  # paged on the proposer's pages (start_rows), or None
    if isinstance(verifier_cache, PagedKVCache):
        verifier_cache = verifier_cache.with_pages_of(cache)
    elif verifier_cache is not None:  # contiguous beside the pool (paged.pooled)
        verifier_cache = jax.tree.map(put, state.verifier_cache, verifier_cache)
    return merged.replace(cache=cache, verifier_cache=verifier_cache)


def release_done(state: LoopState) -> LoopState:
    """`state` with the pages of its done rows back in the paged pools (the verifier's follows
    the proposer's)."""
    cache = state.cache.release(state.done)
    verifier_cache = state.verifier_cache
    if isinstance(verifier_cache, PagedKVCache):
        verifier_cache = verifier_cache.with_pages_of(cache)
    return state.replace(cache=cache, verifier_cache=verifier_cache)


def put_row(state: LoopState, row: LoopState, index: jax.Array) -> LoopState:
    """`state` with batch row `index` replaced by the one-row state `row`; the scalars (the loop
    counter) are the batch's and stay."""
    return put_state(state, row, index[None], lambda full, one: full if full.ndim == 0 else
                     jax.lax.dynamic_update_slice_in_dim(full, one, index, 0))


def refill(state: LoopState, queue_state: QueueState, num_requests: jax.Array,
           admit: Callable[[jax.Array, LoopState], LoopState],
           need: jax.Array | None = None) -> tuple[LoopState, QueueState]:
    """While a row is done and requests wait: harvest the row, then admit the next request.

    `admit(r, state, row)` returns the one-row state of request r for `row` right after its
    prefill. With a paged KV pool, `need` [Q] gives each request's pages: the finished rows'
    pages are freed first, and the next request waits (in order) until a done row's data shard
    has its pages free.
    """
    paged = need is not None
    if paged:
        state = release_done(state)

    def free_rows(state, queue_state):
        """bool [B]: done rows the next request may take (paged: its shard has its pages free)."""
        if not paged:
            return state.done
        nxt = jnp.minimum(queue_state.next_request, need.shape[0] - 1)
        room = state.cache.free_pages() >= need[nxt]  # [D]
        return state.done & room[state.cache.row_homes()]

    def waiting(carry):
        state, queue_state = carry
        return jnp.any(free_rows(state, queue_state)) & (queue_state.next_request < num_requests)

    def admit_one(carry):
        state, queue_state = carry
        row = jnp.argmax(free_rows(state, queue_state)).astype(jnp.int32)
        queue_state = harvest(queue_state, state, row[None])
        state = put_row(state, admit(queue_state.next_request, state, row), row)
        return state, queue_state.replace(
            request=queue_state.request.at[row].set(queue_state.next_request),
            next_request=queue_state.next_request + 1,
        )

    return jax.lax.while_loop(waiting, admit_one, (state, queue_state))


def finish(state: LoopState, queue_state: QueueState) -> QueueState:
    """Harvest every row (each still holds the last request it served)."""
    return harvest(queue_state, state, jnp.arange(state.tokens.shape[0]))
