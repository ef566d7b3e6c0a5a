"""A paged KV pool: fixed-shape pages shared by every row, and a per-row page table.

A contiguous cache gives every row the call's longest prompt plus its budget of slots. The pool
instead holds `num_pages` pages of `page_size` slots per layer; a row owns the pages its own
prompt and budget need (`pages_needed`), taken when it is admitted (`allocate`) and given back
when it finishes (`release`), so rows reserve what they use and a queue of mixed lengths runs
in less memory (benchmarks/paged_kv.md).

Layout: per layer k, v [K, P, page, Dh] (kv heads first, as JAX's TPU paged-attention kernel
takes them, and split over the tensor axis like the k/v kernels); table [B, R] int32 maps row
b's logical page j (slots [j*page, (j+1)*page)) to a pool page, `num_pages` where the row owns
none: a write there is dropped, a read there is masked (it lies past the row's committed slots).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from prove_jax.models.config import ModelConfig
from prove_jax.models.sharding import constrain

# one pool page: kv heads on tensor, like KV_CACHE_AXES; pages and slots whole on every device
POOL_AXES = ("kv_heads", None, None, "head_dim")


def pages_needed(prompt_len: jax.Array, max_new: jax.Array, page_size: int) -> jax.Array:
    """Pages a request needs [R]: its committed tokens' slots, [0, prompt_len + max_new) (a
    step's slots past them are dropped writes: the step reads its own keys directly); none for
    a request with no budget (padding)."""
    return jnp.where(max_new > 0, (prompt_len + max_new + page_size - 1) // page_size, 0).astype(jnp.int32)


@struct.dataclass
class PagedKVCache:
    """The pool of every layer, the page table of the rows it serves and which pages are free."""
    k: tuple[jax.Array, ...]  # per layer [K, P, page, Dh]
    v: tuple[jax.Array, ...]
    table: jax.Array  # [B, R] int32; num_pages: none
    free: jax.Array  # [P] bool

    @classmethod
    def zeros(cls, config: ModelConfig, rows: int, row_pages: int, num_pages: int, page_size: int,
              dtype=None) -> "PagedKVCache":
        """An empty pool (every page free) and rows owning no page."""
        dtype = jnp.dtype(config.dtype) if dtype is None else dtype
        shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
        mk = lambda: tuple(constrain(jnp.zeros(shape, dtype), POOL_AXES)  # noqa: E731
                           for _ in range(config.num_layers))
        return cls(k=mk(), v=mk(), table=jnp.full((rows, row_pages), num_pages, jnp.int32),
                   free=jnp.ones((num_pages,), bool))

    @property
    def stacked(self) -> bool:
        return False

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    def layer(self, i: int) -> "PagedKV":
        return PagedKV(self.k[i], self.v[i], self.table)

    def free_pages(self) -> jax.Array:
        return jnp.sum(self.free.astype(jnp.int32))

    def allocate(self, need: jax.Array) -> "PagedKVCache":
        """The pool with `need` [R] pages taken for each of R rows (the lowest free pages, in row
        order), as a cache of those R rows (table [R, row pages]). The caller makes sure they
        fit (sum(need) <= free_pages())."""
        p, row_pages = self.num_pages, self.table.shape[1]
        free_list = jnp.nonzero(self.free, size=p, fill_value=p)[0].astype(jnp.int32)  # [P]
        first = jnp.cumsum(need) - need  # [R]
        j = jnp.arange(row_pages, dtype=jnp.int32)[None, :]
        pick = jnp.minimum(first[:, None] + j, p - 1)
        table = jnp.where(j < need[:, None], free_list[pick], p)
        free = self.free.at[table.reshape(-1)].set(False, mode="drop")
        return self.replace(table=table, free=free)

    def release(self, rows: jax.Array) -> "PagedKVCache":
        """The pool with the pages of the rows marked in `rows` [B] (bool) free again; those rows
        own none."""
        owned = jnp.where(rows[:, None], self.table, self.num_pages)
        return self.replace(free=self.free.at[owned.reshape(-1)].set(True, mode="drop"),
                            table=jnp.where(rows[:, None], self.num_pages, self.table))

    def put_rows(self, part: "PagedKVCache", rows: jax.Array) -> "PagedKVCache":
        """This cache with `part`'s pool (written by the admitted rows' prefill) and its rows'
        tables at batch rows `rows` [R] (an index past the batch: dropped)."""
        return part.replace(table=self.table.at[rows].set(part.table, mode="drop"))


@struct.dataclass
class PagedKV:
    """One layer's pool and the rows' page table, as the attention layer sees it."""
    k: jax.Array  # [K, P, page, Dh]
    v: jax.Array
    table: jax.Array  # [B, R]

    @property
    def slots(self) -> int:
        """Logical slots of a row: its table's pages times the page size."""
        return self.table.shape[1] * self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    def write(self, new_k: jax.Array, new_v: jax.Array, start: jax.Array) -> "PagedKV":
        """Row b's step keys and values new[b] [K, T, Dh] written at its slots start[b] + [0, T);
        a slot on a page the row does not own is dropped."""
        b, _, t, _ = new_k.shape
        page, p, row_pages = self.page_size, self.k.shape[1], self.table.shape[1]
        slots = start[:, None] + jnp.arange(t, dtype=start.dtype)[None, :]  # [B, T]
        logical = slots // page
        owned = jnp.take_along_axis(self.table, jnp.minimum(logical, row_pages - 1), axis=1)
        # one more, dropped entry: a single-token write stays a scatter (see attention.write_step)
        pages = jnp.append(jnp.where(logical < row_pages, owned, p).reshape(-1), p)
        offsets = jnp.append((slots % page).reshape(-1), 0)

        def put(pool, new):  # [K, B*T + 1, Dh] at (page, offset) per entry
            flat = new.transpose(1, 0, 2, 3).reshape(new.shape[1], b * t, -1)
            flat = jnp.concatenate([flat, flat[:, :1]], axis=1).astype(pool.dtype)
            return constrain(pool.at[:, pages, offsets].set(flat, mode="drop"), POOL_AXES)

        return self.replace(k=put(self.k, new_k), v=put(self.v, new_v))

    def read(self, start: int | jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, K, size, Dh] of every row's logical slots [start, start + size),
        both whole pages (a page the row does not own reads as some page: mask it)."""
        page = self.page_size
        pages = jax.lax.dynamic_slice_in_dim(self.table, start // page, size // page, axis=1)
        pages = jnp.minimum(pages, self.k.shape[1] - 1)

        def take(pool):  # [K, B, c, page, Dh] -> [B, K, c * page, Dh]
            x = pool[:, pages]
            return x.transpose(1, 0, 2, 3, 4).reshape(pages.shape[0], pool.shape[0], size, pool.shape[-1])

        return take(self.k), take(self.v)
