"""One decoding step per mode, as pure functions of (models, LoopState) -> LoopState.

`ar`, `threshold` and `verify` share the proposer step `propose_block`: a row feeds its
pending committed tokens plus K-1 masks and gets a block D of K tokens whose first token is
exact greedy AR. `lossless` has its own layout (see layouts.LosslessLayout). Every step takes
the `KernelOptions` its forwards run with (DecodeOptions.kernels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prove_jax.decoding.layouts import LosslessLayout, propose_layout
from prove_jax.decoding.state import LoopState, commit
from prove_jax.models.attention import StepMask, causal_mask
from prove_jax.models.kernels import DEFAULT_KERNELS, KernelOptions
from prove_jax.models.tokens import greedy_tokens, readable_tokens


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, T, ...], idx [B, J] -> [B, J, ...]."""
    return jax.vmap(lambda xb, ib: xb[ib])(x, idx)


def _logits_at(model, hidden: jax.Array, idx: jax.Array, kernels: KernelOptions) -> jax.Array:
    """LM head only where logits are needed: hidden [B, T, D], idx [B, J] -> [B, J, V]."""
    return model.logits(_gather_rows(hidden, idx), kernels=kernels)


def propose_block(model, state: LoopState, block_size: int, mask_id: int,
                  kernels: KernelOptions = DEFAULT_KERNELS):
    """Proposer forward over [pending, MASK x (K-1)]. Returns (D [B,K], logits [B,K,V], cache)."""
    width, intra_fn = propose_layout(block_size)
    n_slots = state.tokens.shape[1]
    n_pending = state.length - state.cache_len  # [B], 1..K
    idx = jnp.arange(width)[None, :]
    slots = state.cache_len[:, None] + idx
    pending = jnp.take_along_axis(state.tokens, jnp.clip(slots, 0, n_slots - 1), axis=1)
    tokens = jnp.where(idx < n_pending[:, None], pending, mask_id).astype(jnp.int32)
    hidden, cache = model.hidden_states(tokens, slots, StepMask(state.cache_len, intra_fn(n_pending)),
                                        state.cache, kernels=kernels)
    block_slots = n_pending[:, None] - 1 + jnp.arange(block_size)[None, :]
    logits = _logits_at(model, hidden, block_slots, kernels)
    return greedy_tokens(logits), logits, cache


def confidence(logits: jax.Array, kind: str) -> jax.Array:
    """Per-token confidence statistic [B, K]: the top-1 probability (`prob`), top-1 minus top-2
    probability (`margin`), or the entropy of the distribution in nats (`entropy`)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    if kind == "prob":
        return jnp.exp(jnp.max(logp, axis=-1))
    if kind == "entropy":
        return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    if kind == "margin":
        top2 = jax.lax.top_k(logp, 2)[0]
        return jnp.exp(top2[..., 0]) - jnp.exp(top2[..., 1])
    raise ValueError(f"unknown confidence {kind!r}")


def confident(logits: jax.Array, kind: str, tau: float) -> jax.Array:
    """bool [B, K]: the token passes tau; `prob` and `margin` need at least tau, `entropy` (a
    sure distribution has little) at most tau nats."""
    conf = confidence(logits, kind)
    return conf <= tau if kind == "entropy" else conf >= tau


def leading_true(accept: jax.Array) -> jax.Array:
    """Length of the all-True prefix along the last axis, [B, J] -> [B]."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1)


def threshold_step(model, state, eos_ids, *, block_size, mask_id, tau, conf_kind,
                   kernels: KernelOptions = DEFAULT_KERNELS):
    block, logits, cache = propose_block(model, state, block_size, mask_id, kernels)
    if block_size > 1:
        n = 1 + leading_true(confident(logits[:, 1:], conf_kind, tau))
    else:
        n = jnp.ones(block.shape[0], jnp.int32)
    return _commit_proposal(state, cache, block, n, eos_ids)


def _commit_proposal(state, cache, block, n, eos_ids, verifier_cache=None, verified=False):
    """Commit the first n[b] tokens of each row's block. accept_hist counts steps by the tokens
    actually committed, after the cut at EOS or max_new_tokens, so that sum(i * hist[i]) is the
    tokens generated (the accepted length n would overcount the last step)."""
    n_pending = state.length - state.cache_len
    active = ~state.done
    state = state.replace(cache=cache, cache_len=state.cache_len + jnp.where(active, n_pending, 0))
    state, n_done = commit(state, block, n, eos_ids)  # the histogram counts n_done
    if verified:
        state = state.replace(verifier_cache=verifier_cache,
                              verifier_cache_len=state.verifier_cache_len + n_done,
                              verifier_forwards=state.verifier_forwards + active)
    return state


def verify_step(model, verifier, state, eos_ids, *, block_size, mask_id, rule, tau_v, head=None,
                head_threshold=None, kernels: KernelOptions = DEFAULT_KERNELS):
    """ProVe with a separate verifier: it reads D in one causal forward and picks l in [1, K]."""
    block, _, cache = propose_block(model, state, block_size, mask_id, kernels)
    k = block_size
    positions = state.length[:, None] + jnp.arange(k)[None, :]
    # a proposed token past the verifier's embedding rows is read as 0 and never accepted
    verifier_block, readable = readable_tokens(block, verifier.cfg.vocab_size)
    hidden, verifier_cache = verifier.hidden_states(
        verifier_block, positions, StepMask(state.verifier_cache_len, causal_mask(1, k)),
        state.verifier_cache, kernels=kernels)
    if k == 1:
        n = jnp.ones(block.shape[0], jnp.int32)
    else:
        verifier_logits = verifier.logits(hidden[:, :-1], kernels=kernels)  # logits at D_i judge D_{i+1}
        following = verifier_block[:, 1:]
        if rule == "top1":
            accept = greedy_tokens(verifier_logits) == following
        elif rule == "prob":
            logp = jax.nn.log_softmax(verifier_logits, axis=-1)
            accept = jnp.take_along_axis(logp, following[..., None], axis=-1)[..., 0] >= jnp.log(tau_v)
        elif rule == "head":
            accept = head.accept(hidden[:, :-1], verifier_logits, following, threshold=head_threshold)
        else:
            raise ValueError(f"unknown commit rule {rule!r}")
        n = 1 + leading_true(accept & readable[:, 1:])
    return _commit_proposal(state, cache, block, n, eos_ids, verifier_cache=verifier_cache, verified=True)


# A lossless step needs the LM head at 2M+1 of its T slots, known only after the first argmax:
# two passes read the head weights twice, one pass over all T slots computes the extra rows.
# One pass pays where the head is dear to read and the extra rows are few (benchmarks/step_cost.md).
HEAD_ONE_PASS_MAX_EXTRA_ROWS = 8


def head_in_one_pass(layout: LosslessLayout, batch: int, kernels: KernelOptions = DEFAULT_KERNELS) -> bool:
    """Whether `lossless_step` at this batch size runs the LM head once over all slots (above);
    `kernels.lm_head_one_pass=False` forces two passes."""
    extra_rows = batch * (layout.width - (2 * layout.num_drafts + 1))
    return kernels.lm_head_one_pass and extra_rows <= HEAD_ONE_PASS_MAX_EXTRA_ROWS


def lossless_step(model, state: LoopState, eos_ids, *, layout: LosslessLayout, mask_id: int,
                  kernels: KernelOptions = DEFAULT_KERNELS):
    """ProVe-lossless: verify last step's drafts and propose the next ones in one forward.

    Row = [t0, d_1..d_M, groups]; g_i = argmax at slot i-1 is exact greedy AR as long as
    d_1..d_{i-1} were accepted, so with a = the accepted prefix all of g_1..g_{a+1} are
    committed. The next drafts come from the group serving j = the largest length <= a: its
    masks saw t0, d_1..d_j, and mask r predicts the token at p0 + j + 2 + r. When j < a the
    first a - j of those are already committed, so the drafts are the group's predictions
    shifted by a - j; the vacated draft slots at the end repeat the last prediction (filler,
    which verification rejects or, when it is right, accepts), and `draft_len` records how
    many drafts are real so that the next step's top group serves exactly that many.
    (Committing only g_1..g_{j+1} would keep a full block of drafts, but loses the verified
    tokens; on the demo proposer it commits fewer tokens per forward everywhere.)
    """
    m = layout.num_drafts
    width = layout.width
    batch = state.tokens.shape[0]
    served = layout.served(state.draft_len)  # [B, G]
    t0 = jnp.take_along_axis(state.tokens, (state.length - 1)[:, None], axis=1)
    n_mask = width - 1 - m
    tokens = jnp.concatenate([t0, state.drafts, jnp.full((batch, n_mask), mask_id, jnp.int32)], axis=1)
    positions = (state.length - 1)[:, None] + layout.offsets(served)
    hidden, cache = model.hidden_states(tokens, positions, StepMask(state.cache_len, layout.intra_mask(served)),
                                        state.cache, kernels=kernels)

    one_pass = head_in_one_pass(layout, batch, kernels)
    if one_pass:  # every slot's argmax from one read of the LM head
        top = greedy_tokens(model.logits(hidden, kernels=kernels))  # [B, T]
        greedy = top[:, : m + 1]
    else:
        greedy = greedy_tokens(model.logits(hidden[:, : m + 1], kernels=kernels))
    # greedy [B, M+1] = g_1..g_{M+1}
    accepted = leading_true(state.drafts == greedy[:, :m])  # [B] in 0..M
    group = jnp.sum(served <= accepted[:, None], axis=1) - 1  # largest served length <= a (group 0 serves 0)
    shift = accepted - jnp.take_along_axis(served, group[:, None], axis=1)[:, 0]
    prediction = jnp.minimum(shift[:, None] + jnp.arange(m)[None, :], m - 1)
    draft_slots = layout.group_start(group)[:, None] + prediction  # [B, M]
    if one_pass:
        drafts = jnp.take_along_axis(top, draft_slots, axis=1)
    else:
        drafts = greedy_tokens(_logits_at(model, hidden, draft_slots, kernels))

    active = ~state.done
    state = state.replace(cache=cache, drafts=jnp.where(active[:, None], drafts, state.drafts),
                          draft_len=jnp.where(active, m - shift, state.draft_len))
    state, _ = commit(state, greedy, accepted + 1, eos_ids, hist_value=accepted)
    # t0 and d_1..d_{n-1} now have valid KV; the last committed token is the new pending t0.
    return state.replace(cache_len=state.length - 1)
