"""The paged pool's page allocator (`PagedKVCache.allocate`, `release`, `paged.first_fitting`)
against a plain-numpy oracle written here: random free lists, needs and home shards, the
batch's rows (one block per shard) and a view's rows (each homed on any shard).

The oracle: each shard hands out its free pages lowest first, in row order, to the rows homed
on it; a row past its shard's free pages owns none (P) at its logical pages past them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prove_jax.models import paged, sharding
from prove_jax.models.paged import PagedKVCache

PAGES, ROW_PAGES, TRIALS = 8, 5, 12


def empty_cache(shards: int, rows: int, free: np.ndarray) -> PagedKVCache:
    """A cache of `rows` rows owning nothing over `shards` pools whose free pages are `free`
    [D, P] (only the pools' leading shapes matter to the allocator)."""
    pool = jnp.zeros((shards, 1, PAGES, 1, 1), jnp.float32)
    return PagedKVCache(k=(pool,), v=(pool,), table=jnp.full((rows, ROW_PAGES), PAGES, jnp.int32),
                        free=jnp.asarray(free))


def oracle(free: np.ndarray, need: np.ndarray, homes: np.ndarray):
    """(table [R, ROW_PAGES], free [D, P]) as documented: a plain loop over the rows."""
    free = free.copy()
    table = np.full((len(need), ROW_PAGES), PAGES, np.int32)
    lists = [list(np.flatnonzero(f)) for f in free]
    for r, (n, d) in enumerate(zip(need, homes)):
        got, lists[d] = lists[d][:n], lists[d][n:]
        table[r, : len(got)] = got
        free[d, got] = False
    return table, free


def check(shards: int, rows: int, home_given: bool, seed: int):
    rng = np.random.RandomState(seed)
    # one program: the pages taken, then the marked rows' given back
    take_and_give_back = jax.jit(
        lambda c, n, h, done: (c.allocate(n, h), c.allocate(n, h).release(done)))
    for trial in range(TRIALS):
        # the first: every page free, so a shard asked for more than it holds runs out of pages
        free = rng.rand(shards, PAGES) < (rng.uniform(0.3, 1.0) if trial else 2)
        need = rng.randint(0, ROW_PAGES + 1, rows).astype(np.int32)
        home = rng.randint(0, shards, rows).astype(np.int32) if home_given else None
        homes = home if home_given else np.arange(rows) // (rows // shards)
        done = rng.rand(rows) < 0.5
        taken, back = take_and_give_back(
            empty_cache(shards, rows, free), jnp.asarray(need),
            None if home is None else jnp.asarray(home), jnp.asarray(done))
        table, left = np.asarray(taken.table), np.asarray(taken.free)
        want_table, want_free = oracle(free, need, homes)
        np.testing.assert_array_equal(table, want_table)
        np.testing.assert_array_equal(left, want_free)
        # what the oracle promises, said directly: distinct free pages of the row's own shard,
        # `need` of them where the shard has them
        for d in range(shards):
            owned = table[homes == d]
            pages = owned[owned < PAGES]
            assert len(set(pages.tolist())) == len(pages) and free[d, pages].all()
            assert not left[d, pages].any() and left[d].sum() == free[d].sum() - len(pages)
            if need[homes == d].sum() <= free[d].sum():
                assert ((owned < PAGES).sum(axis=1) == need[homes == d]).all()
        # release gives back exactly the released rows' pages, each to its own shard
        want = left.copy()
        for r in np.flatnonzero(done):
            want[homes[r], table[r][table[r] < PAGES]] = True
        np.testing.assert_array_equal(np.asarray(back.free), want)
        np.testing.assert_array_equal(np.asarray(back.table), np.where(done[:, None], PAGES, table))


@pytest.mark.parametrize("shards,rows,home_given", [(4, 8, False), (4, 5, True), (2, 1, True)],
                         ids=["batch-blocks", "view-rows", "one-admitted-row"])
def test_every_row_takes_its_own_shards_free_pages_and_gives_back_exactly_them(shards, rows,
                                                                                home_given):
    check(shards, rows, home_given, seed=shards * 10 + rows)


def test_the_first_rows_that_fit_their_shards_empty_pools():
    """A prefix of the batch: the rows up to the first whose shard's block, taken in order,
    needs more pages than a shard's pool has."""
    rng = np.random.RandomState(0)
    fitting = jax.jit(paged.first_fitting, static_argnums=1)
    with jax.set_mesh(sharding.make_mesh((4, 1, 1))):
        for _ in range(TRIALS):
            need = rng.randint(0, 5, 8).astype(np.int32)
            given = np.cumsum(need.reshape(4, 2), axis=1).reshape(-1)  # shard r // 2's block
            want = np.cumprod(given <= PAGES).astype(bool)
            got = np.asarray(fitting(jnp.asarray(need), PAGES))
            np.testing.assert_array_equal(got, want)
