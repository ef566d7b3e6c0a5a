"""Cached attention through shipped kernels (models/attention_kernels.py) against the XLA path.

The Pallas GPU decode kernel runs here in interpret mode (CPU); the oracle is the XLA path, which
tests/decoding/test_decoding.py checks against transformers, and greedy AR decoding token for token."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prove_jax.decoding import DecodeOptions, Decoder, ComputeOptions, LosslessRule, MemoryLayout
from prove_jax.models import attention, attention_kernels, sharding
from prove_jax.models.config import ModelConfig
from prove_jax.models.params import create_model
from prove_jax.models.sharding import make_mesh

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, mask_token_id=95, eos_token_ids=(1,))
GPU_INTERPRET = ComputeOptions(attention="pallas_gpu", interpret=True)
TPU_INTERPRET = ComputeOptions(attention="pallas_tpu", interpret=True)
KERNELS = [pytest.param(GPU_INTERPRET, id="pallas_gpu"), pytest.param(TPU_INTERPRET, id="pallas_tpu")]


def _inputs(b=3, t=3, k=2, g=2, s=64, dh=8, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (b, t, k, g, dh), jnp.float32)
    own = tuple(jax.random.normal(x, (b, k, t, dh), jnp.float32) for x in keys[1:3])
    cache = tuple(jax.random.normal(x, (b, k, s, dh), jnp.float32) for x in keys[3:5])
    return q, own, cache


@pytest.mark.parametrize("compute", KERNELS)
@pytest.mark.parametrize("slots,lens", [(64, (0, 17, 64 - 3)), (256, (200, 5, 129)), (48, (48, 1, 30)),
                                        (200, (0, 199, 130)), (75, (70, 3, 64))])
def test_kernel_matches_xla_on_ragged_rows(compute, slots, lens, monkeypatch):
    """Ragged rows, an empty row, buffers of whole kernel blocks and not (the GPU kernel's tail
    read in XLA; the TPU kernel's last block overhanging the buffer, in blocks of 64 here)."""
    if compute.attention == "pallas_tpu":
        if slots not in (256, 75):  # interpret mode is slow; these two cover its block edges
            pytest.skip("covered by the other buffer sizes")
        monkeypatch.setattr(attention_kernels, "BLOCK", 64)
    q, own, cache = _inputs(s=slots)
    cache_len = jnp.array(lens, jnp.int32)
    # a non-causal intra mask (as lossless steps use), one per row
    intra = jnp.array([[[1, 0, 1], [1, 1, 0], [0, 1, 1]],
                       [[1, 0, 0], [1, 1, 0], [1, 1, 1]],
                       [[1, 1, 1], [0, 1, 0], [1, 0, 1]]], bool)
    want = attention._attend_cached(q, own, intra, cache, cache_len)
    got = attention._attend_cached_kernel(q, own, intra, cache, cache_len, compute)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("compute", KERNELS)
def test_kernel_ignores_slots_past_each_rows_length(compute):
    q, own, (ck, cv) = _inputs(s=256)
    cache_len = jnp.array([10, 0, 33], jnp.int32)
    intra = jnp.tril(jnp.ones((1, 3, 3), bool))
    slot = jnp.arange(256)[None, None, :, None]
    junk = lambda c: jnp.where(slot >= cache_len[:, None, None, None], 1e4, c)
    a = attention._attend_cached_kernel(q, own, intra, (ck, cv), cache_len, compute)
    b = attention._attend_cached_kernel(q, own, intra, (junk(ck), junk(cv)), cache_len, compute)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("compute", KERNELS)
def test_kernel_runs_per_shard_under_a_mesh(compute):
    """Under a mesh (rows on data, kv heads on tensor) the kernel runs per shard (XLA cannot
    partition a Pallas call) and still matches the XLA path."""
    q, own, cache = _inputs(b=4, s=256)
    cache_len = jnp.array([0, 200, 31, 129], jnp.int32)
    intra = jnp.tril(jnp.ones((1, 3, 3), bool))
    want = attention._attend_cached(q, own, intra, cache, cache_len)
    with jax.set_mesh(make_mesh((2, 1, 2))):
        got = jax.jit(lambda *a: attention._attend_cached_kernel(*a, compute))(q, own, intra, cache, cache_len)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    # rows split over data x tensor, both heads on each device (sharding.kv_rules)
    with jax.set_mesh(make_mesh((2, 1, 2))):
        got = jax.jit(lambda *a: attention._attend_cached_kernel(*a, compute, sharding.ROW_SPLIT_RULES))(
            q, own, intra, cache, cache_len)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_kernel_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
        ComputeOptions(attention="flash")
    with pytest.raises(attention_kernels.AttentionKernelError, match="runs on gpu, not cpu"):
        attention_kernels.check_backend("pallas_gpu", interpret=False, backend="cpu")
    with pytest.raises(attention_kernels.AttentionKernelError, match="got 8"):
        attention_kernels.split_k(8)
    assert attention_kernels.split_k(8192) == (16, 128)
    assert attention_kernels.split_k(48) == (1, 16)
    with pytest.raises(attention_kernels.AttentionKernelError, match="runs on tpu, not cpu"):
        attention_kernels.check_backend("pallas_tpu", interpret=False, backend="cpu")


@pytest.mark.parametrize("compute", KERNELS)
def test_lossless_with_kernel_equals_ar(compute, monkeypatch):
    """Decoding through the kernel (interpret mode) is lossless: AR token for token, and AR
    through the kernel equals AR through XLA. A long prompt makes the buffer hold whole blocks of
    both kernels, so the kernel is called (counted)."""
    name = "_committed_gpu" if compute.attention == "pallas_gpu" else "_span_call"
    calls = []
    real = getattr(attention_kernels, name)
    monkeypatch.setattr(attention_kernels, name, lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    model = create_model(CFG, seed=3)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(2, 90, n).tolist() for n in (3, 140, 1)]
    ar = Decoder(model, [1], DecodeOptions("ar")).generate(prompts, 12)
    lossless = Decoder(model, [1], DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2), compute=compute)
                       ).generate(prompts, 12)
    assert calls
    assert lossless.output_ids == ar.output_ids
    if compute.attention == "pallas_gpu":  # the TPU kernel's AR reads are the scanned run's below
        ar_k = Decoder(model, [1], DecodeOptions("ar", compute=compute)).generate(prompts, 12)
        assert ar_k.output_ids == ar.output_ids
    if compute.attention != "pallas_tpu":  # the scan feeds both kernels the same way: one is enough
        return
    # with the layers scanned, the kernel reads each layer of the stacked cache in place (handed
    # the whole buffer: [B, K, Dh, L * S], slots minor, as a TPU holds a large one of a head dim
    # under 128 lanes; forced here, where the cache is small and this CPU holds it [.., L * S, Dh])
    calls.clear()
    minor = dataclasses.replace(compute, kv_slots_minor=True)
    scanned = Decoder(model, [1], DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2), compute=minor, memory=MemoryLayout(scan_layers=True))
                      ).generate(prompts, 12)
    assert CFG.head_dim < attention.LANES
    assert calls and all(shape[2] == CFG.head_dim and shape[3] % CFG.num_layers == 0
                         and shape[3] > 140 * CFG.num_layers for shape in calls)
    assert scanned.output_ids == ar.output_ids


def test_the_kernel_reads_only_kv_heads_the_mesh_splits_whole(monkeypatch):
    """A kernel runs per device on whole kv heads. Where the tensor axis cannot split them (2 kv
    heads over 4 devices, as a 3B verifier's 2 over a v6e-8 slice) and the rows are too few to
    split there instead, GSPMD splits the cache like the query heads and the kernel's call would
    gather the cache every step (benchmarks/paged_kv_pair.md): that layer reads through XLA.
    Where the heads split, or the rows do (the cache then lies split over rows), the kernel."""
    calls = []
    xla = attention._attend_cached
    monkeypatch.setattr(attention, "_attend_cached_kernel",
                        lambda q, own, intra, committed, start, compute, rules: calls.append(rules)
                        or xla(q, own, intra, committed, start))
    model = create_model(CFG, seed=3)
    for rows, shape, kernel in ((2, (2, 1, 2), True), (2, (1, 1, 4), False), (2, (4, 1, 1), True),
                                (4, (1, 1, 4), True)):
        tokens = jnp.zeros((rows, 3), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (rows, 3))
        mask = attention.StepMask(jnp.zeros((rows,), jnp.int32), attention.causal_mask(1, 3))
        calls.clear()
        with jax.set_mesh(make_mesh(shape)):
            jax.eval_shape(lambda c: model.hidden_states(tokens, positions, mask, c, compute=TPU_INTERPRET)[0],
                           model.new_cache(rows, 16))
        assert bool(calls) == kernel, (rows, shape)
        if rows == 4:  # each device's own row, both heads
            assert calls[0] is sharding.ROW_SPLIT_RULES


@pytest.mark.parametrize("slots_minor", [False, True], ids=["slots-then-dh", "slots-minor"])
def test_the_tpu_kernel_reads_a_stacked_layer_in_place(monkeypatch, slots_minor):
    """A stacked cache [B, K, L * S, Dh] (or [B, K, Dh, L * S], slots minor, as a head dim under
    128 lanes is held) is read at its layer through block indices, with blocks
    (16 slots here) that straddle the layers before and after and overhang the buffer's end:
    each layer's result is the XLA path's over that layer's slots, whatever the other layers
    hold (junk there), and the kernel is handed the whole buffer, not a slice of it."""
    monkeypatch.setattr(attention_kernels, "BLOCK", 16)
    layers, slots = 3, 75
    q, own, (ck, cv) = _inputs(s=layers * slots)
    cache_len = jnp.array([0, slots, 33], jnp.int32)
    intra = jnp.tril(jnp.ones((1, 3, 3), bool))
    seen = []
    real = attention_kernels._span_call
    monkeypatch.setattr(attention_kernels, "_span_call", lambda q, k, *a, **kw: seen.append(k.shape) or real(q, k, *a, **kw))
    read = jax.jit(lambda stacked: attention._attend_cached_kernel(q, own, intra, stacked, cache_len, TPU_INTERPRET))
    for layer in (1, 2):  # blocks straddling both neighbours; the last overhanging the buffer's end
        mine = (jnp.arange(layers * slots) // slots == layer)[None, None, :, None]
        junk = lambda c: jnp.where(mine, c, 1e4)  # noqa: E731
        held = (lambda c: jnp.swapaxes(junk(c), 2, 3)) if slots_minor else junk  # noqa: E731
        stacked = attention.LayerKV(held(ck), held(cv), jnp.int32(layer), num_layers=layers,
                                    slots_minor=slots_minor)
        part = lambda c: c[:, :, layer * slots:(layer + 1) * slots]  # noqa: E731
        want = attention._attend_cached(q, own, intra, (part(ck), part(cv)), cache_len)
        got = read(stacked)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
        # the XLA path reads the same layer of the buffer as held
        xla = attention._attend_cached(q, own, intra, stacked, cache_len)
        np.testing.assert_allclose(np.asarray(xla), np.asarray(want), rtol=2e-5, atol=2e-5)
    shape = (ck.shape[:2] + ck.shape[:1:-1]) if slots_minor else ck.shape
    assert seen and all(s == shape for s in seen)
    blocks, starts, counts = attention_kernels.contiguous_blocks(slots, layers, 1, cache_len, 16)
    assert counts.tolist() == [0, 6, 3]  # layer 1 is slots [75, 150): blocks 4..9 of 16
    assert blocks[1].tolist()[:6] == [4, 5, 6, 7, 8, 9] and starts[1, 0] == 64 - 75


def test_attention_auto_is_the_platforms_fast_path_resolved_on_the_host():
    """`--attention auto` (generate's default): the Pallas kernel on TPU, a dry run for a slice
    included, XLA elsewhere; resolved before any program traces it, which refuses it."""
    from prove_jax.cli import generate
    from prove_jax.decoding.dry_run import slice_options
    from prove_jax.models.compute import ComputeOptions as Kernels
    assert Kernels(attention="auto").resolve_attention("tpu").attention == "pallas_tpu"
    assert Kernels(attention="auto").resolve_attention("gpu").attention == "xla"
    assert Kernels(attention="auto").resolve("tpu").attention == "pallas_tpu"
    assert Kernels(attention="xla").resolve("tpu").attention == "xla"
    # generate's options keep "auto" until the Decoder is built (after a multi-host job joins)
    here = generate.decode_options(generate.parse_args(["--model", "m", "--prompt", "p"]))
    built = Decoder(create_model(CFG, seed=3), [1], here).options.compute.attention
    assert built == ("pallas_tpu" if jax.default_backend() == "tpu" else "xla")
    dry = generate.decode_options(generate.parse_args(["--dry-run", "v5p-8", "--model", "m", "--page-size", "64"]))
    assert slice_options(dry).compute.attention == "pallas_tpu"
    q, own, cache = _inputs()
    with pytest.raises(attention_kernels.AttentionKernelError, match="resolved on the host"):
        attention_kernels.attend_cached("auto", q[:, 0], None, own[1], cache, jnp.zeros(3, jnp.int32))


def test_the_tpu_kernel_reads_pages_a_few_at_a_time(monkeypatch):
    """A stacked paged pool [1, K, L, P, page, Dh] read at layer 1 through a shuffled page
    table, two pages of 8 slots a grid step (BLOCK 16 here): copied into a double buffer one
    step ahead, the pages past a row's length never copied; equal to the XLA path's read."""
    from prove_jax.models.paged import PagedKV
    monkeypatch.setattr(attention_kernels, "BLOCK", 16)
    layers, num_pages, page, row_pages = 2, 24, 8, 5
    q, own, _ = _inputs()
    pools = [jax.random.normal(jax.random.PRNGKey(i), (1, 2, layers, num_pages, page, 8)) for i in (7, 8)]
    table = jnp.asarray(np.random.RandomState(0).permutation(num_pages)[:3 * row_pages].reshape(3, row_pages), jnp.int32)
    cache_len = jnp.array([0, 37, 17], jnp.int32)
    intra = jnp.tril(jnp.ones((1, 3, 3), bool))
    pool = PagedKV(pools[0], pools[1], table, layer=jnp.int32(1))
    want = attention._attend_cached(q, own, intra, pool, cache_len)
    got = jax.jit(lambda p: attention._attend_cached_kernel(q, own, intra, p, cache_len, TPU_INTERPRET))(pool)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
