"""A paged KV pool: fixed-shape pages shared by every row, and a per-row page table.

A contiguous cache gives every row the call's longest prompt plus its budget of slots. The pool
instead holds `num_pages` pages of `page_size` slots per layer; a row owns the pages its own
prompt and budget need (`pages_needed`), taken when it is admitted (`allocate`) and given back
when it finishes (`release`), so rows reserve what they use and a queue of mixed lengths runs
in less memory (benchmarks/paged_kv.md).

Layout: per layer k, v [D, K, Pl, page, Dh]: one pool of Pl pages per data shard of the batch
(D = 1 without a mesh), so a row's pages lie on the devices that hold the row and no write or
read crosses them; within a shard, kv heads first (split over the tensor axis like the k/v
kernels, as JAX's TPU paged-attention kernel takes them). table [B, R] int32 maps row b's
logical page j (slots [j*page, (j+1)*page)) to a page of its shard's pool, Pl where it owns
none: a write there is dropped, a read there is masked (it lies past the row's committed slots).

A verifier's cache holds the same tokens as the proposer's, so its pool (pools of its own layer
and head shapes) shares the proposer pool's pages: the same table and free list
(`PagedKVCache.with_pages_of`), allocated and released together. Except where the tensor axis
cannot split the verifier's kv heads but can split its rows (`sharding.kv_rules`: a 3B
verifier's 2 heads over tensor=8): its pool would lie whole on every tensor device, and every
step gathered it there (benchmarks/decode_step_cost.md); such a verifier keeps a contiguous
cache split over rows beside the proposer's pool (`pooled`, docs/decoding.md says why). So
does one whose head dim is under 128 lanes on TPU (a 0.5B's 64): libtpu copied its whole pool
per layer per step between the scatter's layout and the kernel's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from prove_jax.models.compute import DEFAULT_COMPUTE, ComputeOptions
from prove_jax.models.config import ModelConfig
from prove_jax.models.sharding import DEFAULT_RULES, constrain, kv_rules, rows_per_device

# a pool: one per data shard, kv heads on tensor (as KV_CACHE_AXES); pages and slots whole
POOL_AXES = ("batch", "kv_heads", None, None, "head_dim")


def pool_axes(stacked: bool) -> tuple:
    """Logical axes of a pool: POOL_AXES, with "layers" after the kv heads when stacked."""
    return POOL_AXES[:2] + ("layers",) + POOL_AXES[2:] if stacked else POOL_AXES


def data_shards(rows: int) -> int:
    """How many ways the ambient mesh splits a batch of `rows` rows (1 without one)."""
    return rows // rows_per_device(rows)


def pooled(config: ModelConfig, rows: int, compute: ComputeOptions = DEFAULT_COMPUTE,
           mesh=None) -> bool:
    """Whether a verifier of `config` decoding `rows` rows keeps its KV in a paged pool on the
    proposer's pages (on `mesh`, default the ambient one): not where its cache splits over rows
    (`sharding.kv_rules`), nor where `compute` keeps heads that narrow out of a pool
    (`ComputeOptions.pools_kv`: a head dim under 128 lanes on TPU); it then keeps a contiguous
    one beside the pool."""
    return (kv_rules(config.num_kv_heads, rows, mesh) is DEFAULT_RULES
            and compute.pools_kv(config.head_dim))


def pages_needed(prompt_len: jax.Array, max_new: jax.Array, page_size: int) -> jax.Array:
    """Pages a request needs [R]: its committed tokens' slots, [0, prompt_len + max_new) (a
    step's slots past them are dropped writes: the step reads its own keys directly); none for
    a request with no budget (padding)."""
    pages = (prompt_len + max_new + page_size - 1) // page_size
    return jnp.where(max_new > 0, pages, 0).astype(jnp.int32)


def _homes(rows: int, shards: int, home: jax.Array | None = None) -> jax.Array:
    """The data shard of each of `rows` rows: `home` [rows] when given (a view's rows), else the
    batch's, split into `shards` contiguous blocks; clipped to the shards."""
    if home is None:
        return jnp.arange(rows, dtype=jnp.int32) // max(1, rows // shards)
    return jnp.clip(home, 0, shards - 1)


def _shard_rows(rows: int, shards: int, home: jax.Array | None) -> jax.Array | None:
    """bool [D, R]: which of `rows` rows each of the `shards` data shards' pools serves (`home`
    [R]: a view's rows, any shard's); None for the batch's own rows or an admission's blocks
    (home None, a whole number of rows per shard): shard d's are block d, split by a reshape,
    so each shard reads and writes its page lists where they lie."""
    if home is None and rows % shards == 0:
        return None
    homes = _homes(rows, shards, home)
    return homes[None, :] == jnp.arange(shards, dtype=jnp.int32)[:, None]


def first_fitting(need: jax.Array, pages_per_shard: int) -> jax.Array:
    """bool [B]: which of a batch's rows, needing `need` [B] pages each, fit their shards' empty
    pools when taken in order (a prefix: the queue admits in order)."""
    given = jnp.cumsum(need.reshape(data_shards(need.shape[0]), -1), axis=1)  # per shard's block
    return jnp.cumprod((given.reshape(-1) <= pages_per_shard).astype(jnp.int32)).astype(bool)


@struct.dataclass
class PagedKVCache:
    """The pools of every layer, the page table of the rows it serves and which pages are free.
    `home` [R] names each row's data shard in a cache of some admitted rows (a view made by
    `allocate` for their prefill); None for the batch's own rows (row r on shard r // (B/D))."""
    # per layer [D, K, Pl, page, Dh]; stacked [D, K, L, Pl, page, Dh]
    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array
    table: jax.Array  # [B, R] int32 page of the row's shard; Pl: none
    free: jax.Array  # [D, Pl] bool
    home: jax.Array | None = None

    @classmethod
    def zeros(cls, config: ModelConfig, rows: int, row_pages: int, num_pages: int, page_size: int,
              dtype=None, stacked: bool = False) -> "PagedKVCache":
        """An empty pool of `num_pages` in all (split evenly over the data shards of `rows`
        rows; the caller makes it divide) and rows owning no page; one array of every layer's
        pools for a scanned model (`stacked`), else one per layer."""
        dtype = jnp.dtype(config.dtype) if dtype is None else dtype
        shards = data_shards(rows)
        per_shard = num_pages // shards
        shape = (shards, config.num_kv_heads, per_shard, page_size, config.head_dim)
        if stacked:
            shape = shape[:2] + (config.num_layers,) + shape[2:]
            mk = lambda: constrain(jnp.zeros(shape, dtype), pool_axes(True))  # noqa: E731
        else:
            mk = lambda: tuple(constrain(jnp.zeros(shape, dtype), POOL_AXES)  # noqa: E731
                               for _ in range(config.num_layers))
        return cls(k=mk(), v=mk(), table=jnp.full((rows, row_pages), per_shard, jnp.int32),
                   free=jnp.ones((shards, per_shard), bool))

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @property
    def _first(self) -> jax.Array:
        return self.k if self.stacked else self.k[0]

    @property
    def shards(self) -> int:
        return self._first.shape[0]

    @property
    def pages_per_shard(self) -> int:
        return self._first.shape[-3]

    @property
    def page_size(self) -> int:
        return self._first.shape[-2]

    def row_homes(self) -> jax.Array:
        return _homes(self.table.shape[0], self.shards, self.home)

    def layer(self, i: int) -> "PagedKV":
        """Layer i's view of per-layer pools."""
        return PagedKV(self.k[i], self.v[i], self.table, self.home)

    def scanned_layer(self, k: jax.Array, v: jax.Array, index: jax.Array,
                      num_layers: int) -> "PagedKV":
        """Layer `index`'s view of the stacked pools k, v a layer scan carries (their layer axis
        says how many: `num_layers` is for the interface `KVCache.scanned_layer` shares)."""
        return PagedKV(k, v, self.table, self.home, index)

    def free_pages(self) -> jax.Array:
        """Free pages of each shard's pool [D]."""
        return jnp.sum(self.free.astype(jnp.int32), axis=1)

    def allocate(self, need: jax.Array, home: jax.Array | None = None) -> "PagedKVCache":
        """The pools with `need` [R] pages taken for each of R rows from the pool of its shard
        (`home` [R]; None: R rows in blocks, one per shard, as the batch's), the lowest free
        pages first, in row order: a cache of those R rows. The caller makes sure they fit
        (`first_fitting`, the queue's room check); a row past its shard's free pages owns none
        (P) at its logical pages past them. Each shard takes pages for its own rows where its
        pool lies (`_take_pages`, vmapped over the shards: indexed by shard, the free lists'
        int32 entries were all-gathered); a view's rows are masked to their home shard's."""
        d, row_pages = self.shards, self.table.shape[1]
        mine = _shard_rows(need.shape[0], d, home)
        needs = need.reshape(d, -1) if mine is None else jnp.where(mine, need[None], 0)
        take = jax.vmap(functools.partial(_take_pages, row_pages=row_pages))
        table, free = take(self.free, needs)
        # each row's pages are its shard's; elsewhere P, the largest entry
        table = table.reshape(-1, row_pages) if mine is None else jnp.min(table, axis=0)
        return self.replace(table=table, free=free, home=home)

    def with_pages_of(self, other: "PagedKVCache") -> "PagedKVCache":
        """These pools with `other`'s page table, free list and homes: a verifier's pool, whose
        rows hold the same tokens as the proposer's, owns the same pages of its own pools."""
        return self.replace(table=other.table, free=other.free, home=other.home)

    def release(self, rows: jax.Array) -> "PagedKVCache":
        """The pools with the pages of the rows marked in `rows` [R] (bool) free again, each
        given back to its shard's pool where it lies (as `allocate` takes them); those rows own
        none."""
        p, d = self.pages_per_shard, self.shards
        owned = jnp.where(rows[:, None], self.table, p)
        mine = _shard_rows(owned.shape[0], d, self.home)
        if mine is None:
            owned = owned.reshape(d, -1, owned.shape[1])
        else:
            owned = jnp.where(mine[:, :, None], owned[None], p)
        free = jax.vmap(lambda f, o: f.at[o].set(True, mode="drop"))(self.free, owned)
        return self.replace(free=free, table=jnp.where(rows[:, None], p, self.table))

    def put_rows(self, part: "PagedKVCache", rows: jax.Array) -> "PagedKVCache":
        """This cache with `part`'s pools (written by the admitted rows' prefill) and its rows'
        tables at batch rows `rows` [R] (an index past the batch: dropped)."""
        return part.replace(table=self.table.at[rows].set(part.table, mode="drop"), home=self.home)


def _take_pages(free: jax.Array, need: jax.Array, row_pages: int):
    """One shard's pool: (table [r, row_pages], free [P]) with `need` [r] pages taken for each of
    its r rows from `free` [P] (bool), the lowest free pages first, in row order; past the free
    pages, P (none)."""
    p = free.shape[0]
    free_list = jnp.nonzero(free, size=p, fill_value=p)[0].astype(jnp.int32)  # then P's
    j = jnp.arange(row_pages, dtype=jnp.int32)[None, :]
    pick = (jnp.cumsum(need) - need)[:, None] + j  # the page's place in the free list
    table = jnp.where((j < need[:, None]) & (pick < p), free_list[jnp.minimum(pick, p - 1)], p)
    return table, free.at[table].set(False, mode="drop")


def _step_slots(pool, start, t: int, table):
    """(pool page, offset) [b, T] of each row's step slots start[b] + [0, T) through its table
    [b, R]; the page is P (past the pool: a dropped write) where the row owns none."""
    p, page, row_pages = pool.shape[-3], pool.shape[-2], table.shape[1]
    slots = start[:, None] + jnp.arange(t, dtype=start.dtype)[None, :]
    logical = slots // page
    owned = jnp.take_along_axis(table, jnp.minimum(logical, row_pages - 1), axis=1)
    return jnp.where(logical < row_pages, owned, p), slots % page


def _write_pool(pool, new, start, table, layer=None):
    """One shard's pool [K, P, page, Dh] (or layer `layer` of [K, L, P, page, Dh]) with row b's
    new[b] [K, T, Dh] at its slots start[b] + [0, T) through its table [b, R] (a page it does
    not own: dropped)."""
    b, k, t, _ = new.shape
    pages, offsets = _step_slots(pool, start, t, table)
    # one more, dropped entry: a single-token write stays a scatter (see attention.write_step)
    pages = jnp.append(pages.reshape(-1), pool.shape[-3])
    offsets = jnp.append(offsets.reshape(-1), 0)
    flat = new.transpose(1, 0, 2, 3).reshape(k, b * t, -1)
    flat = jnp.concatenate([flat, flat[:, :1]], axis=1).astype(pool.dtype)
    if layer is None:
        return pool.at[:, pages, offsets].set(flat, mode="drop")
    # every layer's pages as one axis, slot (layer * P + page) * page_size + offset: indexed by
    # (layer, page, offset), XLA:TPU gave the written pool a tiling its readers did not take and
    # copied the whole pool in every layer of every step (benchmarks/decode_step_cost.md); the
    # kv heads are the scatter's batching axis (vmapped), not part of its window, for the same
    # reason
    k, n_layers, p, size, dh = pool.shape
    # past the pool: dropped
    slot = jnp.where(pages < p, (layer * p + pages) * size + offsets, n_layers * p * size)
    write = jax.vmap(lambda head, values, at: head.at[at].set(values, mode="drop"))
    slots = jnp.broadcast_to(slot, (k,) + slot.shape)
    return write(pool.reshape(k, -1, dh), flat, slots).reshape(pool.shape)


def _read_pool(pool, table, first: jax.Array, count: int, layer=None):
    """Rows' logical pages [first, first + count) of one shard's pool (its layer `layer` when
    stacked), [b, K, count * page, Dh]."""
    pages = jax.lax.dynamic_slice_in_dim(table, first, count, axis=1)
    pages = jnp.minimum(pages, pool.shape[-3] - 1)
    if layer is None:
        x = pool[:, pages]  # [K, b, c, page, Dh]
    else:  # pages of every layer as one axis, as `_write_pool` writes them; gathered per (row,
        # kv head) into [b, K, c, page, Dh] as attention reads them (gathered [K, b, ...], the
        # pages were copied once more to put the rows first)
        k, n_layers, p = pool.shape[:3]
        flat = pool.reshape((k, n_layers * p) + pool.shape[3:])
        at = jnp.broadcast_to((layer * p + pages)[:, None], (pages.shape[0], k) + pages.shape[1:])
        # [b, K, c, page, Dh]
        x = jax.vmap(jax.vmap(lambda head, i: head[i]), in_axes=(None, 0))(flat, at)
        return x.reshape(pages.shape[0], k, -1, pool.shape[-1])
    return x.transpose(1, 0, 2, 3, 4).reshape(pages.shape[0], pool.shape[0], -1, pool.shape[-1])


@struct.dataclass
class PagedKV:
    """One layer's pools, the rows' page table (and `home`, as in `PagedKVCache`), as the
    attention layer sees them (the interface of every layer view: models/attention.py). The
    batch's own rows are written and read per shard (vmapped over the shards, each row on its
    shard's devices); a view's rows by explicit shard indices."""
    k: jax.Array  # [D, K, Pl, page, Dh]; with `layer`, every layer's [D, K, L, Pl, page, Dh]
    v: jax.Array
    table: jax.Array  # [B, R]
    home: jax.Array | None = None
    layer: jax.Array | None = None  # int32 scalar: this layer of stacked pools (a scanned model)

    @property
    def slots(self) -> int:
        """Logical slots of a row: its table's pages times the page size."""
        return self.table.shape[1] * self.page_size

    @property
    def page_size(self) -> int:
        return self.k.shape[-2]

    @property
    def pages_per_shard(self) -> int:
        return self.k.shape[-3]

    @property
    def rules(self):
        """Where the pools lie: each data shard's own, kv heads on tensor (never split over
        rows)."""
        return DEFAULT_RULES

    @property
    def kernel_reads(self) -> bool:
        """A kernel reads the batch's own rows, each on its shard; a view's rows (`home`) lie on
        any shard, so they are read in XLA."""
        return self._by_shard()

    def kernel_cache(self) -> "PagedKV":
        """What `attention_kernels.attend_cached` reads: the pools through the page table."""
        return self

    def _by_shard(self) -> bool:
        """The batch's own rows (a whole number per shard, as `data_shards` splits them)."""
        return self.home is None

    def _split(self, x: jax.Array) -> jax.Array:
        """[B, ...] -> [D, B/D, ...]: the rows of each shard."""
        return x.reshape((self.k.shape[0], -1) + x.shape[1:])

    def write(self, new_k: jax.Array, new_v: jax.Array, start: jax.Array) -> "PagedKV":
        """Row b's step keys and values new[b] [K, T, Dh] written at its slots start[b] + [0, T);
        a slot on a page the row does not own is dropped."""
        layer = self.layer
        if self._by_shard():
            table, start_d = self._split(self.table), self._split(start)

            def put(pool, new):
                write = jax.vmap(lambda p, n, s, t: _write_pool(p, n, s, t, layer))
                written = write(pool, self._split(new), start_d, table)
                return constrain(written, pool_axes(layer is not None))
        else:
            def put(pool, new):
                return _write_rows(pool, new, start, self.table, self._homes(), layer)
        return self.replace(k=put(self.k, new_k), v=put(self.v, new_v))

    def read(self, start: int | jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, K, size, Dh] of every row's logical slots [start, start + size),
        both whole pages (a page the row does not own reads as some page: mask it)."""
        first, count = start // self.page_size, size // self.page_size
        if self._by_shard():
            table = self._split(self.table)

            def take(pool):
                read = lambda shard, t: _read_pool(shard, t, first, count, self.layer)  # noqa: E731
                x = jax.vmap(read)(pool, table)
                return x.reshape((-1,) + x.shape[2:])
        else:
            def take(pool):
                pages = jnp.minimum(jax.lax.dynamic_slice_in_dim(self.table, first, count, axis=1),
                                    self.pages_per_shard - 1)
                homes = self._homes()[:, None]
                # [R, c, K, page, Dh]
                if self.layer is None:
                    x = pool[homes, :, pages]
                else:
                    x = pool[homes, :, self.layer, pages]
                return x.transpose(0, 2, 1, 3, 4).reshape(x.shape[0], x.shape[2], size, x.shape[-1])
        return take(self.k), take(self.v)

    def _homes(self) -> jax.Array:
        return _homes(self.table.shape[0], self.k.shape[0], self.home)


def _write_rows(pool, new, start, table, homes, layer=None):
    """All shards' pools [D, K, P, page, Dh] (or layer `layer` of [D, K, L, P, page, Dh]) with
    row r's new[r] [K, T, Dh] at its slots through its table [R, pages] on its shard homes[r]
    (a view's rows: indices explicit)."""
    r, _, t, _ = new.shape
    pages, offsets = _step_slots(pool, start, t, table)  # [R, T]
    shard = jnp.broadcast_to(homes[:, None], (r, t))
    values = new.transpose(0, 2, 1, 3).astype(pool.dtype)  # [R, T, K, Dh]
    if layer is None:
        return pool.at[shard, :, pages, offsets].set(values, mode="drop")
    return pool.at[shard, :, layer, pages, offsets].set(values, mode="drop")
