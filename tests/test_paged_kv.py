"""The paged KV pool (`DecodeOptions(page_size=..., kv_pages=...)`, models/paged.py).

Checked here: a forward through a pool whose pages lie shuffled gives the contiguous cache's
hidden states (one-pass and chunked reads, one-token and wide steps); pages are taken and given
back without overlap; decoding through a pool smaller than every row's worst case gives AR's
tokens in every mode, on the batch and the stream paths, with requests waiting for pages (the
loop serves one at a time when only one fits); the compiled program holds less memory; a tensor
mesh gathers nothing; and bad settings are one-line errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prove_jax.decoding import DecodeOptions, Decoder, KernelOptions
from prove_jax.decoding.options import DecodeError
from prove_jax.models import sharding
from prove_jax.models.attention import StepMask, causal_mask
from prove_jax.models.paged import PagedKVCache, pages_needed
from prove_jax.models.params import create_model
from tests.test_decode_in_place import CFG
from tests.test_inference_mesh import CFG as MESH_CFG, NEW, PROMPTS, collectives

# mixed lengths: the longest request needs 4x the pages of the shortest
LENGTHS = [3, 40, 5, 12, 70, 2, 9]
MODES = {
    "ar": DecodeOptions("ar"),
    "lossless": DecodeOptions("lossless", 4, max_groups=2),
    "verify": DecodeOptions("verify", 3),
}


def paged(options: DecodeOptions, page_size: int, kv_pages: int | None = None) -> DecodeOptions:
    return DecodeOptions(**{**options.__dict__, "page_size": page_size, "kv_pages": kv_pages})


@pytest.fixture(scope="module")
def models():
    return create_model(CFG, seed=0), create_model(CFG.replace(num_layers=1, mask_token_id=None), seed=1)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(0)
    return [rng.randint(2, 90, k).tolist() for k in LENGTHS]


@pytest.mark.parametrize("slots", [64, 1024], ids=["one-pass", "chunked"])
def test_a_shuffled_pool_reads_as_the_contiguous_cache(models, slots):
    """Prefill 3 rows of different lengths, then a wide step with a non-causal intra mask, both
    through a contiguous cache and through a pool whose pages are handed out in shuffled order:
    the hidden states are the same (the chunked read visits pages in chunks)."""
    model = models[0]
    rows, page = 3, 8
    lens = jnp.asarray([5, 37, 20], jnp.int32)
    rng = np.random.RandomState(1)
    tokens = jnp.asarray(rng.randint(2, 90, (rows, 40)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (rows, 40))
    prefill = StepMask(jnp.zeros(rows, jnp.int32), causal_mask(rows, 40) & (positions < lens[:, None])[:, None, :])
    pool = PagedKVCache.zeros(model.cfg, rows, slots // page, num_pages=rows * slots // page + 3, page_size=page)
    # every other page taken by no one, so the rows' pages are scattered over the pool
    pool = pool.replace(free=pool.free.at[jnp.asarray(rng.permutation(pool.num_pages)[: pool.num_pages // 2])].set(False))
    pool = pool.allocate(jnp.asarray([2, 6, 4], jnp.int32))
    assert len(set(np.asarray(pool.table)[np.asarray(pool.table) < pool.num_pages].tolist())) == 12
    forward = jax.jit(model.hidden_states)
    _, contiguous = forward(tokens, positions, prefill, model.new_cache(rows, slots))
    _, pool = forward(tokens, positions, prefill, pool)
    for width, intra in [(1, jnp.ones((1, 1, 1), bool)),
                         (5, jnp.asarray(rng.rand(rows, 5, 5) < 0.6) | jnp.eye(5, dtype=bool)[None])]:
        step = jnp.asarray(rng.randint(2, 90, (rows, width)), jnp.int32)
        at = lens[:, None] + jnp.arange(width)[None, :]
        mask = StepMask(lens, intra)
        want, new_contiguous = forward(step, at, mask, contiguous)
        got, new_pool = forward(step, at, mask, pool)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # the step's keys landed on the rows' own pages, where the contiguous cache has them
    k = new_pool.layer(0).read(0, slots)[0]
    for r, n in enumerate(np.asarray(lens) + 5):
        np.testing.assert_allclose(np.asarray(k[r, :, :n]), np.asarray(new_contiguous.k[0][r, :, :n]), atol=1e-6)


def test_pages_are_taken_without_overlap_and_given_back():
    cfg = CFG
    pool = PagedKVCache.zeros(cfg, 4, 6, num_pages=12, page_size=4)
    need = pages_needed(jnp.asarray([3, 9, 1, 5]), jnp.asarray([5, 6, 0, 2]), 4)
    assert need.tolist() == [2, 4, 0, 2]
    taken = pool.allocate(need)
    table = np.asarray(taken.table)
    owned = [row[row < 12].tolist() for row in table]
    assert [len(o) for o in owned] == need.tolist()
    flat = sum(owned, [])
    assert len(set(flat)) == len(flat) == 8 and int(taken.free_pages()) == 4
    assert not np.asarray(taken.free)[flat].any()
    back = taken.release(jnp.asarray([False, True, False, True]))
    assert int(back.free_pages()) == 4 + 6 and np.asarray(back.table)[[1, 3]].min() == 12
    assert np.asarray(back.table)[0].tolist() == table[0].tolist()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_decoding_through_a_small_pool_gives_ars_tokens(models, prompts, mode):
    """3 rows, 7 requests of 2 to 70 prompt tokens, a pool of 16 pages of 8 slots: the longest
    request needs 12 of them, so it decodes with at most one short one beside it. Lossless is
    AR token for token; ar and verify equal their contiguous programs."""
    proposer, verifier = models
    kwargs = dict(verifier=verifier) if mode == "verify" else {}
    want = Decoder(proposer, [1], MODES[mode], **kwargs).generate(prompts, 24, batch_size=3)
    decoder = Decoder(proposer, [1], paged(MODES[mode], 8, kv_pages=16), **kwargs)
    got = decoder.generate(prompts, 24, batch_size=3)
    assert got.output_ids == want.output_ids
    np.testing.assert_array_equal(got.forwards, want.forwards)
    if mode == "lossless":
        assert got.output_ids == Decoder(proposer, [1], MODES["ar"]).generate(prompts, 24).output_ids
    streamed = {}
    for event in decoder.stream(prompts, 24, batch_size=3, chunk_steps=3):
        if event.output is not None:
            streamed[event.index] = event.output.output_ids
    assert [streamed[i] for i in range(len(prompts))] == want.output_ids


def test_a_pool_that_holds_one_request_serves_them_one_at_a_time(models):
    """A pool of the longest request's pages, which no two requests fit together: every request
    still decodes, but one at a time, so the loop runs at least as many steps as all requests'
    forwards together (with the default pool, 3 rows decode side by side and it runs far fewer)."""
    options = paged(MODES["lossless"], 16)
    decoder = Decoder(models[0], [1], options)
    rng = np.random.RandomState(2)
    prompts = [rng.randint(2, 90, k).tolist() for k in (40, 70, 50, 60, 45)]
    need = max(decoder.pages_needed(len(p), 24) for p in prompts)
    one = Decoder(models[0], [1], paged(MODES["lossless"], 16, kv_pages=need)).generate(prompts, 24, batch_size=3)
    side_by_side = decoder.generate(prompts, 24, batch_size=3)
    assert one.output_ids == side_by_side.output_ids
    assert one.loop_steps >= int(one.forwards.sum())
    assert side_by_side.loop_steps < 0.6 * int(side_by_side.forwards.sum())


def test_the_pool_takes_less_memory_than_contiguous_rows(models, prompts):
    """Compiled for 3 rows at the 70-token prompt: the contiguous program holds 3 rows of the
    longest request's slots; a pool of 16 pages of 8 slots holds 128 slots in all."""
    contiguous = Decoder(models[0], [1], MODES["lossless"])
    pool = Decoder(models[0], [1], paged(MODES["lossless"], 8, kv_pages=16))

    def bytes_of(decoder):
        compiled = decoder.lower(prompts, 24, batch_size=3).compile()
        stats = compiled.memory_analysis()
        return stats.argument_size_in_bytes + stats.temp_size_in_bytes + stats.output_size_in_bytes

    cache_bytes = lambda slots: 2 * CFG.num_layers * CFG.num_kv_heads * slots * CFG.head_dim * 4  # noqa: E731
    saved = bytes_of(contiguous) - bytes_of(pool)
    # contiguous rows: 3 x (buffer 128 + step width 10) slots; the pool: 128 slots, less the
    # pages the XLA read gathers per layer as temporaries (one layer's rows at a time)
    assert saved >= 0.6 * (cache_bytes(3 * 138) - cache_bytes(128)), saved


def test_on_a_tensor_mesh_the_pool_is_split_over_kv_heads_and_nothing_is_gathered():
    model = create_model(MESH_CFG, seed=3)
    mesh = sharding.make_mesh((1, 1, 4))
    graphdef, state = nnx.split(model)
    on_mesh = nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))
    want = Decoder(model, [1], DecodeOptions("ar")).generate(PROMPTS, NEW).output_ids
    options = paged(DecodeOptions("lossless", 4, kernels=KernelOptions(matmul_form="plain")), 8, kv_pages=6)
    decoder = Decoder(on_mesh, [1], options, mesh=mesh)
    streamed = {}
    for event in decoder.stream(PROMPTS, NEW, batch_size=2):
        if event.output is not None:
            streamed[event.index] = event.output.output_ids
    assert [streamed[i] for i in range(len(PROMPTS))] == want
    (compiled,) = [c for key, c in decoder._stream_compiled.items() if key[0] == "chunk"]
    assert {op for op, _, _ in collectives(compiled.as_text())} <= {"all-reduce"}
    pool = compiled.output_shardings.cache.k[0]
    assert pool.spec[0] == "tensor"


def test_bad_paged_settings_are_one_line_errors(models, prompts):
    with pytest.raises(DecodeError, match="give a page size too"):
        DecodeOptions("ar", kv_pages=4).validate()
    with pytest.raises(DecodeError, match="page size must be"):
        DecodeOptions("ar", page_size=0).validate()
    with pytest.raises(DecodeError, match="drop --scan-layers"):
        DecodeOptions("ar", page_size=8, scan_layers=True).validate()
    with pytest.raises(DecodeError, match="--attention xla"):
        DecodeOptions("ar", page_size=8, kernels=KernelOptions(attention="pallas_gpu")).validate()
    decoder = Decoder(models[0], [1], paged(MODES["ar"], 8, kv_pages=4))
    with pytest.raises(DecodeError, match=r"^prompt 4 needs 12 KV pages of 8 slots \(70 prompt tokens \+ 24 new\), more than the pool.s 4: raise --kv-pages"):
        decoder.generate(prompts, 24)


def test_generate_takes_page_flags():
    from prove_jax.cli import generate
    options = generate.decode_options(generate.parse_args(
        ["--prompt", "x", "--mode", "lossless", "--page-size", "16", "--kv-pages", "64"]))
    assert (options.page_size, options.kv_pages) == (16, 64)
    with pytest.raises(DecodeError, match="^--page-size must be"):
        generate.decode_options(generate.parse_args(["--prompt", "x", "--page-size", "0"]))
