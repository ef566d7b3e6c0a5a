"""Incremental decoding with the static KVCache equals one full causal forward.

Rows have different prompt lengths, so every step writes at a different slot per row (the
`StepMask`'s cache_len) and sees only the slots that row has committed. Prompt padding is
written into the cache too and must be overwritten, never seen.
"""

import ast
import inspect
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prove_jax.models.config import ModelConfig
from prove_jax.models import attention
from prove_jax.models.attention import (CPU_SHORT_CHUNK_ROWS, GPU_CHUNKED_MIN_ROWS, KVCache, StepMask,
                                        cache_chunk, causal_mask)
from prove_jax.models.paged import PagedKVCache
from prove_jax.models.params import create_model

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


def test_short_chunks_only_for_a_large_batch_on_cpu(monkeypatch):
    """`cache_chunk`: 256-slot chunks at least, so a 385-slot buffer is one pass; on CPU from
    CPU_SHORT_CHUNK_ROWS rows up 128-slot ones (three of 129); at most 8 chunks either way;
    never shorter on an accelerator, where each chunk costs kernel launches per layer."""
    assert CPU_SHORT_CHUNK_ROWS == 16
    assert cache_chunk(385) == cache_chunk(385, rows=15) == 385
    assert cache_chunk(385, rows=16) == cache_chunk(385, rows=64) == 129
    assert cache_chunk(2049) == cache_chunk(2049, rows=16) == 257
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert cache_chunk(385, rows=16) == 385
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert cache_chunk(385, rows=16) == 385
    assert cache_chunk(4096, rows=1) == cache_chunk(4096, rows=64) == 512


def test_one_pass_below_a_batch_of_16_on_gpu(monkeypatch):
    """On a GPU each trip of the chunk loop is a host round trip per layer: below
    GPU_CHUNKED_MIN_ROWS rows per device a buffer of any length is read in one pass; from there
    up it is chunked as on a TPU."""
    assert GPU_CHUNKED_MIN_ROWS == 16
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert cache_chunk(4096) == cache_chunk(4096, rows=15) == 4096
    assert cache_chunk(4096, rows=16) == cache_chunk(4096, rows=64) == 512
    assert cache_chunk(2049, rows=16) == 257


def test_chunk_rule_counts_the_rows_of_one_device():
    """`sharding.rows_per_device`: under a mesh the batch is split over data x fsdp, unless it
    does not divide (then it is replicated); outside a mesh one device has every row."""
    from prove_jax.models.sharding import make_mesh, rows_per_device
    assert rows_per_device(16) == 16
    with jax.set_mesh(make_mesh((2, 2, 2))):
        assert rows_per_device(16) == 4
        assert rows_per_device(6) == 6
    with jax.set_mesh(make_mesh((1, 1, 8))):  # tensor parallel only: every device has every row
        assert rows_per_device(16) == 16


def test_long_buffer_read_in_chunks_matches_full_forward():
    """A long buffer is read chunk by chunk (701 slots: two chunks of 351, the second starting
    at 350 and overlapping the first by one slot). Rows of 600, 100 and 300 committed tokens:
    the longest spans both chunks, the shortest sees the second fully masked."""
    slots = 701
    assert cache_chunk(slots) == 351  # the chunked path, with an uneven tail
    model = create_model(CFG, seed=5)
    rng = np.random.RandomState(1)
    b, n = 3, 605
    tokens = rng.randint(1, CFG.vocab_size, (b, n)).astype(np.int32)
    full, _ = model(jnp.asarray(tokens), jnp.asarray(np.broadcast_to(np.arange(n, dtype=np.int32), (b, n))),
                    causal_mask(b, n))
    full = np.asarray(full)
    lengths = np.array([600, 100, 300])
    mask = StepMask(jnp.zeros(b, jnp.int32), jnp.asarray(
        np.tril(np.ones((600, 600), bool))[None] & (np.arange(600)[None, None, :] < lengths[:, None, None])))
    pos = jnp.asarray(np.broadcast_to(np.arange(600, dtype=np.int32), (b, 600)))
    _, cache = forward(model, jnp.asarray(tokens[:, :600]), pos, mask, KVCache.zeros(CFG, b, slots))
    for t in (1, 3):
        idx = lengths[:, None] + np.arange(t)[None]
        out, cache = forward(model, jnp.asarray(np.take_along_axis(tokens, idx, axis=1)),
                             jnp.asarray(idx, jnp.int32), step_mask(lengths, t), cache)
        want = np.take_along_axis(full, idx[:, :, None], axis=1)
        np.testing.assert_allclose(np.asarray(out), want, atol=TOL, rtol=0)
        lengths = lengths + t


def test_chunked_cache_attention_reads_only_as_far_as_the_longest_row():
    """Past the longest row no chunk is read: NaN there (never written KV would hold zeros; NaN
    shows a read) leaves every row finite, where one pass over the buffer turns NaN (a masked
    weight of 0 times NaN). A row's result is the same bit for bit whatever the other rows'
    lengths (chunks of masked slots change nothing), and equals one softmax over the row's
    committed slots and its own tokens."""
    rng = np.random.RandomState(2)
    b, t, kv, g, dh, slots = 2, 3, 2, 2, 8, 1024  # 4 chunks of 256
    q = jnp.asarray(rng.randn(b, t, kv, g, dh), jnp.float32)
    own = tuple(jnp.asarray(rng.randn(b, kv, t, dh), jnp.float32) for _ in range(2))
    intra = jnp.tril(jnp.ones((t, t), bool))[None]
    cache = [rng.randn(b, kv, slots, dh).astype(np.float32) for _ in range(2)]
    for c in cache:
        c[:, :, 512:] = np.nan
    cache = tuple(jnp.asarray(c) for c in cache)
    attend = jax.jit(attention._attend_cached)
    short = np.asarray(attend(q, own, intra, cache, jnp.asarray([100, 300], jnp.int32)))
    longer = np.asarray(attend(q, own, intra, cache, jnp.asarray([100, 500], jnp.int32)))
    assert np.isfinite(short).all() and np.isfinite(longer).all()
    np.testing.assert_array_equal(short[0], longer[0])
    def one_pass(cache, lengths):  # one softmax over the whole buffer and the own tokens
        committed = jnp.arange(slots)[None, :] < jnp.asarray(lengths)[:, None]
        return np.asarray(attention._attend(q, [(cache[0], cache[1], committed[:, None]), own + (intra,)]))
    assert np.isnan(one_pass(cache, [100, 500])).any()  # what reading the whole buffer gives
    want = one_pass(tuple(jnp.nan_to_num(c) for c in cache), [100, 500])
    np.testing.assert_allclose(longer, want, atol=1e-5, rtol=1e-5)


def test_every_layer_view_writes_and_reads_through_one_interface():
    """A per-layer buffer, a layer of the stacked buffer and a layer of the paged pools are one
    interface (`write`, `read`, `slots`, `page_size`, `rules`, `kernel_reads`, `kernel_cache`):
    the same step written at each row's own slots reads back the same, every other slot left
    as it was, and the attention layer's forward calls nothing else (it holds no test of the
    cache's type)."""
    b, slots, page, t = 3, 16, 4, 3
    rng = np.random.RandomState(1)
    new_k, new_v = (jnp.asarray(rng.standard_normal((b, CFG.num_kv_heads, t, CFG.head_dim)), jnp.float32)
                    for _ in range(2))
    start = jnp.asarray([0, 5, 13], jnp.int32)  # row 2's last slot runs past the buffer: dropped
    per_layer = KVCache.zeros(CFG, b, slots, dtype=jnp.float32)
    stacked = KVCache.zeros(CFG, b, slots, dtype=jnp.float32, stacked=True)
    pool = PagedKVCache.zeros(CFG, b, slots // page, b * slots // page, page, dtype=jnp.float32)
    pool = pool.allocate(jnp.full((b,), slots // page, jnp.int32))
    views = {"per-layer": per_layer.layer(1), "stacked": stacked.scanned_layer(stacked.k, stacked.v, jnp.int32(1), 2),
             "paged": pool.layer(1)}
    want = np.zeros((b, CFG.num_kv_heads, slots, CFG.head_dim), np.float32)
    for r in range(b):
        end = min(slots, int(start[r]) + t)
        want[r, :, int(start[r]):end] = np.asarray(new_k)[r, :, :end - int(start[r])]

    kinds = {}

    @jax.jit
    def write_and_read(views):  # one program for all: (all slots, the second chunk) per view
        written = {name: view.write(new_k, new_v, start) for name, view in views.items()}
        kinds.update({name: (type(w), w.kernel_cache() is not None) for name, w in written.items()})
        other = written["stacked"].replace(layer=jnp.int32(0)).read(0, slots)[0]  # the layer not written
        return {name: (w.read(0, slots)[0], w.read(page, page)[0]) for name, w in written.items()}, other

    read, other = write_and_read(views)
    for name, view in views.items():
        assert view.slots == slots and view.page_size in (1, page), name
        assert view.rules is attention.DEFAULT_RULES and view.kernel_reads, name
        assert kinds[name] == (type(view), True), name
        np.testing.assert_array_equal(np.asarray(read[name][0]), want, err_msg=name)
        np.testing.assert_array_equal(np.asarray(read[name][1]), want[:, :, page:2 * page], err_msg=name)
    assert not np.asarray(other).any()

    tree = ast.parse(textwrap.dedent(inspect.getsource(attention.Attention.__call__)))
    tests = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "isinstance"]
    assert not tests, [ast.unparse(n) for n in tests]
