"""Cached attention through a Pallas kernel, reading each row's own committed span.

A step's queries see the committed slots [0, cache_len[b]) and, of the step's own tokens, those an
intra mask allows (not plain causal in lossless/MARS steps), so no shipped kernel takes the whole
mask. The work is split: the kernel attends to the committed span and returns its unnormalised
output with its running max and normaliser; XLA attends to the step's few own keys; the two are
merged exactly by those normalisers (one softmax over both, as in `attention._attend`).

Kernels (`ComputeOptions.attention`; both run on CPU with `ComputeOptions.interpret`):
  "pallas_gpu": jax.experimental.pallas.ops.gpu.decode_attention (split-k flash decoding; visits
                each row's blocks only up to its cache_len). A buffer's last slots short of one
                kernel block (ALIGN) are read in XLA with the step's own keys.
  "pallas_tpu": `_span_kernel`, this project's, for the contiguous buffer and the paged pool
                alike: it reads a row's committed span in place, as blocks of the buffer's own
                slot axis (a stacked cache's layer, a pool's pages) addressed through
                scalar-prefetched tables, skips blocks past the row's length and returns the
                residuals. JAX's TPU kernels return none through a public entry, or take one
                query per row (see the section below).
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from prove_jax.errors import ProveJaxError
from prove_jax.models.compute import ATTENTION_KERNELS, LANES
from prove_jax.models.paged import PagedKV
from prove_jax.models.sharding import DEFAULT_RULES, logical_to_spec

# backends each kernel compiles for; any backend in interpret mode
KERNEL_BACKENDS = MappingProxyType({"pallas_gpu": ("gpu",), "pallas_tpu": ("tpu",)})
SPLITS = (16, 8, 4, 2, 1)  # split-k factors tried, most first (more splits: more parallel blocks)
BLOCK_K = 128
# slots a GPU kernel block holds: the buffer's last slots short of a whole block are read in XLA
ALIGN = 16


class AttentionKernelError(ProveJaxError, ValueError):
    """The chosen attention kernel cannot run on this backend or shape."""


def check_backend(kind: str, interpret: bool, backend: str | None = None) -> None:
    """Raise unless kernel `kind` can run on `backend` (default: jax's)."""
    backend = backend or jax.default_backend()
    if kind in KERNEL_BACKENDS and not interpret and backend not in KERNEL_BACKENDS[kind]:
        raise AttentionKernelError(
            f"attention kernel {kind!r} runs on {'/'.join(KERNEL_BACKENDS[kind])}, not {backend} "
            f"(use attention='xla', or interpret=True to emulate it)")


def split_k(slots: int) -> tuple[int, int]:
    """(k_splits, block_k) for `slots` (a multiple of 16) under decode_attention's constraints:
    slots divisible by the splits, at least 16 slots a split, a split a whole number of blocks."""
    for splits in SPLITS:
        per = slots // splits
        block = next((x for x in (BLOCK_K, 64, 32, 16) if per % x == 0), None)
        if slots % splits == 0 and per >= 16 and block is not None:
            return splits, block
    raise AttentionKernelError(
        f"attention kernel 'pallas_gpu' needs a multiple of 16 slots, got {slots}"
    )


def _committed_gpu(q, cache_k, cache_v, cache_len, interpret: bool):
    """q [B, K, Q, Dh] against cache [B, K, S, Dh] up to cache_len [B]: unnormalised output
    [B, K, Q, Dh] (float32), normaliser l and max m [B, K, Q] (float32; l = 0 for an empty span)."""
    from jax.experimental.pallas.ops.gpu import decode_attention as da  # slow: kernel path only

    splits, block_k = split_k(cache_k.shape[2])
    inner = functools.partial(
        da.decode_attn_unbatched, sm_scale=q.shape[-1] ** -0.5, block_h=16, block_k=block_k,
        k_splits=splits, num_warps=None, num_stages=2, grid=None, interpret=interpret, debug=False,
        return_residuals=True, normalize_output=False)
    b, k = q.shape[:2]
    lens = jnp.broadcast_to(cache_len.astype(jnp.int32)[:, None], (b, k))
    # vmapped over rows and kv heads where the cache lies (gqa's wrapper wants [B, S, K, Dh])
    o, (l, m) = jax.vmap(jax.vmap(inner))(q, cache_k, cache_v, None, lens)
    return o.astype(jnp.float32), l, m


def _per_shard(call, q, cache_k, cache_v, cache_len, layer, rules=DEFAULT_RULES, table=None):
    """`call(q, k, v, cache_len, layer)` (with a page `table` [B, R]: `call(q, k, v, table,
    cache_len, layer)`) on each device's rows and kv heads under the ambient mesh, as `rules`
    lay them (a Pallas kernel cannot be partitioned by XLA); a plain call without one. The cache
    is [B or D, K, ...]: rows (or a paged pool's data shards), heads, the rest whole."""
    paged = () if table is None else (table,)
    mesh = jax.sharding.get_abstract_mesh()
    if (
        mesh is None
        or mesh.empty
        or not mesh.shape
        or any(t != AxisType.Auto for t in mesh.axis_types)
    ):
        return call(q, cache_k, cache_v, *paged, cache_len, layer)
    rows_heads = logical_to_spec(("batch", "kv_heads"), q.shape[:2], mesh, rules)
    rows = P(*rows_heads[:1])
    heads = P(*rows_heads, None, None)
    cache = P(*rows_heads, *(None,) * (cache_k.ndim - 2))
    specs = (heads, cache, cache) + ((P(*rows_heads[:1], None),) if paged else ()) + (rows, P())
    return jax.shard_map(call, mesh=mesh, in_specs=specs,
                         out_specs=(heads, P(*rows_heads, None), P(*rows_heads, None)),
                         check_vma=False)(q, cache_k, cache_v, *paged, cache_len, layer)


def attend_cached(kind: str, q, own_scores, own_values, cache, cache_len, interpret: bool = False,
                  platform: str | None = None, rules=DEFAULT_RULES):
    """Attention of grouped queries q [B, K, Q, Dh] (Q = G*T) over the committed span of `cache`
    (keys, values [B, K, S, Dh]; a stacked cache's layer, with `k`, `v` [B, K, L * S, Dh],
    `layer` and `num_layers`, as attention.LayerKV; or a `PagedKV` pool: "pallas_tpu" only) and
    the step's own values [B, K, T, Dh] with their masked scaled float32 scores own_scores
    [B, K, Q, T]. Returns float32 [B, K, Q, Dh] (normalised).
    `platform`: the one compiled for (None: jax's default backend); `rules`: how the mesh lays
    out the rows and kv heads (`sharding.kv_rules`)."""
    if kind == "auto":
        raise AttentionKernelError("attention 'auto' is resolved on the host before tracing "
                                   "(ComputeOptions.resolve_attention)")
    check_backend(kind, interpret, platform)
    if kind not in KERNEL_BACKENDS:
        raise AttentionKernelError(
            f"unknown attention kernel {kind!r}; choose one of {', '.join(ATTENTION_KERNELS)}"
        )
    if isinstance(cache, PagedKV):
        if kind != "pallas_tpu":
            raise AttentionKernelError(
                f"the paged KV pool is read by 'pallas_tpu' or 'xla', not {kind!r}"
            )
        layer = (
            jnp.zeros((), jnp.int32) if cache.layer is None else jnp.asarray(cache.layer, jnp.int32)
        )
        call = functools.partial(_committed_paged_tpu, interpret=interpret)
        return _merge(
            _per_shard(
                call, q.astype(cache.k.dtype), cache.k, cache.v, cache_len, layer, table=cache.table
            ),
            own_scores,
            own_values,
        )
    stacked = getattr(cache, "num_layers", 0)
    # the buffer as it lies: a stacked cache is read at its layer, in place
    if kind == "pallas_tpu":
        keys, values = (cache.k, cache.v) if stacked else cache
        layer = jnp.asarray(cache.layer, jnp.int32) if stacked else jnp.zeros((), jnp.int32)
        call = functools.partial(
            _committed_contiguous_tpu, num_layers=max(1, stacked), interpret=interpret,
            slots_minor=stacked and cache.slots_minor,
        )
        return _merge(_per_shard(call, q.astype(keys.dtype), keys, values, cache_len, layer, rules),
                      own_scores, own_values)
    cache_k, cache_v = cache.read() if stacked else cache  # the GPU kernel takes the layer's slots
    slots = cache_k.shape[2]
    aligned = slots - slots % ALIGN
    # the last slots (less than one kernel block) are read here, with the step's own
    if aligned < slots:
        dh = q.shape[-1]
        tail_s = jnp.einsum("bkqd,bksd->bkqs", q, cache_k[:, :, aligned:].astype(q.dtype),
                            preferred_element_type=jnp.float32) * dh ** -0.5
        seen = (aligned + jnp.arange(slots - aligned))[None, :] < cache_len[:, None]  # [B, tail]
        tail_s = jnp.where(seen[:, None, None, :], tail_s, jnp.finfo(jnp.float32).min)
        own_scores = jnp.concatenate([tail_s, own_scores], axis=-1)
        own_values = jnp.concatenate(
            [cache_v[:, :, aligned:].astype(own_values.dtype), own_values], axis=2
        )
    if aligned == 0:
        shape = q.shape[:3]
        acc_c, l_c, m_c = (
            jnp.zeros(q.shape, jnp.float32),
            jnp.zeros(shape),
            jnp.full(shape, jnp.finfo(jnp.float32).min),
        )
    else:  # a buffer sized to whole blocks is passed as it lies (a prefix slice may be copied)
        part = (lambda c: c) if aligned == slots else (lambda c: c[:, :, :aligned])
        call = lambda q, k, v, lens, layer: _committed_gpu(q, k, v, lens, interpret)  # noqa: E731
        acc_c, l_c, m_c = _per_shard(
            call,
            q.astype(cache_k.dtype),
            part(cache_k),
            part(cache_v),
            jnp.minimum(cache_len, aligned),
            jnp.zeros((), jnp.int32),
            rules,
        )
    return _merge((acc_c, l_c, m_c), own_scores, own_values)


def _merge(committed, own_scores, own_values):
    """One softmax over the committed span (the kernel's unnormalised output, normaliser and
    max) and the step's own keys (masked scores [B, K, Q, T], values [B, K, T, Dh])."""
    acc_c, l_c, m_c = committed
    m_o = jnp.max(own_scores, axis=-1)
    p = jnp.exp(own_scores - m_o[..., None])
    l_o = jnp.sum(p, axis=-1)
    acc_o = jnp.einsum("bkqt,bktd->bkqd", p.astype(own_values.dtype), own_values).astype(
        jnp.float32
    )
    top = jnp.maximum(m_c, m_o)  # every query sees at least itself: m_o is finite
    w_c, w_o = jnp.exp(m_c - top), jnp.exp(m_o - top)  # w_c = 0 for an empty committed span
    norm = l_c * w_c + l_o * w_o
    return (acc_c * w_c[..., None] + acc_o * w_o[..., None]) / norm[..., None]


# ---- the TPU kernel: one for the contiguous buffer and the paged pool -------------------------
# The TPU kernels JAX ships (flash_attention, paged_attention, ragged_paged_attention) return no
# residuals through a public entry, take one query per row (or causal spans), or visit every
# slot, so none serves a lossless step, whose queries see the committed span and a non-causal
# part of the step. This one reads a row's committed span as blocks of one slot axis that the
# buffer already has, addressed through scalar-prefetched tables (so nothing is sliced or
# copied out of the cache first): a contiguous [B, K, L * S, Dh] buffer in blocks of up to
# BLOCK slots from its layer's first slot (a block may straddle the layer before or after, its
# slots masked), a paged pool [1, K, L * P * page, Dh] a page per block through the page
# table. A row's blocks past its length repeat its last block's index, so the pipeline fetches
# nothing new; blocks wholly past it are not computed. It returns the unnormalised output with
# its max and normaliser for the exact merge (`_merge`).
# LANES (compute.py): the max and normaliser are kept lane-broadcast: TPU vector tiles are [8, 128]
BLOCK = 512  # slots a contiguous block holds: a 128 KiB bf16 K block at Dh = 128, so a grid step's
# fixed cost is small beside its DMA (JAX's flash attention defaults to 512-slot blocks too)


def _span_kernel(rows_ref, blocks_ref, starts_ref, counts_ref, lens_ref, q_ref, k_ref, v_ref,
                 o_ref, l_ref, m_ref, m_sc, l_sc, acc_sc, *, scale: float,
                 slots_minor: bool = False):
    from jax.experimental import pallas as pl  # slow to import: only a kernel path needs it

    b, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, jnp.finfo(jnp.float32).min, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j < counts_ref[b])  # a visited block holds at least one of the row's slots
    def _visit():
        _accumulate(
            q_ref[...],
            k_ref[...],
            v_ref[...],
            starts_ref[b, j],
            lens_ref[b],
            m_sc,
            l_sc,
            acc_sc,
            scale,
            slots_minor,
        )

    @pl.when(j == pl.num_programs(2) - 1)
    def _done():
        o_ref[...] = acc_sc[...]
        l_ref[...] = l_sc[...]
        m_ref[...] = m_sc[...]


def _accumulate(q, k, v, first, length, m_sc, l_sc, acc_sc, scale: float,
                slots_minor: bool = False):
    """The flash-attention recurrence over one block: queries q [Q, Dh] against keys and values
    [block, Dh] (`slots_minor`: [Dh, block]) whose first slot is the row's slot `first`, of
    which those in [0, length) are seen; running max, normaliser and output in m_sc, l_sc
    [Q, LANES] and acc_sc [Q, Dh]."""
    # float32 caches at full precision (the tests' oracle); bfloat16 ones as XLA reads them
    precision = jax.lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
    slot_axis = 1 if slots_minor else 0  # of k and v
    s = jax.lax.dot_general(q, k, (((1,), (1 - slot_axis,)), ((), ())),
                            preferred_element_type=jnp.float32, precision=precision) * scale
    slot = first + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)  # s: [Q, block]
    s = jnp.where((slot >= 0) & (slot < length), s, jnp.finfo(jnp.float32).min)
    # values outside the row's span (another layer's, past the buffer's end, a stale buffer) may be
    # anything
    v_slot = first + jax.lax.broadcasted_iota(jnp.int32, v.shape, slot_axis)
    v = jnp.where((v_slot >= 0) & (v_slot < length), v, jnp.zeros_like(v))
    m_prev = m_sc[...][:, :1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    rescale = jnp.exp(m_prev - m_new)
    l_sc[...] = jnp.broadcast_to(
        l_sc[...][:, :1] * rescale + jnp.sum(p, axis=1, keepdims=True), l_sc.shape
    )
    m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
    acc_sc[...] = acc_sc[...] * rescale + jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (slot_axis,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=precision,
    )


def span_cost(
    b: int, k: int, queries: int, dh: int, visits: int, block: int, itemsize: int, q_itemsize: int
):
    """pl.CostEstimate of `_span_kernel` over b rows, k kv heads, `visits` blocks of `block` slots
    each (a row filled to its whole span): the K and V blocks it fetches, its queries, its
    float32 outputs; two dots per block; an exp per score. What hlo_cost prices the call at."""
    from jax.experimental import pallas as pl  # slow to import: only a kernel path needs it

    slots = visits * block
    fetched = 2 * b * k * slots * dh * itemsize
    moved = fetched + b * k * queries * dh * q_itemsize + b * k * queries * (dh + 2 * LANES) * 4
    return pl.CostEstimate(
        flops=4 * b * k * queries * slots * dh,
        transcendentals=b * k * queries * slots,
        bytes_accessed=int(moved),
    )


def _span_call(q, keys, values, rows, blocks, starts, counts, lens, block: int, interpret: bool,
               slots_minor: bool = False):
    """q [B, K, Q, Dh] against row b's blocks of `block` slots, blocks[b, :counts[b]], of buffer
    row rows[b] of keys, values [N, K, M, Dh] (`slots_minor`: [N, K, Dh, M]; blocks[b, j]'s
    first slot is the row's slot starts[b, j]), up to lens[b]: unnormalised output [B, K, Q,
    Dh], normaliser l and max m [B, K, Q] (float32; l = 0 for an empty span)."""
    from jax.experimental import pallas as pl  # slow to import: only a kernel path needs it
    from jax.experimental.pallas import tpu as pltpu

    b, k, nq, dh = q.shape
    visits = blocks.shape[1]
    pad = -nq % 8  # queries padded to whole sublane tiles (rows of 8); dropped below
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))
    qn = nq + pad

    def kv_block(bi, h, j, rows_ref, blocks_ref, starts_ref, counts_ref, lens_ref):
        at = blocks_ref[bi, jnp.minimum(j, jnp.maximum(counts_ref[bi] - 1, 0))]
        return (rows_ref[bi], h) + ((0, at) if slots_minor else (at, 0))

    row_block = lambda bi, h, j, *refs: (bi, h, 0, 0)  # noqa: E731
    kv_shape = (None, None) + ((dh, block) if slots_minor else (block, dh))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5, grid=(b, k, visits),
        in_specs=[pl.BlockSpec((None, None, qn, dh), row_block),
                  pl.BlockSpec(kv_shape, kv_block),
                  pl.BlockSpec(kv_shape, kv_block)],
        out_specs=[pl.BlockSpec((None, None, qn, dh), row_block),
                   pl.BlockSpec((None, None, qn, LANES), row_block),
                   pl.BlockSpec((None, None, qn, LANES), row_block)],
        scratch_shapes=[pltpu.VMEM((qn, LANES), jnp.float32), pltpu.VMEM((qn, LANES), jnp.float32),
                        pltpu.VMEM((qn, dh), jnp.float32)])
    cost = span_cost(b, k, qn, dh, visits, block, keys.dtype.itemsize, q.dtype.itemsize)

    kernel = functools.partial(_span_kernel, scale=dh ** -0.5, slots_minor=slots_minor)
    return _run_span_kernel(kernel, grid_spec, cost, (b, k, qn, dh), nq, interpret,
                            rows, blocks, starts, counts, lens, q, keys, values)


def _run_span_kernel(kernel, grid_spec, cost, shape, nq: int, interpret: bool, *operands):
    """Run a committed-span kernel over its grid (rows, kv heads, blocks) -> its unnormalised
    output [B, K, nq, Dh], normaliser and max [B, K, nq], the queries' padding dropped."""
    from jax.experimental import pallas as pl  # slow to import: only a kernel path needs it
    from jax.experimental.pallas import tpu as pltpu

    b, k, qn, dh = shape

    def call():  # built where it runs: interpret mode is read when the call is made
        return pl.pallas_call(
            kernel, grid_spec=grid_spec,
            out_shape=[jax.ShapeDtypeStruct((b, k, qn, dh), jnp.float32),
                       jax.ShapeDtypeStruct((b, k, qn, LANES), jnp.float32),
                       jax.ShapeDtypeStruct((b, k, qn, LANES), jnp.float32)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary")),
            cost_estimate=cost,
        )(*operands)
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            o, l, m = call()
    else:
        o, l, m = call()
    return o[:, :, :nq], l[:, :, :nq, 0], m[:, :, :nq, 0]


def contiguous_blocks(slots: int, num_layers: int, layer, lens, block: int):
    """(blocks, starts, counts) [B, J], [B, J], [B] of rows `lens` [B] long in layer `layer` of
    a buffer of `num_layers` spans of `slots` slots on one axis, read in blocks of `block`: the
    blocks from the one holding the layer's first slot to the one holding its last live slot."""
    total = -(-num_layers * slots // block)
    visits = min(total, (slots + block - 2) // block + 1)  # most blocks a span of `slots` touches
    origin = layer * slots
    first = origin // block
    j = jnp.arange(visits, dtype=jnp.int32)[None, :]
    blocks = jnp.broadcast_to(jnp.minimum(first + j, total - 1), (lens.shape[0], visits))
    starts = (first + j) * block - origin
    counts = jnp.where(lens > 0, (origin + lens - 1) // block - first + 1, 0)
    return (
        blocks.astype(jnp.int32),
        jnp.broadcast_to(starts, blocks.shape).astype(jnp.int32),
        counts.astype(jnp.int32),
    )


def _committed_contiguous_tpu(
    q, cache_k, cache_v, cache_len, layer, num_layers: int, interpret: bool,
    slots_minor: bool = False,
):
    """q [B, K, Q, Dh] against layer `layer` (int32 scalar) of one shard's buffers [B, K, L * S,
    Dh] (`slots_minor`: [B, K, Dh, L * S]; L = num_layers; a per-layer buffer: 1), up to
    cache_len [B]: `_span_call`'s result."""
    b, total = cache_k.shape[0], cache_k.shape[3 if slots_minor else 2]
    block = min(BLOCK, total)
    lens = cache_len.astype(jnp.int32)
    blocks, starts, counts = contiguous_blocks(total // num_layers, num_layers, layer, lens, block)
    return _span_call(
        q,
        cache_k,
        cache_v,
        jnp.arange(b, dtype=jnp.int32),
        blocks,
        starts,
        counts,
        lens,
        block,
        interpret,
        slots_minor,
    )


def _paged_kernel(table_ref, counts_ref, lens_ref, q_ref, k_hbm, v_hbm, o_ref, l_ref, m_ref,
                  k_buf, v_buf, sem, m_sc, l_sc, acc_sc, *, scale: float):
    """`_span_kernel` over a row's pages, `per_step` of them a grid step (k_buf [2, per_step,
    page, Dh]): each page copied from the pool (k_hbm [K, pages, page, Dh], page table_ref[b, i])
    into one half of a double buffer while the other half is computed, as JAX's ragged paged
    attention does; pages past the row's counts_ref[b] are not copied."""
    from jax.experimental import pallas as pl  # slow to import: only a kernel path needs it
    from jax.experimental.pallas import tpu as pltpu

    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    per_step, page, dh = k_buf.shape[1:]
    count = counts_ref[b]
    steps = (count + per_step - 1) // per_step
    row_pages = table_ref.shape[1]

    def each_copy(step, slot, act):  # act(copy) on every page of `step` the row owns
        for i in range(per_step):
            at = step * per_step + i
            index = table_ref[b, jnp.minimum(at, row_pages - 1)]

            @pl.when(at < count)
            def _():
                for pool, buf in ((k_hbm, k_buf), (v_hbm, v_buf)):
                    act(pltpu.make_async_copy(pool.at[h, index], buf.at[slot, i], sem.at[slot]))

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, jnp.finfo(jnp.float32).min, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

        @pl.when(steps > 0)
        def _first():
            each_copy(0, 0, lambda c: c.start())

    @pl.when(j < steps)
    def _visit():
        slot = j % 2

        @pl.when(j + 1 < steps)
        def _next():
            each_copy(j + 1, 1 - slot, lambda c: c.start())

        each_copy(j, slot, lambda c: c.wait())
        k = k_buf[slot].reshape(per_step * page, dh)
        v = v_buf[slot].reshape(per_step * page, dh)
        _accumulate(q_ref[...], k, v, j * per_step * page, lens_ref[b], m_sc, l_sc, acc_sc, scale)

    @pl.when(j == pl.num_programs(2) - 1)
    def _done():
        o_ref[...] = acc_sc[...]
        l_ref[...] = l_sc[...]
        m_ref[...] = m_sc[...]


def _committed_paged_tpu(q, pool_k, pool_v, table, cache_len, layer, interpret: bool):
    """q [B, K, Q, Dh] against each row's pages (one shard's pools [1, K, (L,) P, page, Dh] at
    layer `layer`, int32 scalar; table [B, R]) up to cache_len [B]: unnormalised output
    [B, K, Q, Dh], normaliser l and max m [B, K, Q] (float32), pages of BLOCK slots in all a
    grid step (`_paged_kernel`; the pools are read as [K, L * P, page, Dh]: a view, not a copy)."""
    from jax.experimental import pallas as pl  # slow to import: only a kernel path needs it
    from jax.experimental.pallas import tpu as pltpu

    b, k, nq, dh = q.shape
    num_pages, page = pool_k.shape[-3], pool_k.shape[-2]
    row_pages = table.shape[1]
    per_step = max(1, min(row_pages, BLOCK // page))
    pad = -nq % 8
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))
    qn = nq + pad
    flat = lambda pool: pool.reshape(k, -1, page, dh)  # noqa: E731
    pages = (layer * num_pages + jnp.minimum(table, num_pages - 1)).astype(jnp.int32)
    lens = cache_len.astype(jnp.int32)
    counts = (lens + page - 1) // page
    row_block = lambda bi, h, j, *refs: (bi, h, 0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, k, -(-row_pages // per_step)),
        in_specs=[
            pl.BlockSpec((None, None, qn, dh), row_block),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[
            pl.BlockSpec((None, None, qn, dh), row_block),
            pl.BlockSpec((None, None, qn, LANES), row_block),
            pl.BlockSpec((None, None, qn, LANES), row_block),
        ],
        scratch_shapes=[
            pltpu.VMEM((2, per_step, page, dh), pool_k.dtype),
            pltpu.VMEM((2, per_step, page, dh), pool_v.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((qn, LANES), jnp.float32),
            pltpu.VMEM((qn, LANES), jnp.float32),
            pltpu.VMEM((qn, dh), jnp.float32),
        ],
    )
    cost = span_cost(b, k, qn, dh, row_pages, page, pool_k.dtype.itemsize, q.dtype.itemsize)

    return _run_span_kernel(functools.partial(_paged_kernel, scale=dh ** -0.5), grid_spec, cost,
                            (b, k, qn, dh), nq, interpret,
                            pages, counts, lens, q, flat(pool_k), flat(pool_v))
