"""Incremental decoding with the static KVCache equals one full causal forward.

Rows have different prompt lengths, so every step writes at a different slot per row (the
`StepMask`'s cache_len) and sees only the slots that row has committed. Prompt padding is
written into the cache too and must be overwritten, never seen.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from prove_jax.config import ModelConfig
from prove_jax.model import KVCache, StepMask, causal_mask
from prove_jax.params import create_model

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, rope_theta=10000.0, tie_word_embeddings=False)
TOL = 2e-5
PAD = 0


@nnx.jit
def forward(model, tokens, positions, mask, cache):
    return model(tokens, positions, mask, cache)


def step_mask(lengths_before, t):
    """Row r's T new tokens follow its lengths_before[r] committed ones, causal among themselves."""
    return StepMask(jnp.asarray(lengths_before, jnp.int32), jnp.tril(jnp.ones((t, t), bool))[None])


def test_prefill_then_steps_and_chunk_match_full_forward():
    model = create_model(CFG, seed=3)
    rng = np.random.RandomState(0)
    b, n, slots_total = 3, 16, 20
    tokens = rng.randint(1, CFG.vocab_size, (b, n)).astype(np.int32)
    prompt_len = np.array([5, 9, 7])

    positions = np.broadcast_to(np.arange(n, dtype=np.int32), (b, n))
    full, _ = model(jnp.asarray(tokens), jnp.asarray(positions), causal_mask(b, n))
    full = np.asarray(full)  # [B, N, V], the reference

    # prefill, right-padded to the longest prompt with PAD tokens (their KV lands in the cache)
    p = prompt_len.max()
    prompt = np.where(np.arange(p)[None] < prompt_len[:, None], tokens[:, :p], PAD).astype(np.int32)
    pos = np.broadcast_to(np.arange(p, dtype=np.int32), (b, p))
    prefill = step_mask(np.zeros(b, int), p)
    mask = StepMask(prefill.cache_len, prefill.intra & jnp.asarray(
        np.arange(p)[None, None, :] < prompt_len[:, None, None]))
    cache = KVCache.zeros(CFG, b, slots_total)
    logits, cache = forward(model, jnp.asarray(prompt), jnp.asarray(pos), mask, cache)
    logits = np.asarray(logits)
    for r in range(b):
        np.testing.assert_allclose(logits[r, :prompt_len[r]], full[r, :prompt_len[r]], atol=TOL, rtol=0)

    lengths = prompt_len.copy()

    def step(t):
        nonlocal cache, lengths
        idx = lengths[:, None] + np.arange(t)[None]  # [B, T] positions == slots
        chunk = np.take_along_axis(tokens, idx, axis=1)
        out, cache = forward(model, jnp.asarray(chunk), jnp.asarray(idx, jnp.int32),
                             step_mask(lengths, t), cache)
        want = np.take_along_axis(full, idx[:, :, None], axis=1)
        np.testing.assert_allclose(np.asarray(out), want, atol=TOL, rtol=0)
        lengths = lengths + t

    step(1)
    step(1)
    step(3)  # a multi-token chunk, causal inside the chunk
    step(1)  # reads the chunk's KV back from the cache
    assert lengths.tolist() == [11, 15, 13]


def test_write_past_buffer_end_is_dropped_not_clamped():
    """A slot beyond the buffer must not overwrite valid KV (dynamic_update_slice would clamp)."""
    model = create_model(CFG, seed=1)
    b, s = 1, 6
    tokens = jnp.asarray(np.arange(1, 7, dtype=np.int32)[None])
    pos = jnp.arange(6, dtype=jnp.int32)[None]
    cache = KVCache.zeros(CFG, b, s)
    _, cache = forward(model, tokens, pos, step_mask([0], 6), cache)
    before = [np.asarray(k) for k in cache.k]
    _, cache = forward(model, tokens[:, :2], pos[:, :2], step_mask([6], 2), cache)  # slots 6, 7
    for k0, k1 in zip(before, cache.k):
        np.testing.assert_array_equal(k0, np.asarray(k1))
