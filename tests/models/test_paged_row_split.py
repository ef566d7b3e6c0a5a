"""A paged pair whose verifier's kv heads the tensor axis cannot split (a 3B verifier's 2 over
tensor=8 on v6e-8): the verifier keeps a contiguous cache split over rows beside the proposer's
pool (`paged.pooled`), so no step gathers its KV. Its pool lay whole on every tensor device,
and the paged v6e-8 verify step all-gathered it (benchmarks/decode_step_cost.md).

On 8 simulated CPU devices as data=2 x tensor=4, with a 4-head proposer and a 2-head verifier:
paged verify, streamed with an admission between chunks, equals contiguous verify on one device
token for token, and the compiled decode step gathers neither cache. The one-call program's
admission inside its loop (`queue.put_row`) is checked on the caches directly: compiling that
program on the mesh costs more than the rest of this file.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from prove_jax.decoding import DecodeOptions, Decoder, ComputeOptions, queue, MemoryLayout
from prove_jax.decoding.state import initial_state
from prove_jax.models import paged, sharding
from prove_jax.models.attention import KVCache
from prove_jax.models.config import ModelConfig
from prove_jax.models.paged import PagedKVCache
from prove_jax.models.params import create_model
from tests.decoding.test_inference_mesh import GATHERS, admissions, collectives

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=8,
                  num_kv_heads=4, head_dim=8, mask_token_id=95, eos_token_ids=(1,))
VERIFIER = CFG.replace(num_heads=4, num_kv_heads=2, mask_token_id=None)
ROWS = 8  # data 2 x tensor 4: one row per device once the verifier's cache splits over rows
PROMPTS = [np.random.RandomState(1).randint(2, 90, n).tolist() for n in (3, 9, 1, 14, 5, 7, 2, 11)]
NEW = 6


def _on(mesh, model):
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))


@pytest.fixture(scope="module")
def setup():
    mesh = sharding.make_mesh((2, 1, 4))
    model, verifier = create_model(CFG, seed=3), create_model(VERIFIER, seed=4)
    options = DecodeOptions("verify", 4, compute=ComputeOptions(matmul_form="plain"), memory=MemoryLayout(scan_layers=True))
    # one request per row: the reference program holds no admission (it compiles in half the time)
    want = Decoder(model, [1], options, verifier=verifier).generate(PROMPTS, NEW).output_ids
    decoder = Decoder(_on(mesh, model), [1], dataclasses.replace(options, memory=dataclasses.replace(options.memory, page_size=8, kv_pages=64)),
                      verifier=_on(mesh, verifier), mesh=mesh)
    return mesh, decoder, want


def test_the_pooled_rule_follows_the_row_split(setup):
    mesh = setup[0]
    assert paged.pooled(CFG, ROWS, mesh=mesh)  # tensor=4 splits 4 heads
    assert not paged.pooled(VERIFIER, ROWS, mesh=mesh)  # 2 heads: over rows instead
    assert paged.pooled(VERIFIER, 6, mesh=mesh)  # 6 rows do not split 8 ways: a pool


def test_a_row_split_verifier_beside_the_pool_decodes_as_one_device_and_gathers_nothing(setup):
    mesh, decoder, want = setup
    got = {}
    # a ninth request (the fourth again, the longest), admitted when a row finishes
    for event in decoder.stream(PROMPTS + PROMPTS[3:4], NEW, batch_size=ROWS):
        if event.output is not None:
            got[event.index] = event.output.output_ids
    assert [got[i] for i in range(len(PROMPTS) + 1)] == want + want[3:4]

    (compiled,) = [c for _, c in decoder.programs("chunk")]
    state = compiled.output_shardings
    assert isinstance(state.cache, PagedKVCache) and isinstance(state.verifier_cache, KVCache)
    # the proposer's pool: each data shard's, its kv heads over tensor; the verifier's cache:
    # rows over data x tensor
    assert tuple(state.cache.k.spec)[:2] in ((("data",), "tensor"), ("data", "tensor")), state.cache.k.spec
    assert all(s.spec == P(("data", "tensor")) for s in jax.tree.leaves(state.verifier_cache))
    found = collectives(compiled.as_text())
    assert not [c for c in found if c[0] in ("all-gather", "reduce-scatter")], found
    # what crosses devices besides all-reduces: the verifier's queries and outputs moving to its
    # rows (two all-to-alls of the scanned layer), each no bigger than the step's activations
    moved = [c for c in found if c[0] == "all-to-all"]
    assert len(moved) == 2, found
    assert all(np.prod(shape) <= ROWS * 8 * VERIFIER.num_heads * CFG.head_dim for _, _, shape in moved), moved
    # admission (8 requests in 8 blocks, the verifier's split; the one here in one per data
    # shard) moves nothing between devices, not even the page allocator's int32 free lists
    # (taken and given back per shard: paged.PagedKVCache.allocate, release)
    assert decoder.admission_shards(ROWS) == 8
    for _, hlo in admissions(decoder):
        gathered = [c for c in collectives(hlo) if c[0] in GATHERS]
        assert not gathered, gathered


def test_an_admission_inside_the_loop_puts_the_row_into_the_contiguous_verifier_cache():
    """`queue.put_row` (the one-call program's admission) and `queue.release_done` with a
    contiguous verifier cache beside the pool: the admitted row's verifier KV lands at its row,
    the other rows' stay, the pool takes the row's page table, and releasing pages leaves the
    verifier's cache alone."""
    rows, slots, page = 4, 8, 4

    def filled(n, k, v):
        cache = KVCache.zeros(VERIFIER, n, slots)
        return cache.replace(k=tuple(x + k for x in cache.k), v=tuple(x + v for x in cache.v))

    def state(pool, verifier, n):
        ones = jnp.ones((n,), jnp.int32)
        return initial_state(jnp.zeros((n, slots), jnp.int32), ones, ones, jnp.zeros((n, 1), jnp.int32), pool,
                             verifier, num_drafts=2, block_size=2, pad_id=0)

    @jax.jit  # one program, not an eager op at a time
    def admit():
        pool = PagedKVCache.zeros(CFG, rows, slots // page, 16, page).allocate(jnp.ones((rows,), jnp.int32))
        batch = state(pool, filled(rows, 1, 2), rows).replace(done=jnp.array([False, False, True, False]))
        batch = queue.release_done(batch)  # row 2's page is free again
        home = batch.cache.row_homes()[2][None]
        admitted = state(batch.cache.allocate(jnp.array([2], jnp.int32), home), filled(1, 5, 6), 1)
        return filled(rows, 1, 2), batch, queue.put_row(batch, admitted, jnp.int32(2))

    cache, batch, put = admit()
    assert int(batch.cache.free_pages()[0]) == 16 - 3
    assert all((a == b).all() for a, b in zip(jax.tree.leaves(batch.verifier_cache), jax.tree.leaves(cache)))
    for got, old, new in ((put.verifier_cache.k[0], cache.k[0], 5), (put.verifier_cache.v[0], cache.v[0], 6)):
        assert got.shape == old.shape
        np.testing.assert_array_equal(got[2], jnp.full(got.shape[1:], new, got.dtype))
        np.testing.assert_array_equal(np.delete(np.asarray(got), 2, 0), np.delete(np.asarray(old), 2, 0))
    assert (put.cache.table[2] < 16).sum() == 2 and int(put.cache.free_pages()[0]) == 16 - 5
