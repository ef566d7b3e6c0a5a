"""Cached attention through a Pallas kernel, reading each row's own committed span.

A step's queries see the committed slots [0, cache_len[b]) and, of the step's own tokens, those an
intra mask allows (not plain causal in lossless/MARS steps), so no shipped kernel takes the whole
mask. The work is split: the kernel attends to the committed span and returns its unnormalised
output with its running max and normaliser; XLA attends to the step's few own keys; the two are
merged exactly by those normalisers (one softmax over both, as in `attention._attend`).

Kernels (`KernelOptions.attention`; both run on CPU with `KernelOptions.interpret`):
  "pallas_gpu": jax.experimental.pallas.ops.gpu.decode_attention (split-k flash decoding; visits
                each row's blocks only up to its cache_len).
  "pallas_tpu": jax.experimental.pallas.ops.tpu.flash_attention with residuals (its private
                `_flash_attention_impl`: the public call returns none), each row's span a segment:
                slots past cache_len are masked but still visited. The TPU kernels that skip them
                (paged_attention, ragged_paged_attention) return no log-sum-exp, so the exact
                merge cannot use them. Cost at the 32B shape: benchmarks/attention_kernels.md.
                On a paged pool (models/paged.py): `_paged_kernel`, this project's, which reads
                each row's pages through its page table, skips those past its length and
                returns the residuals.
A buffer's last slots short of one kernel block (ALIGN) are read in XLA with the step's own keys.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from prove_jax.errors import ProveJaxError
from prove_jax.models.kernels import ATTENTION_KERNELS
from prove_jax.models.paged import PagedKV
from prove_jax.models.sharding import DEFAULT_RULES, logical_to_spec

# backends each kernel compiles for; any backend in interpret mode
KERNEL_BACKENDS = MappingProxyType({"pallas_gpu": ("gpu",), "pallas_tpu": ("tpu",)})
SPLITS = (16, 8, 4, 2, 1)  # split-k factors tried, most first (more splits: more parallel blocks)
BLOCK_K = 128
# slots a kernel block holds: the buffer's last slots short of a whole block are read in XLA
ALIGN = {"pallas_gpu": 16, "pallas_tpu": 128}


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
    raise AttentionKernelError(f"attention kernel 'pallas_gpu' needs a multiple of 16 slots, got {slots}")


def _committed_gpu(q, cache_k, cache_v, cache_len, interpret: bool):
    """q [B, K, Q, Dh] against cache [B, K, S, Dh] up to cache_len [B]: unnormalised output
    [B, K, Q, Dh] (float32), normaliser l and max m [B, K, Q] (float32; l = 0 for an empty span)."""
    from jax.experimental.pallas.ops.gpu import decode_attention as da

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


def _committed_tpu(q, cache_k, cache_v, cache_len, interpret: bool):
    """`_committed_gpu` through the TPU flash-attention kernel with its residuals; each row's
    span is a segment (slots past cache_len are another), so the kernel masks the rest of the
    buffer but still visits it (the TPU kernels that skip it return no residuals)."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    b, k, nq, dh = q.shape
    slots = cache_k.shape[2]
    block_k = next((x for x in (512, 256, 128) if slots % x == 0), None)
    if block_k is None:
        raise AttentionKernelError(f"attention kernel 'pallas_tpu' needs a multiple of 128 slots, got {slots}")
    # queries padded to whole sublane tiles (rows of 8); padded queries are dropped below
    pad = -nq % 8
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))
    segments = fa.SegmentIds(q=jnp.ones((b, nq + pad), jnp.int32),
                             kv=(jnp.arange(slots)[None, :] < cache_len[:, None]).astype(jnp.int32))
    call = functools.partial(fa._flash_attention_impl, q, cache_k, cache_v, None, segments, True, False,
                             dh ** -0.5, 1, min(nq + pad, 128),
                             block_k, block_k, False)
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            o, l, m = call()
    else:
        o, l, m = call()
    o, l, m = o[:, :, :nq], l[:, :, :nq], m[:, :, :nq]
    return o.astype(jnp.float32) * l[..., None], l, m


def _per_shard(call, q, cache_k, cache_v, cache_len, rules=DEFAULT_RULES):
    """`call` on each device's rows and kv heads under the ambient mesh, as `rules` lay them (a
    Pallas kernel cannot be partitioned by XLA); a plain call without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not mesh.shape or any(t != AxisType.Auto for t in mesh.axis_types):
        return call(q, cache_k, cache_v, cache_len)
    rows_heads = logical_to_spec(("batch", "kv_heads"), q.shape[:2], mesh, rules)
    rows = P(*rows_heads[:1])
    heads = P(*rows_heads, None, None)
    return jax.shard_map(call, mesh=mesh, in_specs=(heads, heads, heads, rows),
                         out_specs=(heads, P(*rows_heads, None), P(*rows_heads, None)),
                         check_vma=False)(q, cache_k, cache_v, cache_len)


def _per_shard_paged(call, q, cache, cache_len, layer):
    """`_per_shard` for a paged pool: each device reads its own shard's pools [1, K, L, P, page,
    Dh], its kv heads, for its rows (the table and lengths split like the batch)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not mesh.shape or any(t != AxisType.Auto for t in mesh.axis_types):
        return call(q, cache.k, cache.v, cache.table, cache_len, layer)
    rows_heads = logical_to_spec(("batch", "kv_heads"), q.shape[:2], mesh)
    rows, heads = P(*rows_heads[:1]), P(*rows_heads, None, None)
    pool = P(*rows_heads, None, None, None, None)
    return jax.shard_map(call, mesh=mesh, in_specs=(heads, pool, pool, P(*rows_heads[:1], None), rows, P()),
                         out_specs=(heads, P(*rows_heads, None), P(*rows_heads, None)),
                         check_vma=False)(q, cache.k, cache.v, cache.table, cache_len, layer)


def attend_cached(kind: str, q, own_scores, own_values, cache, cache_len, interpret: bool = False,
                  platform: str | None = None, rules=DEFAULT_RULES):
    """Attention of grouped queries q [B, K, Q, Dh] (Q = G*T) over the committed span of `cache`
    (keys, values [B, K, S, Dh], or a `PagedKV` pool: "pallas_tpu" only) and the step's own
    values [B, K, T, Dh] with their masked scaled
    float32 scores own_scores [B, K, Q, T]. Returns float32 [B, K, Q, Dh] (normalised).
    `platform`: the one compiled for (None: jax's default backend); `rules`: how the mesh lays
    out the rows and kv heads (`sharding.kv_rules`)."""
    check_backend(kind, interpret, platform)
    committed = {"pallas_gpu": _committed_gpu, "pallas_tpu": _committed_tpu}.get(kind)
    if committed is None:
        raise AttentionKernelError(f"unknown attention kernel {kind!r}; choose one of {', '.join(ATTENTION_KERNELS)}")
    if isinstance(cache, PagedKV):
        if kind != "pallas_tpu":
            raise AttentionKernelError(f"the paged KV pool is read by 'pallas_tpu' or 'xla', not {kind!r}")
        layer = jnp.zeros((1,), jnp.int32) if cache.layer is None else jnp.reshape(cache.layer, (1,)).astype(jnp.int32)
        if cache.layer is None:  # per-layer pools as a stack of one
            cache = cache.replace(k=cache.k[:, :, None], v=cache.v[:, :, None])
        call = functools.partial(_committed_paged_tpu, interpret=interpret)
        return _merge(_per_shard_paged(call, q.astype(cache.k.dtype), cache, cache_len, layer),
                      own_scores, own_values)
    cache_k, cache_v = cache
    slots = cache_k.shape[2]
    aligned = slots - slots % ALIGN[kind]
    if aligned < slots:  # the last slots (less than one kernel block) are read here, with the step's own
        dh = q.shape[-1]
        tail_s = jnp.einsum("bkqd,bksd->bkqs", q, cache_k[:, :, aligned:].astype(q.dtype),
                            preferred_element_type=jnp.float32) * dh ** -0.5
        seen = (aligned + jnp.arange(slots - aligned))[None, :] < cache_len[:, None]  # [B, tail]
        tail_s = jnp.where(seen[:, None, None, :], tail_s, jnp.finfo(jnp.float32).min)
        own_scores = jnp.concatenate([tail_s, own_scores], axis=-1)
        own_values = jnp.concatenate([cache_v[:, :, aligned:].astype(own_values.dtype), own_values], axis=2)
    if aligned == 0:
        shape = q.shape[:3]
        acc_c, l_c, m_c = jnp.zeros(q.shape, jnp.float32), jnp.zeros(shape), jnp.full(shape, jnp.finfo(jnp.float32).min)
    else:  # a buffer sized to whole blocks is passed as it lies (a prefix slice may be copied)
        part = (lambda c: c) if aligned == slots else (lambda c: c[:, :, :aligned])
        call = functools.partial(committed, interpret=interpret)
        acc_c, l_c, m_c = _per_shard(call, q.astype(cache_k.dtype), part(cache_k), part(cache_v),
                                     jnp.minimum(cache_len, aligned), rules)
    return _merge((acc_c, l_c, m_c), own_scores, own_values)


def _merge(committed, own_scores, own_values):
    """One softmax over the committed span (the kernel's unnormalised output, normaliser and
    max) and the step's own keys (masked scores [B, K, Q, T], values [B, K, T, Dh])."""
    acc_c, l_c, m_c = committed
    m_o = jnp.max(own_scores, axis=-1)
    p = jnp.exp(own_scores - m_o[..., None])
    l_o = jnp.sum(p, axis=-1)
    acc_o = jnp.einsum("bkqt,bktd->bkqd", p.astype(own_values.dtype), own_values).astype(jnp.float32)
    top = jnp.maximum(m_c, m_o)  # every query sees at least itself: m_o is finite
    w_c, w_o = jnp.exp(m_c - top), jnp.exp(m_o - top)  # w_c = 0 for an empty committed span
    norm = l_c * w_c + l_o * w_o
    return (acc_c * w_c[..., None] + acc_o * w_o[..., None]) / norm[..., None]


# ---- paged pool (models/paged.py) ------------------------------------------------------------
# The TPU kernels JAX ships for pages (paged_attention, ragged_paged_attention) return no
# residuals and take one query per row (or causal spans), so they cannot serve a lossless step,
# whose queries see the committed span and a non-causal part of the step. This kernel reads a
# row's own pages through its page table (scalar-prefetched, so each block's DMA is addressed by
# it) and returns the unnormalised output with its max and normaliser for the exact merge.
LANES = 128  # the max and normaliser are kept lane-broadcast: TPU vector tiles are [8, 128]


def _paged_kernel(table_ref, lens_ref, layer_ref, q_ref, k_ref, v_ref, o_ref, l_ref, m_ref, m_sc, l_sc, acc_sc, *,
                  page: int, scale: float):
    from jax.experimental import pallas as pl

    b, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, jnp.finfo(jnp.float32).min, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    length = lens_ref[b]

    @pl.when(j * page < length)
    def _visit():
        q = q_ref[...].astype(jnp.float32)
        k = k_ref[...].astype(jnp.float32)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=jax.lax.Precision.HIGHEST) * scale  # [Q, page]
        slot = j * page + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(slot < length, s, jnp.finfo(jnp.float32).min)
        m_prev = m_sc[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        rescale = jnp.exp(m_prev - m_new)
        l_sc[...] = jnp.broadcast_to(l_sc[...][:, :1] * rescale + jnp.sum(p, axis=1, keepdims=True), l_sc.shape)
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        acc_sc[...] = acc_sc[...] * rescale + jax.lax.dot_general(
            p, v_ref[...].astype(jnp.float32), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
            precision=jax.lax.Precision.HIGHEST)

    @pl.when(j == pl.num_programs(2) - 1)
    def _done():
        o_ref[...] = acc_sc[...]
        l_ref[...] = l_sc[...]
        m_ref[...] = m_sc[...]


def _committed_paged_tpu(q, pool_k, pool_v, table, cache_len, layer, interpret: bool):
    """q [B, K, Q, Dh] against each row's pages (one shard's pools [1, K, L, P, page, Dh] at
    layer `layer` [1] int32, table [B, R]) up to
    cache_len [B]: unnormalised output [B, K, Q, Dh], normaliser l and max m [B, K, Q] (float32).
    A row's pages past its length are not read: their blocks repeat its last page's index, so
    the pipeline fetches nothing new."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    pool_k, pool_v = pool_k[0], pool_v[0]
    b, k, nq, dh = q.shape
    num_pages, page = pool_k.shape[2], pool_k.shape[3]
    row_pages = table.shape[1]
    pad = -nq % 8
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))
    qn = nq + pad
    table = jnp.minimum(table, num_pages - 1).astype(jnp.int32)
    lens = cache_len.astype(jnp.int32)

    def kv_block(bi, h, j, table_ref, lens_ref, layer_ref):
        last = jnp.maximum((lens_ref[bi] + page - 1) // page - 1, 0)
        return h, layer_ref[0], table_ref[bi, jnp.minimum(j, last)], 0, 0

    row_block = lambda bi, h, j, table_ref, lens_ref, layer_ref: (bi, h, 0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, k, row_pages),
        in_specs=[pl.BlockSpec((None, None, qn, dh), row_block),
                  pl.BlockSpec((None, None, None, page, dh), kv_block),
                  pl.BlockSpec((None, None, None, page, dh), kv_block)],
        out_specs=[pl.BlockSpec((None, None, qn, dh), row_block),
                   pl.BlockSpec((None, None, qn, LANES), row_block),
                   pl.BlockSpec((None, None, qn, LANES), row_block)],
        scratch_shapes=[pltpu.VMEM((qn, LANES), jnp.float32), pltpu.VMEM((qn, LANES), jnp.float32),
                        pltpu.VMEM((qn, dh), jnp.float32)])

    def call():  # built where it runs: interpret mode is read when the call is made
        return pl.pallas_call(
            functools.partial(_paged_kernel, page=page, scale=dh ** -0.5), grid_spec=grid_spec,
            out_shape=[jax.ShapeDtypeStruct((b, k, qn, dh), jnp.float32),
                       jax.ShapeDtypeStruct((b, k, qn, LANES), jnp.float32),
                       jax.ShapeDtypeStruct((b, k, qn, LANES), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        )(table, lens, layer, q, pool_k, pool_v)
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            o, l, m = call()
    else:
        o, l, m = call()
    return o[:, :, :nq], l[:, :, :nq, 0], m[:, :, :nq, 0]
