"""The commit head's training examples (training/commit_head_training.py): the verifier's state
at D_i judges D_{i+1} as in decoding (docs/method.md 3d), checked against plain causal forwards;
the predicted length; where a context may end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prove_jax.models import params as params_lib
from prove_jax.models.config import ModelConfig


HEAD_CFG = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mask_token_id=299, eos_token_ids=(0,), pad_token_id=0)


def test_verifier_inputs_are_the_verifiers_ar_view_of_each_next_token():
    """docs/method.md 3d: the verifier reads [context, D] causally and its logits at D_i judge D_{i+1}
    (decoding/mode_steps.py feeds the head hidden[:, :-1], i.e. D_0..D_{K-2}). Oracle: a plain causal
    forward over [context, D], whose position of D_i sees exactly context + D_0..D_i."""
    from prove_jax.training.commit_head_training import verifier_inputs
    from prove_jax.models.attention import causal_mask
    verifier = params_lib.create_model(HEAD_CFG.replace(hidden_size=16, num_heads=2, num_kv_heads=1), seed=12)
    rng = np.random.default_rng(3)
    context = jnp.asarray(rng.integers(5, 290, size=(2, 6)), jnp.int32)
    block = jnp.asarray(rng.integers(5, 290, size=(2, 4)), jnp.int32)

    @nnx.jit
    def both(verifier, context, block):
        x = jnp.concatenate([context, block], axis=1)
        b, n = x.shape
        full, _ = verifier(x, jnp.broadcast_to(jnp.arange(n), (b, n)), causal_mask(b, n))
        return verifier_inputs(verifier, context, block)[1], full

    verifier_logits, full = both(verifier, context, block)
    assert verifier_logits.shape == (2, 3, HEAD_CFG.vocab_size)
    for i in range(3):  # D_i sits at position 6 + i
        np.testing.assert_allclose(np.asarray(verifier_logits[:, i]), np.asarray(full[:, 6 + i]), atol=1e-5,
                                   err_msg=f"logits {i} are not the verifier's view after D_{i}")


def test_predicted_length_is_one_plus_the_accepted_prefix():
    from prove_jax.models.commit_head import predicted_length
    accept = jnp.asarray([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
    assert predicted_length(accept).tolist() == [3, 1, 5, 1]


def test_commit_head_is_trained_on_the_token_each_state_judges():
    """Decoding feeds the head (verifier state at D_i, next token D_{i+1}) = (hidden[:, :-1],
    block[:, 1:]) (decoding/mode_steps.py); training must show it the same pairs, and learn from
    those. Oracle: for each row's context (one full-length row, one left-padded), plain causal
    forwards: the proposer's block after [context, MASK x (K-1)], the verifier's hidden state at
    D_0..D_{K-2} of [context, D], and the proposer's greedy AR on [context, D] for the labels."""
    from prove_jax.training import commit_head_training as ch
    from prove_jax.models.attention import causal_mask
    from prove_jax.models.tokens import greedy_tokens
    proposer = params_lib.create_model(HEAD_CFG, seed=11)
    verifier = params_lib.create_model(HEAD_CFG.replace(hidden_size=16, num_heads=2, num_kv_heads=1), seed=12)
    k, context_len, mask_id = 4, 8, HEAD_CFG.mask_token_id
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(5, 290, size=(2, 12)), jnp.int32)
    loss_mask = jnp.asarray(np.arange(12)[None] >= np.array([[8], [3]]))  # cuts: 8 (full), 3..8
    valid = jnp.ones((2, 12), bool)
    key = jax.random.key(4)
    kw = dict(context_len=context_len, block_size=k, mask_id=mask_id)
    ex = nnx.jit(lambda p, v, *a: ch.head_examples(p, v, *a, **kw))(proposer, verifier, ids, loss_mask, valid, key)
    ctx, ctx_valid, used = ch.sample_contexts(ids, loss_mask, valid, context_len, key)
    assert np.asarray(used).all()

    @nnx.jit  # one compiled forward per length: op by op it took most of the test's time
    def forward(model, x):
        n = x.shape[1]
        hidden, _ = model.hidden_states(x, jnp.arange(n)[None], causal_mask(1, n))
        return hidden[0], model.logits(hidden)[0]

    def plain(model, tokens):
        return forward(model, jnp.asarray(tokens, jnp.int32)[None])

    for row in range(2):
        context = [int(t) for t, ok in zip(np.asarray(ctx[row]), np.asarray(ctx_valid[row])) if ok]
        c = len(context)
        _, logits = plain(proposer, context + [mask_id] * (k - 1))
        block = [int(t) for t in greedy_tokens(logits[c - 1:])]
        np.testing.assert_array_equal(np.asarray(ex.next_tokens[row]), block[1:],
                                      err_msg="the head must judge D_1..D_{K-1}, the block shifted by one")
        hidden, _ = plain(verifier, context + block)
        np.testing.assert_allclose(np.asarray(ex.hidden[row]), np.asarray(hidden[c: c + k - 1]),
                                   atol=1e-5, err_msg="the verifier state judging D_{i+1} is the one at D_i")
        _, ar_logits = plain(proposer, context + block)
        match = np.asarray(greedy_tokens(ar_logits[c: c + k - 1])) == np.asarray(block[1:])
        np.testing.assert_array_equal(np.asarray(ex.labels[row]), np.cumprod(match))

    # and the loss is the head's BCE on exactly those pairs
    head = ch.CommitHead(verifier.cfg.hidden_size, rngs=nnx.Rngs(0))
    loss, logits = ch.head_loss(head, ex)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(head(ex.hidden, ex.verifier_logits, ex.next_tokens)), atol=1e-6)
    p = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    y = np.asarray(ex.labels, np.float64)
    bce = -(y * np.log(p) + (1 - y) * np.log(1 - p))
    np.testing.assert_allclose(float(loss), bce.mean(), rtol=1e-5)


def test_a_context_may_end_at_any_trained_position_from_1_to_context_len():
    """commit_head.cut_points: a context is ids[:p] for a trained p in [1, context_len]."""
    from prove_jax.training.commit_head_training import sample_contexts
    context_len = 6
    ids = jnp.arange(1, 41, dtype=jnp.int32).reshape(4, 10)
    trained = np.zeros((4, 10), bool)
    trained[0, context_len] = True      # the longest context: the row's first 6 tokens
    trained[1, 0] = True                # position 0: nothing before it
    trained[2, context_len + 1] = True  # one past context_len: no room
    trained[3, 1] = True                # the shortest context: one token
    context, context_valid, used = sample_contexts(ids, jnp.asarray(trained), jnp.ones((4, 10), bool),
                                                   context_len, jax.random.key(0))
    assert used.tolist() == [True, False, False, True]
    assert context[0].tolist() == list(range(1, 7)) and bool(context_valid[0].all())
    assert int(context_valid[3].sum()) == 1 and int(context[3, -1]) == 31
