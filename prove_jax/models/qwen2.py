"""Qwen2 / Qwen2.5 decoder in flax.nnx.

The forward pass is deliberately explicit: callers pass token ids, position ids and a boolean
attention mask, because MARS training (two streams sharing positions) and block decoding (mask
groups that must not see each other) both need masks that are not the causal default.

With a `KVCache` the mask is a `StepMask`: row b's committed keys/values are cache slots
[0, cache_len[b]) and its T new tokens are written at slots cache_len[b] + i (out-of-range
writes are dropped). The queries then attend to two blocks under one softmax: the committed
cache slots, and the step's own keys under the step's `intra` mask (causal, MARS mask groups,
prompt padding), so no [B, T, S] mask is ever gathered. Slots beyond a row's committed length
hold garbage that the mask hides and the next write overwrites: nothing is ever copied or
cropped. The cache layout and the write are chosen so that XLA updates the buffers in place
inside the decode loop (see `KVCache` and `Attention`).

Weights keep HF's (torch's) [out, in] order, heads split out: q [H, Dh, D], k/v [K, Dh, D],
o [D, H, Dh], gate/up [F, D], down [D, F], lm_head [V, D]. Conversion is then a reshape, and
`dense` can run a decode step's few rows in the form that is fastest on the CPU at hand.

Shapes: B batch, T new tokens, S cache slots, D hidden, H query heads, K kv heads,
G = H // K query heads per kv head, Dh head dim, F mlp width, V vocab.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx, struct

from prove_jax.models.config import ModelConfig
from prove_jax.models.kernels import DEFAULT_KERNELS, MATMUL_FORMS, KernelOptions
from prove_jax.models.sharding import constrain, rows_per_device

_NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)


# On CPU, a projection of at most this many token rows (a decode step: batch x step width) runs
# in the CPU's decode form (see `dense`); more rows (prefill, training) run as the plain
# contraction, which is as fast there. Crossover measured at 64-96 rows for Qwen2.5-0.5B shapes
# (2-core AVX2 EPYC, weight-major form; not remeasured for input-major).
CPU_DECODE_MAX_ROWS = 64
# The forms `dense` can give those rows. weight_major: w @ x^T, the weight as the dot's left
# operand. input_major: x @ w^T with w transposed to [*in, *out] once (the transpose is
# loop-invariant, so XLA hoists it out of the decode loop). plain: x @ w^T as written.
# Environment override of the CPU decode form (one of MATMUL_FORMS): input_major for small
# models on CPUs where it measures faster (see `default_cpu_form`), or a CPU not measured here.
MATMUL_FORM_ENV = "PROVE_JAX_CPU_MATMUL"
# XLA:CPU's dot kernels time as if they covered the weight-major product's columns (the token
# rows) in tiles of 8 (measured, not documented): a ragged last tile past 4 rows costs about as
# much as a whole extra tile or more (2-core AVX2 EPYC, benchmarks/step_cost.md as of 399fbc0:
# the demo's layer matmuls at 7-10 rows take 1.5x longer unpadded than padded, at 29 rows
# 1.3x; Qwen2.5-0.5B's at 9 rows 1.3x). So weight-major products of more than
# DOT_UNPADDED_MAX_ROWS rows are padded with zero rows to a multiple of DOT_ROW_TILE. Up to 4
# rows (AR steps at small batch) run as they are: 1 row costs half of 8.
DOT_ROW_TILE = 8
DOT_UNPADDED_MAX_ROWS = 4


def default_cpu_form() -> str:
    """The CPU decode form: `PROVE_JAX_CPU_MATMUL` if set, else weight-major.

    Weight-major is the form that holds up at real model sizes on both CPUs measured (2-core
    EPYCs, AVX2 and AVX-512; benchmarks/step_cost.md): at the Qwen2.5-0.5B shape its AR step
    is 1.5-2.8x faster than plain and its 16-row lossless step costs about 2-2.6x its AR step.
    Input-major is opt-in. On the AVX-512 EPYC (Zen 5) it made the demo model's lossless
    steps up to 22% cheaper in the step-cost benchmark, its AR step dearer at batch 1. It
    keeps a transposed copy of every weight for each decode call: twice the weight memory,
    and about a second of transposes per call at the 0.5B shape.
    """
    form = os.environ.get(MATMUL_FORM_ENV)
    if form:
        if form not in MATMUL_FORMS:
            raise ValueError(f"{MATMUL_FORM_ENV}={form!r}: choose one of {', '.join(MATMUL_FORMS)}")
        return form
    return "weight_major"


def decode_matmul_form(kernels: KernelOptions = DEFAULT_KERNELS) -> tuple[str, int]:
    """(form, most token rows it is used for) that `dense` applies under `kernels`: its explicit
    choice, else the CPU default for up to CPU_DECODE_MAX_ROWS rows; accelerators: plain."""
    if kernels.matmul_form is not None:
        max_rows = CPU_DECODE_MAX_ROWS if kernels.matmul_max_rows is None else kernels.matmul_max_rows
        return kernels.matmul_form, max_rows
    if jax.default_backend() == "cpu":
        max_rows = CPU_DECODE_MAX_ROWS if kernels.matmul_max_rows is None else kernels.matmul_max_rows
        return default_cpu_form(), max_rows
    return "plain", 0


def dense(x: jax.Array, w: jax.Array, n_in: int = 1, kernels: KernelOptions = DEFAULT_KERNELS) -> jax.Array:
    """x [..., *in] times w [*out, *in] -> [..., *out]; w stores output features major, as HF does.

    For the few rows of a decode step, XLA:CPU's dot kernels run much faster in another form
    than x @ w^T as written (`default_cpu_form` picks; weight-major unless overridden):
    - weight_major, w @ x^T: at Qwen2.5-0.5B shapes on an AVX2 EPYC a 16-row step cost 1.8x a
      one-row step instead of 3.2x. The rows are padded to whole kernel tiles
      (`padded_dot_rows`).
    - input_major, x @ t(w) with t(w) [*in, *out]: the standard row-major product. The
      transposed weight is loop-invariant, so in the decode loop XLA computes it once per
      call, before the loop (tests/test_decode_in_place.py checks the compiled loop); the
      copy doubles the weight memory of the call.
    An optimization barrier keeps XLA from folding the transpose back into the dot. Elsewhere
    the plain contraction, whose layout XLA chooses itself.
    """
    x_in = tuple(range(x.ndim - n_in, x.ndim))
    w_in = tuple(range(w.ndim - n_in, w.ndim))
    lead = x.shape[:x.ndim - n_in]
    rows = math.prod(lead)
    form, max_rows = decode_matmul_form(kernels)
    if rows > max_rows or form == "plain":
        return jnp.tensordot(x, w, axes=(x_in, w_in))
    if form == "input_major":
        w_t = jax.lax.optimization_barrier(jnp.transpose(w, w_in + tuple(range(w.ndim - n_in))))
        return jnp.tensordot(x, w_t, axes=(x_in, tuple(range(n_in))))
    x_rows = x.reshape(rows, *x.shape[x.ndim - n_in:])  # [R, *in]
    padded = padded_dot_rows(rows, kernels)
    if padded != rows:
        x_rows = jnp.pad(x_rows, ((0, padded - rows),) + ((0, 0),) * n_in)
    y = jax.lax.optimization_barrier(  # [*out, R']
        jnp.tensordot(w, x_rows, axes=(w_in, tuple(range(1, n_in + 1)))))
    y = jnp.moveaxis(y[..., :rows], -1, 0)  # [R, *out]
    return y.reshape(*lead, *y.shape[1:])


def padded_dot_rows(rows: int, kernels: KernelOptions = DEFAULT_KERNELS) -> int:
    """Token rows a weight-major product of `rows` rows runs with (see DOT_ROW_TILE)."""
    if not kernels.pad_dot_rows or rows <= DOT_UNPADDED_MAX_ROWS:
        return rows
    return -(-rows // DOT_ROW_TILE) * DOT_ROW_TILE


def _param(rngs, shape, axes, dtype, init="normal"):
    if init == "normal":
        value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:
        value = jnp.ones(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


@struct.dataclass
class KVCache:
    """Static per-layer key/value buffers: k[i], v[i] are [B, K, S, Dh].

    Heads-major, so each (row, kv head) is one contiguous [S, Dh] matrix that attention reads as
    it lies; with [B, S, K, Dh] XLA transposed every layer's whole buffer on every step.
    """
    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, length: int, dtype=None) -> "KVCache":
        dtype = jnp.dtype(config.dtype) if dtype is None else dtype
        shape = (batch, config.num_kv_heads, length, config.head_dim)
        mk = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        return cls(k=mk(), v=mk())


@struct.dataclass
class StepMask:
    """What a step of T new tokens sees when it runs against a `KVCache`.

    Every query of row b sees the committed slots [0, cache_len[b]); among the step's own tokens
    (written at slots cache_len[b] + i) it sees those `intra` allows.
    """
    cache_len: jax.Array  # [B] int32
    intra: jax.Array  # bool [B or 1, T, T]: may step token q attend step token k


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float):
    """cos/sin tables [B, T, Dh] for explicit position ids [B, T] (HF 'rotate_half' layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, Dh]; rotation done in float32, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = _param(rngs, (dim,), ("embed",), param_dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * y.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q_kernel = _param(rngs, (h, dh, d), ("heads", "head_dim", "embed"), pd)
        self.q_bias = _param(rngs, (h, dh), ("heads", "head_dim"), pd, init="zeros")
        self.k_kernel = _param(rngs, (k, dh, d), ("kv_heads", "head_dim", "embed"), pd)
        self.k_bias = _param(rngs, (k, dh), ("kv_heads", "head_dim"), pd, init="zeros")
        self.v_kernel = _param(rngs, (k, dh, d), ("kv_heads", "head_dim", "embed"), pd)
        self.v_bias = _param(rngs, (k, dh), ("kv_heads", "head_dim"), pd, init="zeros")
        self.o_kernel = _param(rngs, (d, h, dh), ("embed", "heads", "head_dim"), pd)

    def __call__(self, x, cos, sin, attn_mask, kv=None, kernels: KernelOptions = DEFAULT_KERNELS):
        """x [B,T,D]; attn_mask bool [B,T,T] without cache, a StepMask with kv = (k, v) [B,K,S,Dh]."""
        cfg = self.cfg
        dt = x.dtype
        q = dense(x, self.q_kernel[...].astype(dt), kernels=kernels) + self.q_bias[...].astype(dt)
        k = dense(x, self.k_kernel[...].astype(dt), kernels=kernels) + self.k_bias[...].astype(dt)
        v = dense(x, self.v_kernel[...].astype(dt), kernels=kernels) + self.v_bias[...].astype(dt)
        q = constrain(apply_rope(q, cos, sin), ("batch", "sequence", "heads", "head_dim"))
        k = apply_rope(k, cos, sin)

        b, t = x.shape[:2]
        g = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape(b, t, cfg.num_kv_heads, g, cfg.head_dim)
        own = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))  # [B, K, T, Dh]
        if kv is None:
            out = _attend(q, [own + (attn_mask,)])
        else:
            cache_k, cache_v = kv
            n_kv = cache_k.shape[1]
            # Index arrays broadcast to [B, T, K], the leading dims of k and v. Indexing the
            # heads explicitly (not with a slice) keeps this a scatter even for one row and one
            # token: XLA turns a single-window scatter into a dynamic-update-slice that it then
            # duplicates into the attention's reads, copying the whole buffer every step.
            rows = jnp.arange(b)[:, None, None]
            heads = jnp.arange(n_kv)[None, None, :]
            slots = (attn_mask.cache_len[:, None] + jnp.arange(t)[None, :])[:, :, None]
            # mode="drop": a slot past the buffer end is skipped, never clamped onto valid KV.
            cache_k = cache_k.at[rows, heads, slots].set(k.astype(cache_k.dtype), mode="drop")
            cache_v = cache_v.at[rows, heads, slots].set(v.astype(cache_v.dtype), mode="drop")
            kv = (cache_k, cache_v)
            out = _attend_cached(q, own, attn_mask.intra, kv, attn_mask.cache_len)
        out = out.reshape(b, t, cfg.num_heads, cfg.head_dim)
        out = dense(out, self.o_kernel[...].astype(dt), n_in=2, kernels=kernels)
        return out, kv


def _attend(q: jax.Array, blocks) -> jax.Array:
    """Softmax attention over several key/value blocks as if they were concatenated.

    q [B, T, K, G, Dh]; blocks: (keys [B, K, S_i, Dh], values [B, K, S_i, Dh], mask bool
    broadcastable to [B, T, S_i]). Returns [B, T, K, G, Dh]. One max and one normaliser over all
    blocks, so the result is the softmax over their union; no block is ever concatenated.

    The G query heads of a kv head and the T tokens form one [G*T] query axis, so each block is
    one batched [G*T, Dh] x [Dh, S_i] product and the softmax runs along its last axis as the
    product leaves it. (Contracting [B, T, K, G, Dh] directly, XLA:CPU transposed the scores for
    the softmax; this form was faster at every decode width and batch timed.)
    """
    dt = q.dtype
    t, g = q.shape[1], q.shape[3]
    q = _group_queries(q)
    scores = [_masked_scores(q, keys, mask, t, g) for keys, _, mask in blocks]
    top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
    probs = [jnp.exp(s - top) for s in scores]
    inv_norm = 1.0 / sum(jnp.sum(p, axis=-1, keepdims=True) for p in probs)
    out = sum(jnp.einsum("bkqs,bksd->bkqd", (p * inv_norm).astype(dt), values)
              for p, (_, values, _) in zip(probs, blocks))
    return _ungroup_queries(out, t, g)


def _group_queries(q: jax.Array) -> jax.Array:
    """[B, T, K, G, Dh] -> [B, K, G*T, Dh]: a kv head's G query heads and T tokens as one axis."""
    b, t, k, g, dh = q.shape
    return q.transpose(0, 2, 3, 1, 4).reshape(b, k, g * t, dh)


def _ungroup_queries(out: jax.Array, t: int, g: int) -> jax.Array:
    """[B, K, G*T, Dh] -> [B, T, K, G, Dh], the inverse of `_group_queries`."""
    b, k, _, dh = out.shape
    return out.reshape(b, k, g, t, dh).transpose(0, 3, 1, 2, 4)


def _masked_scores(q: jax.Array, keys: jax.Array, mask: jax.Array, t: int, g: int) -> jax.Array:
    """Scaled float32 scores [B, K, G*T, S_i] of grouped queries [B, K, G*T, Dh] against keys
    [B, K, S_i, Dh]; -huge where mask [B or 1, T, S_i] hides the key from the token."""
    s = jnp.einsum("bkqd,bksd->bkqs", q, keys).astype(jnp.float32) * q.shape[-1] ** -0.5
    mask = jnp.broadcast_to(mask[:, None], (mask.shape[0], g, t, keys.shape[2]))
    return jnp.where(mask.reshape(mask.shape[0], 1, g * t, -1), s, _NEG_INF)


# A KV buffer of at least 2 x CACHE_CHUNK slots is read in chunks, only as far as the batch's
# longest row: split evenly into chunks of at least CACHE_CHUNK slots (each step of the loop
# has a fixed cost; 128-slot chunks were slower at batch 1 on this CPU) and at most
# CACHE_CHUNKS_MAX of them (on an accelerator each chunk is a few kernel launches per layer). A
# shorter buffer is read in one pass. The slots a chunk saves reading grow with the batch while
# its cost does not, so on CPU from CPU_SHORT_CHUNK_ROWS rows per device up the chunks may be
# half as long (benchmarks/cache_chunks.md: the demo proposer at batch 16 with 200 of 384 slots
# filled, AR steps 1.24x and K=6,G=2 1.10x faster than with 256-slot chunks, about even in
# longer buffers; at batch 8 no gain in a scratch run).
# On a GPU every trip of a `while_loop` waits for its predicate on the host, once per layer per
# step for the chunk loop, so below GPU_CHUNKED_MIN_ROWS rows per device the buffer is read in
# one pass (benchmarks/h200/cache_chunks*.md, an H200, 200 of 4096 slots filled: at batch 1 one
# pass made the Qwen2.5-1.5B shape's AR step 1.38x and K=6,G=2 1.26x faster than chunks, the demo
# proposer's 1.90x / 1.59x; at batch 16 chunks beat one pass, 1.13x / 1.21x at 1.5B). A TPU
# runs the loop on the device and keeps the chunks (not measured).
CACHE_CHUNK = 256
CACHE_CHUNKS_MAX = 8
CPU_SHORT_CHUNK_ROWS = 16
GPU_CHUNKED_MIN_ROWS = 16


def cache_chunk(slots: int, rows: int = 1) -> int:
    """Slots per chunk of a KV buffer of `slots` read by `rows` batch rows on one device
    (== slots: read in one pass)."""
    backend = jax.default_backend()
    if backend == "gpu" and rows < GPU_CHUNKED_MIN_ROWS:
        return slots
    shortest = CACHE_CHUNK
    if rows >= CPU_SHORT_CHUNK_ROWS and backend == "cpu":
        shortest = CACHE_CHUNK // 2
    chunks = max(1, min(CACHE_CHUNKS_MAX, slots // shortest))
    return -(-slots // chunks)


def _attend_cached(q: jax.Array, own, intra: jax.Array, cache, cache_len: jax.Array) -> jax.Array:
    """`_attend` over a step's own keys/values and the committed slots [0, cache_len[b]) of a
    static KV buffer, reading a long buffer only up to the batch's longest row.

    The buffer is sized for the longest generation; early in a generation, or with short
    prompts, most of it is empty. Attending over all of it made the demo proposer's decode
    steps with 200 tokens committed 1.7-2.8x dearer at batch 16 in a 1024-slot buffer
    (`benchmarks/cache_chunks.md`), and on an accelerator every decode step would read the
    whole buffer from memory. So a long buffer's committed slots are visited a chunk
    (`cache_chunk`) at a time in a loop whose trip count follows the batch's longest row, with
    a running max and normaliser (the flash-attention recurrence). A chunk of masked slots
    changes nothing, bit for bit (its weights are exp(-huge) = 0 and the running max stays),
    so a row's result does not depend on the other rows' lengths.

    q [B, T, K, G, Dh]; own: (keys, values) [B, K, T, Dh]; intra bool [B or 1, T, T];
    cache: (keys, values) [B, K, S, Dh]; cache_len int32 [B]. Returns [B, T, K, G, Dh].
    """
    dt = q.dtype
    cache_k, cache_v = cache
    slots = cache_k.shape[2]
    # the rule is about one device's work: a batch sharded 2 ways reads half the rows each
    size = cache_chunk(slots, rows=rows_per_device(q.shape[0]))
    if size >= slots:  # one pass over the whole (short) buffer
        committed = jnp.arange(slots)[None, :] < cache_len[:, None]  # [B, S]
        return _attend(q, [(cache_k.astype(dt), cache_v.astype(dt), committed[:, None, :]),
                           own + (intra,)])
    t, g = q.shape[1], q.shape[3]
    q = _group_queries(q)

    def weighted(p, values):  # unnormalised weights [B, K, G*T, S_i] -> float32 [B, K, G*T, Dh]
        return jnp.einsum("bkqs,bksd->bkqd", p.astype(dt), values.astype(dt)).astype(jnp.float32)

    s = _masked_scores(q, own[0], intra, t, g)
    top = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - top)
    running = (top, jnp.sum(p, axis=-1, keepdims=True), weighted(p, own[1]))

    def visit(i, running):
        top, norm, acc = running
        # the last chunk may start earlier (the buffer need not divide into chunks); slots
        # an earlier chunk already visited are masked here
        start = jnp.minimum(i * size, slots - size)
        slot = start + jnp.arange(size)
        mask = (slot[None, :] >= i * size) & (slot[None, :] < cache_len[:, None])  # [B, size]
        keys = jax.lax.dynamic_slice_in_dim(cache_k, start, size, axis=2).astype(dt)
        values = jax.lax.dynamic_slice_in_dim(cache_v, start, size, axis=2)
        s = _masked_scores(q, keys, mask[:, None, :], t, g)
        new_top = jnp.maximum(top, jnp.max(s, axis=-1, keepdims=True))
        rescale = jnp.exp(top - new_top)
        p = jnp.exp(s - new_top)
        return (new_top, norm * rescale + jnp.sum(p, axis=-1, keepdims=True),
                acc * rescale + weighted(p, values))

    chunks = (jnp.max(cache_len) + size - 1) // size
    _, norm, acc = jax.lax.fori_loop(0, chunks, visit, running)
    return _ungroup_queries((acc / norm).astype(dt), t, g)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_kernel = _param(rngs, (f, d), ("mlp", "embed"), pd)
        self.up_kernel = _param(rngs, (f, d), ("mlp", "embed"), pd)
        self.down_kernel = _param(rngs, (d, f), ("embed", "mlp"), pd)

    def __call__(self, x, kernels: KernelOptions = DEFAULT_KERNELS):
        dt = x.dtype
        gate = dense(x, self.gate_kernel[...].astype(dt), kernels=kernels)
        up = dense(x, self.up_kernel[...].astype(dt), kernels=kernels)
        h = constrain(jax.nn.silu(gate) * up, ("batch", "sequence", "mlp"))
        return dense(h, self.down_kernel[...].astype(dt), kernels=kernels)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, attn_mask, kv=None, kernels: KernelOptions = DEFAULT_KERNELS):
        h, kv = self.attn(self.input_norm(x), cos, sin, attn_mask, kv, kernels)
        x = x + h
        x = x + self.mlp(self.post_attn_norm(x), kernels)
        return constrain(x, ("batch", "sequence", "embed")), kv


class Qwen2(nnx.Module):
    """Qwen2ForCausalLM. Parameter names follow HF's module tree so conversion is a flat table."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, remat: bool = False):
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.remat = remat
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)

    def hidden_states(self, tokens, positions, attn_mask, cache: KVCache | None = None,
                      kernels: KernelOptions = DEFAULT_KERNELS):
        """Final-norm hidden states [B, T, D] and the updated cache.

        attn_mask: bool [B, T, T] without a cache; a `StepMask` with one.
        """
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        # The table is split [vocab over tensor, embed over fsdp] like every weight; gathered
        # straight from that layout, the rows come out split over fsdp along embed while the
        # batch wants fsdp too, and GSPMD "involuntarily rematerialises" the whole [B, T, D]
        # activation on every device. Gathering the table over fsdp first, as FSDP does for
        # every other weight it uses, keeps the lookup a local gather plus a sum over tensor.
        table = constrain(self.embed[...], ("vocab", None))
        x = jnp.take(table, tokens, axis=0).astype(dt)
        x = constrain(x, ("batch", "sequence", "embed"))
        # Materialised once per forward: left to fusion, XLA:CPU recomputed cos/sin inside
        # every layer's rotary fusion, per element of q and k.
        cos, sin = jax.lax.optimization_barrier(rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta))
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            if self.remat and cache is None:
                x, kv = nnx.remat(lambda lyr, *a: lyr(*a, kernels=kernels))(layer, x, cos, sin, attn_mask)
            else:
                x, kv = layer(x, cos, sin, attn_mask, kv, kernels)
            if cache is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
        x = self.final_norm(x)
        return x, (None if cache is None else KVCache(k=tuple(new_k), v=tuple(new_v)))

    def logits(self, hidden: jax.Array, kernels: KernelOptions = DEFAULT_KERNELS) -> jax.Array:
        """LM head, float32 logits [..., V]."""
        dt = hidden.dtype
        w = self.embed if self.cfg.tie_word_embeddings else self.lm_head
        out = dense(hidden, w[...].astype(dt), kernels=kernels)
        return out.astype(jnp.float32)

    def __call__(self, tokens, positions, attn_mask, cache: KVCache | None = None,
                 kernels: KernelOptions = DEFAULT_KERNELS):
        """tokens, positions [B, T] int32; attn_mask bool [B, T, T] (no cache) or a StepMask.

        Returns (logits [B, T, V] float32, updated cache or None).
        """
        hidden, cache = self.hidden_states(tokens, positions, attn_mask, cache, kernels)
        return self.logits(hidden, kernels), cache


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """The greedy token at each position: logits [..., V] -> int32 [...], exactly `jnp.argmax`
    (the first index of the largest logit; a NaN counts as the largest, as there).

    Two plain reductions, the row maximum and then the smallest index that holds it (or holds a
    NaN), instead of argmax's single (value, index) reduction, which XLA:CPU does not vectorise:
    alone, 2-4.5x faster at 1 and 16 rows of 4K and 152K-token vocabularies
    (`benchmarks/argmax.md`). A decode step is mostly matmuls, so there the gain is small, within
    the run-to-run noise of the CPU it was measured on; exactness is what must not change
    (tests/test_greedy_tokens.py).
    """
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    holds_top = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(holds_top, index, logits.shape[-1] - 1), axis=-1)


def readable_tokens(tokens: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """(tokens with every id past a model's `vocab_size` embedding rows replaced by 0, bool mask
    of the ids it has rows for).

    Models that share a tokenizer can differ in padded rows: the paper's pair, Qwen2.5-32B and
    Qwen2.5-3B, has 152,064 and 151,936 rows for the same 151,665 ids. A token the proposer
    emits past the verifier's rows would gather NaN from its embedding (jnp.take fills out of
    range) and poison its KV cache; fed as 0 instead, the verifier stays finite, and the
    caller rejects what it could not read.
    """
    inside = tokens < vocab_size
    return jnp.where(inside, tokens, 0), inside


def causal_mask(batch: int, length: int, valid: jax.Array | None = None) -> jax.Array:
    """[B, T, T] causal mask; `valid` [B, T] hides padding keys."""
    m = jnp.tril(jnp.ones((length, length), bool))[None].repeat(batch, 0)
    if valid is not None:
        m = m & valid[:, None, :]
    return m
