"""One decoding step per mode, as pure functions of (models, LoopState) -> LoopState.

`ar`, `threshold` and `verify` share the proposer step `propose_block`: a row feeds its
pending committed tokens plus K-1 masks and gets a block D of K tokens whose first token is
exact AR (greedy, or sampled from AR's distribution). `lossless` has its own layout (see
layouts.LosslessLayout). Every step takes the `ComputeOptions` its forwards run with
(DecodeOptions.compute) and, in a sampling program, the static `Sampler` (rows' parameters
are in state.sampling).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prove_jax.decoding import sampling
from prove_jax.decoding.layouts import LosslessLayout, propose_layout
from prove_jax.decoding.sampling import Sampler
from prove_jax.decoding.state import LoopState, commit
from prove_jax.models.attention import StepMask, causal_mask
from prove_jax.models.compute import DEFAULT_COMPUTE, ComputeOptions
from prove_jax.models.tokens import greedy_tokens, readable_tokens


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, T, ...], idx [B, J] -> [B, J, ...]."""
    return jax.vmap(lambda xb, ib: xb[ib])(x, idx)


def _logits_at(model, hidden: jax.Array, idx: jax.Array, compute: ComputeOptions) -> jax.Array:
    """LM head only where logits are needed: hidden [B, T, D], idx [B, J] -> [B, J, V]."""
    return model.logits(_gather_rows(hidden, idx), compute=compute)


def propose_block(model, state: LoopState, block_size: int, mask_id: int,
                  compute: ComputeOptions = DEFAULT_COMPUTE, sampler: Sampler | None = None):
    """Proposer forward over [pending, MASK x (K-1)]. Returns (D [B,K], logits [B,K,V], cache):
    D is each position's greedy token, or in a sampling program a draw from its distribution."""
    width, intra_fn = propose_layout(block_size)
    n_slots = state.tokens.shape[1]
    n_pending = state.length - state.cache_len  # [B], 1..K
    idx = jnp.arange(width)[None, :]
    slots = state.cache_len[:, None] + idx
    pending = jnp.take_along_axis(state.tokens, jnp.clip(slots, 0, n_slots - 1), axis=1)
    tokens = jnp.where(idx < n_pending[:, None], pending, mask_id).astype(jnp.int32)
    hidden, cache = model.hidden_states(
        tokens, slots, StepMask(state.cache_len, intra_fn(n_pending)), state.cache, compute=compute
    )
    block_slots = n_pending[:, None] - 1 + jnp.arange(block_size)[None, :]
    logits = _logits_at(model, hidden, block_slots, compute)
    if state.sampling is None:
        return greedy_tokens(logits), logits, cache
    block, _ = sampling.sample_tokens(
        logits, state.sampling, sampler, state.forwards, sampling.PROPOSE
    )
    return block, logits, cache


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


def threshold_step(model, state, *, block_size, mask_id, tau, conf_kind,
                   compute: ComputeOptions = DEFAULT_COMPUTE, sampler: Sampler | None = None):
    block, logits, cache = propose_block(model, state, block_size, mask_id, compute, sampler)
    if block_size > 1:
        n = 1 + leading_true(confident(logits[:, 1:], conf_kind, tau))
    else:
        n = jnp.ones(block.shape[0], jnp.int32)
    return _commit_proposal(state, cache, block, n, logits)


def _commit_proposal(state, cache, block, n, logits, verifier_cache=None, verified=False):
    """Commit the first n[b] tokens of each row's block. accept_hist counts steps by the tokens
    actually committed, after the cut at EOS or max_new_tokens, so that sum(i * hist[i]) is the
    tokens generated (the accepted length n would overcount the last step)."""
    n_pending = state.length - state.cache_len
    active = ~state.done
    state = state.replace(cache=cache, cache_len=state.cache_len + jnp.where(active, n_pending, 0))
    state, n_done = commit(state, block, n, logits=logits)  # the histogram counts n_done
    if verified:
        state = state.replace(verifier_cache=verifier_cache,
                              verifier_cache_len=state.verifier_cache_len + n_done,
                              verifier_forwards=state.verifier_forwards + active)
    return state


def verify_step(
    model,
    verifier,
    state,
    *,
    block_size,
    mask_id,
    rule,
    tau_v,
    head=None,
    head_threshold=None,
    compute: ComputeOptions = DEFAULT_COMPUTE,
    sampler: Sampler | None = None,
    gate: tuple[str, float] | None = None,
):
    """ProVe with a separate verifier: it reads D in one causal forward and picks l in [1, K].
    `gate` (confidence kind, tau): a draft is committed only if the proposer's own confidence
    in it passes tau too (the verifier's rule and the proposer's signal together)."""
    block, logits, cache = propose_block(model, state, block_size, mask_id, compute, sampler)
    k = block_size
    positions = state.length[:, None] + jnp.arange(k)[None, :]
    # a proposed token past the verifier's embedding rows is read as 0 and never accepted
    verifier_block, readable = readable_tokens(block, verifier.cfg.vocab_size)
    hidden, verifier_cache = verifier.hidden_states(
        verifier_block, positions, StepMask(state.verifier_cache_len, causal_mask(1, k)),
        state.verifier_cache, compute=compute)
    if k == 1:
        n = jnp.ones(block.shape[0], jnp.int32)
    else:
        # logits at D_i judge D_{i+1}
        verifier_logits = verifier.logits(hidden[:, :-1], compute=compute)
        following = verifier_block[:, 1:]
        if rule == "top1":
            accept = greedy_tokens(verifier_logits) == following
        elif rule == "prob":
            logp = jax.nn.log_softmax(verifier_logits, axis=-1)
            accept = jnp.take_along_axis(logp, following[..., None], axis=-1)[..., 0] >= jnp.log(
                tau_v
            )
        elif rule == "head":
            accept = head.accept(
                hidden[:, :-1], verifier_logits, following, threshold=head_threshold
            )
        else:
            raise ValueError(f"unknown commit rule {rule!r}")
        if gate is not None:  # logits at D_2..D_K: the proposer's distribution each was drawn from
            accept &= confident(logits[:, 1:], *gate)
        n = 1 + leading_true(accept & readable[:, 1:])
    return _commit_proposal(
        state, cache, block, n, logits, verifier_cache=verifier_cache, verified=True
    )


def head_in_one_pass(
    layout: LosslessLayout, batch: int, compute: ComputeOptions = DEFAULT_COMPUTE
) -> bool:
    """Whether `lossless_step` at this batch size runs the LM head once over all T slots, of
    which it needs 2M+1 (known only after the first argmax), or twice (reading the head twice):
    once while the extra rows are at most `compute.head_extra_rows()` (the platform's rule,
    `compute.HEAD_ONE_PASS_MAX_EXTRA_ROWS`); `compute.lm_head_one_pass=False` forces two."""
    extra_rows = batch * (layout.width - (2 * layout.num_drafts + 1))
    return compute.lm_head_one_pass and extra_rows <= compute.head_extra_rows()


def lossless_step(model, state: LoopState, *, layout: LosslessLayout, mask_id: int,
                  compute: ComputeOptions = DEFAULT_COMPUTE, sampler: Sampler | None = None,
                  relaxed_p: float | None = None):
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

    Sampling (state.sampling set): slot i-1 gives AR's distribution p_i and each draft was
    drawn from its mask's distribution q_i (kept in state.draft_probs; a filler slot draws
    afresh from the last mask's). `sampling.speculative_accept` accepts d_i with probability
    min(1, p_i/q_i) and draws the token after the accepted ones from the residual or p, so
    the committed tokens are distributed exactly as AR sampling's (docs/decoding.md).

    `relaxed_p` (greedy, lossy): d_i is also accepted where p_i(d_i) >= relaxed_p. Slot a still
    reads t0, d_1..d_a, so g_{a+1} stays AR's token after the committed prefix, and the
    acceptance only grows: never fewer tokens per step than exact lossless.
    """
    m = layout.num_drafts
    width = layout.width
    batch = state.tokens.shape[0]
    served = layout.served(state.draft_len)  # [B, G]
    t0 = jnp.take_along_axis(state.tokens, (state.length - 1)[:, None], axis=1)
    n_mask = width - 1 - m
    tokens = jnp.concatenate(
        [t0, state.drafts, jnp.full((batch, n_mask), mask_id, jnp.int32)], axis=1
    )
    positions = (state.length - 1)[:, None] + layout.offsets(served)
    hidden, cache = model.hidden_states(
        tokens,
        positions,
        StepMask(state.cache_len, layout.intra_mask(served)),
        state.cache,
        compute=compute,
    )

    rows = state.sampling
    # sampling needs whole distributions at the draft slots: the head runs twice
    one_pass = rows is None and head_in_one_pass(layout, batch, compute)
    if one_pass:  # every slot's argmax from one read of the LM head
        all_logits = model.logits(hidden, compute=compute)
        top = greedy_tokens(all_logits)  # [B, T]
        verify_logits, greedy = all_logits[:, : m + 1], top[:, : m + 1]
    else:
        verify_logits = model.logits(hidden[:, : m + 1], compute=compute)
        greedy = greedy_tokens(verify_logits)
    # greedy [B, M+1] = g_1..g_{M+1}
    if rows is None and relaxed_p is None:
        accepted = leading_true(state.drafts == greedy[:, :m])  # [B] in 0..M
        block = greedy
    elif rows is None:
        accepted, block = _accept_relaxed(state, verify_logits, greedy, relaxed_p)
    else:
        accepted, block = _accept_sampled(state, verify_logits, greedy, sampler)
    # largest served length <= a (group 0 serves 0)
    group = jnp.sum(served <= accepted[:, None], axis=1) - 1
    shift = accepted - jnp.take_along_axis(served, group[:, None], axis=1)[:, 0]
    prediction = jnp.minimum(shift[:, None] + jnp.arange(m)[None, :], m - 1)
    draft_slots = layout.group_start(group)[:, None] + prediction  # [B, M]
    draft_probs = state.draft_probs
    if one_pass:
        drafts = jnp.take_along_axis(top, draft_slots, axis=1)
    elif rows is None:
        drafts = greedy_tokens(_logits_at(model, hidden, draft_slots, compute))
    else:
        drafts, probs = sampling.sample_tokens(
            _logits_at(model, hidden, draft_slots, compute),
            rows,
            sampler,
            state.forwards,
            sampling.DRAFT,
        )
        draft_probs = jnp.where(~state.done[:, None, None], probs, draft_probs)

    active = ~state.done
    state = state.replace(
        cache=cache,
        drafts=jnp.where(active[:, None], drafts, state.drafts),
        draft_len=jnp.where(active, m - shift, state.draft_len),
        draft_probs=draft_probs,
    )
    state, _ = commit(state, block, accepted + 1, hist_value=accepted, logits=verify_logits)
    # t0 and d_1..d_{n-1} now have valid KV; the last committed token is the new pending t0.
    return state.replace(cache_len=state.length - 1)


def _accept_relaxed(
    state: LoopState, verify_logits: jax.Array, greedy: jax.Array, relaxed_p: float
):
    """(accepted drafts a [B], block [B, M+1] = d_1..d_a then g_{a+1}): a draft is accepted where
    it is AR's token or AR gives it probability >= relaxed_p; a row's first step has no drafts."""
    m = state.drafts.shape[1]
    logp = jax.nn.log_softmax(verify_logits[:, :m].astype(jnp.float32), axis=-1)
    p_draft = jnp.take_along_axis(logp, state.drafts[..., None], axis=-1)[..., 0]
    likely = (p_draft >= jnp.log(jnp.float32(relaxed_p))) & (state.forwards > 0)[:, None]
    accepted = leading_true((state.drafts == greedy[:, :m]) | likely)
    return accepted, _drafts_then(state.drafts, accepted, greedy)


def _drafts_then(drafts: jax.Array, accepted: jax.Array, after: jax.Array) -> jax.Array:
    """The committed block [B, M+1]: the accepted drafts d_1..d_a, then `after` (broadcast to
    [B, M+1]; only its entry at slot a is committed)."""
    m = drafts.shape[1]
    padded = jnp.concatenate([drafts, drafts[:, -1:]], axis=1)
    return jnp.where(jnp.arange(m + 1)[None, :] < accepted[:, None], padded, after)


def _accept_sampled(
    state: LoopState, verify_logits: jax.Array, greedy: jax.Array, sampler: Sampler
):
    """(accepted drafts a [B], block [B, M+1] = d_1..d_a then the drawn token) by speculative
    sampling; a row's first step has no drafts to judge. Greedy rows get exactly greedy's."""
    rows = state.sampling
    m = state.drafts.shape[1]
    p = sampling.token_probs(verify_logits, rows, sampler)
    u = sampling.uniforms(sampling.step_keys(rows.seed, state.forwards, sampling.ACCEPT, m))
    accepted, after = sampling.speculative_accept(
        p, state.draft_probs, state.drafts, u, valid=state.forwards > 0
    )
    keys = sampling.step_keys(rows.seed, state.forwards, sampling.CORRECT, 1)
    drawn = sampling.draw(keys, after[:, None])[:, 0]
    drawn = jnp.where(
        rows.temperature > 0, drawn, jnp.take_along_axis(greedy, accepted[:, None], axis=1)[:, 0]
    )
    return accepted, _drafts_then(state.drafts, accepted, drawn[:, None])
