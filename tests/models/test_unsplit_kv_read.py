"""A cache whose kv heads the tensor axis cannot split (a 3B verifier's 2 over tensor=8, at a
batch too small to split over rows) lies whole on every device while its queries split over
the heads. Its read is pinned whole: GSPMD then takes each device's head out of the slots a
chunk reads, not out of the whole stacked [B, K, L * S, Dh] buffer, which the chunk loop hoisted
and copied in every layer of every step (benchmarks/decode_step_cost.md). On 8 simulated CPU
devices as tensor=8; the read's result equals one device's.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from prove_jax.models import sharding
from prove_jax.models.attention import LayerKV, _attend_cached, cache_chunk
from prove_jax.models.sharding import DEFAULT_RULES, constrain, kv_rules

B, T, H, K, DH, L, S = 1, 5, 16, 2, 24, 3, 640  # S long enough to be read in chunks on CPU


def _steps(q, new_k, new_v, k, v, cache_len):
    """Each of L layers writes its step's keys and values into the stacked buffers and attends
    over its committed slots, as a scanned layer does."""
    q = constrain(q, ("batch", "sequence", "heads", "head_dim")).reshape(B, T, K, H // K, DH)
    intra = jnp.tril(jnp.ones((1, T, T), bool))

    def layer(carry, i):
        k, v, total = carry
        kv = LayerKV(k, v, i, L).write(new_k[i], new_v[i], cache_len)
        out = _attend_cached(q, (new_k[i], new_v[i]), intra, kv, cache_len, "cpu", kv.rules)
        return (kv.k, kv.v, total + out), None

    (k, v, total), _ = jax.lax.scan(layer, (k, v, jnp.zeros_like(q)), jnp.arange(L))
    return total, k, v


def test_an_unsplit_cache_is_read_a_chunk_at_a_time_not_sliced_whole_per_head():
    assert cache_chunk(S, rows=B, platform="cpu") < S  # the chunked read, as on TPU at 8k
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(B, T, H, DH), jnp.float32)
    new_k, new_v = (jnp.asarray(rng.randn(L, B, K, T, DH), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.randn(B, K, L * S, DH), jnp.float32) for _ in range(2))
    cache_len = jnp.array([S - 2 * T], jnp.int32)
    want = jax.jit(_steps)(q, new_k, new_v, k, v, cache_len)

    mesh = sharding.make_mesh((1, 1, 8))
    with jax.set_mesh(mesh):
        assert kv_rules(K, B) is DEFAULT_RULES  # one row: the heads lie whole on every device
        whole = NamedSharding(mesh, P())
        args = (jax.device_put(q, NamedSharding(mesh, P(None, None, "tensor"))),
                *(jax.device_put(x, whole) for x in (new_k, new_v, k, v, cache_len)))
        compiled = jax.jit(_steps).lower(*args).compile()
        got = compiled(*args)
    hlo = compiled.as_text()
    # one head of the whole stacked buffer, or of one layer's slots: what a device must not copy
    for slots in (L * S, S):
        found = re.findall(r"= f32\[1,1,{},{}\][^\n]*".format(slots, DH), hlo)
        assert not found, found[:2]
    # each chunk's slots of the device's head are read (the head and the slots sliced at once)
    assert re.search(r"= f32\[1,1,\d+,{}\]\S* dynamic-slice\(".format(DH), hlo)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
