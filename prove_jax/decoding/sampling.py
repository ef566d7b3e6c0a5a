"""Sampling: per-request parameters, the processed distribution, seeded draws, and the
speculative rule that keeps ProVe-lossless exact in distribution.

Every row carries its own parameters as traced arrays (`RowSampling`), so one compiled program
serves any mix of greedy and sampled requests. Only what changes the program is static
(`Sampler`: whether any row truncates the vocabulary with top-k/top-p, which needs a sort, or
uses min-p). Temperature 0 is greedy: the row's distribution is one-hot at `greedy_tokens`.

The processed distribution follows transformers' logits warpers in their order (temperature,
top-k, top-p, min-p; tests/decoding/test_sampling.py compares them on the same logits).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from prove_jax.decoding.options import DecodeError
from prove_jax.models.tokens import greedy_tokens

SEED_LIMIT = 2 ** 32  # seeds are uint32 in the program


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded (the names of transformers' `generate` and vLLM)."""

    temperature: float = 0.0
    """0: greedy (argmax); above 0: sample from softmax(logits / temperature)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0: all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p; 1: all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; 0: none."""
    seed: int | None = None
    """Makes the request's output reproducible whatever its batch, row and neighbours."""
    max_new_tokens: int | None = None
    """New-token budget; None: the call's."""
    stop: tuple[str, ...] = ()
    """The output is cut before the first occurrence of any of these strings."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the request like the model's EOS (kept in the output, as EOS is)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> "SamplingParams":
        """Checked copy (lists become tuples); errors name the field and the value."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise DecodeError(f"temperature must be a number >= 0 (0 is greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise DecodeError(
                f"top_k must be an integer >= 0 (0 keeps every token), got {self.top_k!r}"
            )
        if not _number_in(self.top_p, 0, 1) or self.top_p == 0:
            raise DecodeError(f"top_p must be in (0, 1] (1 keeps every token), got {self.top_p!r}")
        if not _number_in(self.min_p, 0, 1):
            raise DecodeError(f"min_p must be in [0, 1] (0 keeps every token), got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise DecodeError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        m = self.max_new_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise DecodeError(f"max_new_tokens must be an integer >= 1, got {m!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise DecodeError(
                f"stop must be a string or a list of non-empty strings, got {self.stop!r}"
            )
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise DecodeError(
                f"stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}"
            )
        return dataclasses.replace(
            self,
            temperature=float(t),
            top_p=float(self.top_p),
            min_p=float(self.min_p),
            stop=tuple(stop),
            stop_token_ids=tuple(ids),
        )


def _number_in(x, low: float, high: float) -> bool:
    return (
        not isinstance(x, bool)
        and isinstance(x, (int, float))
        and math.isfinite(x)
        and low <= x <= high
    )


GREEDY = SamplingParams()


@dataclasses.dataclass(frozen=True)
class Sampler:
    """The static side of sampling in one program: which filters any of its rows uses."""

    truncate: bool = False
    """Some row has top_k or top_p: the program sorts each distribution's vocabulary."""
    min_p: bool = False
    """Some row has min_p."""

    @classmethod
    def for_requests(cls, params: Sequence[SamplingParams]) -> "Sampler | None":
        """The sampler a call of these requests needs; None when all are greedy (the greedy
        program, with no distributions carried)."""
        sampled = [p for p in params if not p.greedy]
        if not sampled:
            return None
        return cls(truncate=any(p.top_k > 0 or p.top_p < 1 for p in sampled),
                   min_p=any(p.min_p > 0 for p in sampled))


@struct.dataclass
class RowSampling:
    """Per-row sampling parameters, traced: [R] each."""
    temperature: jax.Array  # float32, 0 = greedy
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32, 1 = off
    min_p: jax.Array  # float32, 0 = off
    seed: jax.Array  # uint32

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int]):
        """Host (numpy) arrays for a queue of requests; `seeds` are the requests' final seeds."""
        return cls(temperature=np.asarray([p.temperature for p in params], np.float32),
                   top_k=np.asarray([p.top_k for p in params], np.int32),
                   top_p=np.asarray([p.top_p for p in params], np.float32),
                   min_p=np.asarray([p.min_p for p in params], np.float32),
                   seed=np.asarray(seeds, np.uint32))


# ---- the processed distribution ------------------------------------------------------------

def _per_row(x: jax.Array, like: jax.Array) -> jax.Array:
    """[R] -> broadcastable against `like` [R, ..., V]."""
    return x.reshape(x.shape + (1,) * (like.ndim - 1))


def processed_logits(logits: jax.Array, rows: RowSampling, sampler: Sampler) -> jax.Array:
    """float32 logits [R, J, V] after temperature, top-k, top-p and min-p (filtered: -inf), as
    transformers' warpers compute them. Rows with temperature 0 are divided by 1."""
    t = _per_row(rows.temperature, logits)
    x = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
    # A program compiled for the filters (a server's) skips each at run time when no row of the
    # step uses it: a filter off in every row leaves the logits as they are, and the vocabulary
    # sort is a large part of a small model's step (docs/serving.md).
    if sampler.truncate:
        x = jax.lax.cond(jnp.any((rows.top_k > 0) | (rows.top_p < 1)),
                         lambda x: _top_k_top_p(x, rows.top_k, rows.top_p), lambda x: x, x)
    if sampler.min_p:
        x = jax.lax.cond(jnp.any(rows.min_p > 0), lambda x: _min_p(x, rows.min_p), lambda x: x, x)
    return x


def _min_p(x: jax.Array, min_p: jax.Array) -> jax.Array:
    """MinPLogitsWarper with per-row min_p."""
    probs = jax.nn.softmax(x, axis=-1)
    floor = _per_row(min_p, x) * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < floor, -jnp.inf, x)


def _top_k_top_p(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """TopKLogitsWarper then TopPLogitsWarper with per-row k and p: a token is dropped when its
    logit is below the k-th largest, then when the ascending cumulative probability up to and
    including it is at most 1 - p (the most likely token always stays)."""
    vocab = x.shape[-1]
    descending = -jnp.sort(-x, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(
        descending, jnp.broadcast_to(_per_row(k - 1, x), x.shape[:-1] + (1,)), axis=-1
    )
    x = jnp.where(x < kth, -jnp.inf, x)
    ascending = jnp.where(descending < kth, -jnp.inf, descending)[..., ::-1]
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    drop = cumulative <= 1 - _per_row(top_p, x)
    drop = drop.at[..., -1].set(False)
    lowest_kept = jnp.min(jnp.where(drop, jnp.inf, ascending), axis=-1, keepdims=True)
    return jnp.where(x < lowest_kept, -jnp.inf, x)


def token_probs(logits: jax.Array, rows: RowSampling, sampler: Sampler) -> jax.Array:
    """The distribution each row samples from, float32 [R, J, V]: softmax of the processed
    logits, or one-hot at the greedy token for a row with temperature 0."""
    probs = jax.nn.softmax(processed_logits(logits, rows, sampler), axis=-1)
    greedy = jax.nn.one_hot(greedy_tokens(logits), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(_per_row(rows.temperature, probs) > 0, probs, greedy)


# ---- seeded draws --------------------------------------------------------------------------

# What a row's draws in one step are for: each gets its own stream.
PROPOSE, ACCEPT, CORRECT, DRAFT = range(4)


def step_keys(seed: jax.Array, forwards: jax.Array, purpose: int, count: int) -> jax.Array:
    """Keys [R, count] for one step's draws: a function of the request's seed, its own forward
    count and the purpose only, so a request draws the same numbers in any batch or row."""
    def row(s, f):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(s), f), purpose)
        return jax.random.split(key, count)
    return jax.vmap(row)(seed, forwards)


def draw(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per key from probs [R, J, V] (keys [R, J]) -> int32 [R, J]. A one-hot
    distribution always yields its token."""
    logp = jnp.log(probs)
    return jax.vmap(jax.vmap(jax.random.categorical))(keys, logp).astype(jnp.int32)


def uniforms(keys: jax.Array) -> jax.Array:
    """One U[0, 1) number per key, [R, J]."""
    return jax.vmap(jax.vmap(jax.random.uniform))(keys)


def sample_tokens(logits: jax.Array, rows: RowSampling, sampler: Sampler, forwards: jax.Array,
                  purpose: int) -> tuple[jax.Array, jax.Array]:
    """(tokens [R, J] drawn from each position's processed distribution, that distribution
    [R, J, V]); greedy rows get exactly `greedy_tokens`."""
    probs = token_probs(logits, rows, sampler)
    tokens = draw(step_keys(rows.seed, forwards, purpose, logits.shape[1]), probs)
    tokens = jnp.where(rows.temperature[:, None] > 0, tokens, greedy_tokens(logits))
    return tokens, probs


# ---- speculative sampling ------------------------------------------------------------------

def speculative_accept(p: jax.Array, q: jax.Array, drafts: jax.Array, u: jax.Array,
                       valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling's rule over one step's drafts.

    p [R, M+1, V]: the target distribution at each draft's position and one past the last;
    q [R, M, V]: the distribution each draft was drawn from; drafts [R, M]; u [R, M] uniforms;
    valid [R]: the row has drafts (not its first step). Draft i is accepted with probability
    min(1, p_i(d_i) / q_i(d_i)) while all before it were. Returns (accepted a [R], the
    distribution of the token after them [R, V]: on a rejection the residual
    max(0, p_a - q_a) normalised, else p_a). The committed tokens are then distributed as p
    exactly, whatever q is.
    """
    m = drafts.shape[1]
    p_draft = jnp.take_along_axis(p[:, :m], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    ok = (u * q_draft < p_draft) & valid[:, None]
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)
    p_next = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    q_next = jnp.take_along_axis(q, jnp.minimum(accepted, m - 1)[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_next - q_next, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    rejected = (valid & (accepted < m))[:, None] & (total > 0)
    return accepted, jnp.where(rejected, residual / jnp.where(total > 0, total, 1.0), p_next)
