"""Loop state of the compiled decode loop and the commit rule shared by every mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from prove_jax.decoding.sampling import RowSampling
from prove_jax.models.attention import KVCache
from prove_jax.models.paged import PagedKVCache


def write_rows(buffer: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """buffer [B, N, ...] with row b's values[b] written at slots[b] (one slot, or [W] of them
    with values[b] [W, ...]); a slot past N is dropped. Written per row (vmapped), so the rows
    are the scatter's batching dimension and each device of a mesh writes its own rows (with
    explicit row indices GSPMD all-gathered every step's tokens and slots over the batch)."""
    return jax.vmap(lambda row, s, v: row.at[s].set(v.astype(row.dtype), mode="drop"))(
        buffer, slots, values
    )


@struct.dataclass
class Logprobs:
    """Log-probabilities of committed tokens under the distribution they were committed from
    (AR's in `ar` and `lossless`), at the same slots as the tokens: [B, N] and [B, N, n]."""
    chosen: jax.Array  # float32 [B, N]
    top_ids: jax.Array  # int32 [B, N, n]: the n most likely tokens there
    top_logprobs: jax.Array  # float32 [B, N, n]

    @classmethod
    def zeros(cls, rows: int, slots: int, n: int) -> "Logprobs":
        return cls(
            chosen=jnp.zeros((rows, slots), jnp.float32),
            top_ids=jnp.zeros((rows, slots, n), jnp.int32),
            top_logprobs=jnp.zeros((rows, slots, n), jnp.float32),
        )

    def write(self, slots: jax.Array, block: jax.Array, logits: jax.Array) -> "Logprobs":
        """Record block [B, W] drawn from `logits` [B, W, V] at `slots` [B, W] (out of range:
        dropped)."""
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logp, block[..., None], axis=-1)[..., 0]
        n = self.top_ids.shape[-1]
        if n == 0:
            return self.replace(chosen=write_rows(self.chosen, slots, chosen))
        top_logprobs, top_ids = jax.lax.top_k(logp, n)
        return Logprobs(chosen=write_rows(self.chosen, slots, chosen),
                        top_ids=write_rows(self.top_ids, slots, top_ids.astype(jnp.int32)),
                        top_logprobs=write_rows(self.top_logprobs, slots, top_logprobs))


@struct.dataclass
class LoopState:
    """Everything the `while_loop` carries. B rows, N token slots.

    Invariants after every step: tokens[b, :length[b]] are committed; the proposer cache holds
    KV for [0, cache_len[b]) and the committed tokens [cache_len, length) are pending (their KV
    is written by the next proposer forward); the verifier cache holds [0, verifier_cache_len).
    """
    step: jax.Array  # scalar int32
    tokens: jax.Array  # [B, N] int32
    length: jax.Array  # [B] committed tokens (prompt + generated)
    prompt_len: jax.Array  # [B]
    max_new: jax.Array  # [B] per-row budget of new tokens
    done: jax.Array  # [B] bool
    cache: KVCache | PagedKVCache
    cache_len: jax.Array  # [B]
    drafts: jax.Array  # [B, M] lossless drafts for the next step (M >= 1; unused otherwise)
    draft_len: jax.Array  # [B] how many of them are real predictions (the rest is filler)
    verifier_cache: KVCache | PagedKVCache | None  # paged: on the proposer pool's pages
    verifier_cache_len: jax.Array  # [B]
    forwards: jax.Array  # [B] proposer forwards while the row was active
    verifier_forwards: jax.Array  # [B]
    accept_hist: jax.Array  # [B, K + 1] histogram of per-step AR-matching / committed lengths
    stop_ids: jax.Array  # [B, S] tokens that end the row (EOS and its stop_token_ids; -1 pads)
    # Optional trace (DecodeOptions.record_steps): tokens committed by each of a row's steps,
    # [B, S] int32 with column = the row's forward index; None keeps the loop free of it.
    step_commits: jax.Array | None = None
    sampling: RowSampling | None = None  # per-row parameters; None: a greedy program
    # [B, M, V] lossless sampling: what each draft was drawn from
    draft_probs: jax.Array | None = None
    logprobs: Logprobs | None = None  # with DecodeOptions.logprobs


def initial_state(
    tokens: jax.Array,
    prompt_len: jax.Array,
    max_new: jax.Array,
    stop_ids: jax.Array,
    cache: KVCache,
    verifier_cache: KVCache | None,
    *,
    num_drafts: int,
    block_size: int,
    pad_id: int,
    record_steps: bool = False,
    sampling: RowSampling | None = None,
    draft_vocab: int = 0,
    logprobs: int | None = None,
) -> LoopState:
    """The loop state right after prefill: tokens [B, N] hold the prompts, whose last token is
    pending (its KV is written by the first step, which also predicts the first new token).
    `draft_vocab` > 0 carries lossless drafts' distributions (sampling); `logprobs` (not None)
    records each token's log-probability and that many alternatives."""
    b, n_slots = tokens.shape
    zeros = jnp.zeros((b,), jnp.int32)
    return LoopState(
        step=jnp.int32(0), tokens=tokens, length=prompt_len, prompt_len=prompt_len,
        max_new=max_new, done=max_new <= 0, cache=cache, cache_len=prompt_len - 1,
        drafts=jnp.full((b, num_drafts), pad_id, jnp.int32), draft_len=zeros,
        verifier_cache=verifier_cache, verifier_cache_len=prompt_len, forwards=zeros,
        verifier_forwards=zeros, accept_hist=jnp.zeros((b, block_size + 1), jnp.int32),
        # every active step commits >= 1 token, so a row takes at most n_slots steps
        step_commits=jnp.zeros((b, n_slots), jnp.int32) if record_steps else None,
        stop_ids=stop_ids, sampling=sampling,
        draft_probs=jnp.zeros((b, num_drafts, draft_vocab), jnp.float32) if draft_vocab else None,
        logprobs=None if logprobs is None else Logprobs.zeros(b, n_slots, logprobs))


def commit(
    state: LoopState,
    block: jax.Array,
    n_commit: jax.Array,
    hist_value: jax.Array | None = None,
    logits: jax.Array | None = None,
) -> tuple[LoopState, jax.Array]:
    """Append the first n_commit[b] tokens of block[b] to each active row.

    Truncates at the first stop token (EOS or the row's stop_token_ids; kept), at the row's
    max_new budget and at the buffer end, and marks rows done. Returns the new state and the
    number of tokens actually committed [B]. accept_hist counts the step under `hist_value[b]`,
    or under the tokens committed when None. `logits` [B, W, V], the distributions the block
    was committed from, feed the logprobs when they are recorded.
    """
    width = block.shape[1]
    n_slots = state.tokens.shape[1]
    active = ~state.done
    idx = jnp.arange(width)[None, :]
    is_eos = jnp.any(block[:, :, None] == state.stop_ids[:, None, :], axis=-1) & (
        idx < n_commit[:, None]
    )
    has_eos = jnp.any(is_eos, axis=1)
    n = jnp.where(has_eos, jnp.argmax(is_eos, axis=1) + 1, n_commit)
    budget = state.max_new - (state.length - state.prompt_len)
    n = jnp.minimum(jnp.minimum(n, budget), n_slots - state.length)
    n = jnp.where(active, jnp.maximum(n, 0), 0)

    slots = state.length[:, None] + idx
    slots = jnp.where(idx < n[:, None], slots, n_slots)  # out of range -> dropped
    tokens = write_rows(state.tokens, slots, block)
    length = state.length + n
    eos_hit = has_eos & (jnp.argmax(is_eos, axis=1) < n)
    done = state.done | (active & (eos_hit | (length - state.prompt_len >= state.max_new)
                                   | (length >= n_slots)))
    step_commits = state.step_commits
    if step_commits is not None:  # column = this row's forward index; inactive rows dropped
        col = jnp.where(active, state.forwards, step_commits.shape[1])
        step_commits = write_rows(step_commits, col, n)
    logprobs = state.logprobs
    if logprobs is not None:
        logprobs = logprobs.write(slots, block, logits)
    k1 = state.accept_hist.shape[1]
    hist_value = n if hist_value is None else hist_value
    hist = state.accept_hist + (active[:, None] & (jnp.arange(k1)[None, :] == hist_value[:, None]))
    new = state.replace(tokens=tokens, length=length, done=done,
                        forwards=state.forwards + active, accept_hist=hist.astype(jnp.int32),
                        step_commits=step_commits, logprobs=logprobs)
    return new, n
