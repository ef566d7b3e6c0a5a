"""Grouped-query attention under explicit masks, over a static KV cache read as far as it is filled.

Masks are explicit because MARS training and block decoding need non-causal ones. With a
`KVCache` the mask is a `StepMask`: queries attend to the committed slots and to the step's own
keys under one softmax, so no [B, T, S] mask is ever built.

One cache interface: an attention layer sees its part of any cache as a layer view, one of
`ContiguousKV` (a per-layer buffer), `LayerKV` (a layer of the stacked buffer a layer scan
carries) or `paged.PagedKV` (a layer of the paged pools), and calls only what they all provide:
`write(new_k, new_v, start)`, `read(start, size)`, `slots`, `page_size`, `rules` (where the
buffer lies: split over kv heads, or over rows where the tensor axis cannot split them) and
`kernel_cache()` / `kernel_reads` (what a shipped kernel reads, and whether it may). The whole
caches hand out those views (`KVCache.layer`, `.scanned_layer`; `PagedKVCache` likewise).

Shapes: B batch, T new tokens, S cache slots, D hidden, H query heads, K kv heads,
G = H // K query heads per kv head, Dh head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from prove_jax.models import attention_kernels
from prove_jax.models.config import ModelConfig
from prove_jax.models.initializers import param
from prove_jax.models.compute import DEFAULT_COMPUTE, LANES, ComputeOptions
from prove_jax.models.matmul import dense
from prove_jax.models.norm import RMSNorm
from prove_jax.models.sharding import (DEFAULT_RULES, KV_CACHE_AXES, constrain, kv_rules,
                                      logical_to_spec, rows_per_device, shard_shape,
                                      splits_evenly)

_NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)

# A long buffer is read in chunks up to the batch's longest row (`cache_chunk`): chunks of at
# least CACHE_CHUNK slots, at most CACHE_CHUNKS_MAX of them, half as long on CPU from
# CPU_SHORT_CHUNK_ROWS rows per device; on a GPU, where each trip waits on the host, one pass
# below GPU_CHUNKED_MIN_ROWS rows. See benchmarks/cache_chunks.md, benchmarks/h200/cache_chunks*.md.
CACHE_CHUNK = 256
CACHE_CHUNKS_MAX = 8
CPU_SHORT_CHUNK_ROWS = 16
GPU_CHUNKED_MIN_ROWS = 16


@struct.dataclass
class KVCache:
    """Static key/value buffers: per layer, k[i], v[i] [B, K, S, Dh] (heads-major, so attention
    reads each (row, kv head) as it lies; [B, S, K, Dh] was transposed on every step); or, for a
    model whose layers are one scanned `LayerStack`, one buffer each, k, v [B, K, L * S, Dh]:
    layer l's slots at [l * S, (l + 1) * S) (rows first, as every per-row state of the decode
    loop; then heads, so a layer's write is batched over rows and heads where they lie, as the
    per-layer write is). Layers and slots are one axis so that a layer's write and its reads
    index the same array: as [B, K, L, S, Dh], written at (layer, slot), libtpu laid the buffer
    out with the layers next to Dh and copied a layer's slice (or, read in place, the whole
    buffer) in every layer of every step; reshaped to flat slots to write, it copied the whole
    buffer when S was not a whole number of tiles (benchmarks/decode_step_cost.md).

    A stacked buffer whose head dim is under LANES (a 0.5B's 64) may be held slots minor, k, v
    [B, K, Dh, L * S] (`slots_minor`): held [.., L * S, Dh], libtpu lays a large one out with
    the slots minor anyway (so as not to pad Dh to 128 lanes) for the step's scatter, while the
    kernel read wants its operand as it is shaped, and copied the whole buffer between the two
    in every layer of every step; a small one it keeps head dim minor, and copies one shaped
    slots minor. Shaped as the scatter lays it out, the writer, the carry and the kernel agree:
    `ComputeOptions.kv_held_slots_minor` decides from the buffer's bytes a chip, on TPU only."""
    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array
    slots_minor: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, length: int, dtype=None,
              stacked: bool = False, compute: ComputeOptions = DEFAULT_COMPUTE,
              layout_rows: int | None = None) -> "KVCache":
        """An empty cache of `length` slots for `batch` rows: per layer, or `stacked` (one
        buffer, held as `compute` says for the size a chip of a cache of `layout_rows` rows,
        default `batch`, under the ambient mesh: admitted rows' caches are held as the batch's
        they join)."""
        dtype = jnp.dtype(config.dtype) if dtype is None else dtype
        shape = (batch, config.num_kv_heads, length, config.head_dim)
        # pinned under a mesh: rows on the batch axes, kv heads on tensor (KV_CACHE_AXES), or
        # rows on both where tensor cannot split the heads (`kv_rules`)
        rules = kv_rules(config.num_kv_heads, batch)
        slots_minor = False
        if stacked:
            shape = shape[:2] + (config.num_layers * length,) + shape[3:]
            rows = batch if layout_rows is None else layout_rows
            slots_minor = compute.kv_held_slots_minor(config.head_dim, _chip_bytes(
                (rows,) + shape[1:], jnp.dtype(dtype).itemsize,
                kv_rules(config.num_kv_heads, rows)))
            if slots_minor:
                shape = shape[:2] + (shape[3], shape[2])
            axes = cache_axes(stacked=True)
            mk = lambda: constrain(jnp.zeros(shape, dtype), axes, rules)  # noqa: E731
        else:
            zeros = lambda: constrain(jnp.zeros(shape, dtype), KV_CACHE_AXES, rules)  # noqa: E731
            mk = lambda: tuple(zeros() for _ in range(config.num_layers))  # noqa: E731
        return cls(k=mk(), v=mk(), slots_minor=slots_minor)

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    def layer(self, i: int) -> "ContiguousKV":
        """Layer i's view of a per-layer cache."""
        return ContiguousKV(self.k[i], self.v[i])

    def scanned_layer(self, k: jax.Array, v: jax.Array, index: jax.Array,
                      num_layers: int) -> "LayerKV":
        """Layer `index`'s view of the stacked buffers k, v a layer scan carries (this cache's own,
        as the scan has updated them so far)."""
        return LayerKV(k, v, index, num_layers, self.slots_minor)

    def slots_per_layer(self, num_layers: int) -> int:
        """Slots one layer of a row holds (`num_layers`: the model's, for a stacked buffer)."""
        first = self.k if self.stacked else self.k[0]
        slots = first.shape[-1] if self.slots_minor else first.shape[-2]
        return slots // (num_layers if self.stacked else 1)


def _chip_bytes(shape: tuple[int, ...], itemsize: int, rules) -> int:
    """Bytes of one chip's piece of a cache buffer of `shape` [B, K, S, Dh] laid out by `rules`
    under the ambient mesh (the whole buffer outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty and mesh.shape:
        shape = shard_shape(shape, logical_to_spec(KV_CACHE_AXES, shape, mesh, rules),
                            dict(mesh.shape))
    return math.prod(shape) * itemsize


def cache_axes(stacked: bool) -> tuple[str, ...]:
    """Logical axes of one cache buffer: KV_CACHE_AXES, per layer or stacked (the layers' slots
    one axis, split as a layer's slots are: not at all; held slots minor, the last two axes
    swap, both whole)."""
    return KV_CACHE_AXES


class _BufferView:
    """What the two views of a contiguous buffer k, v [B, K, ..., Dh] share."""

    @property
    def page_size(self) -> int:
        """Slots a read starts on a multiple of: any."""
        return 1

    @property
    def rules(self):
        """Where the buffer lies (`sharding.kv_rules` of its rows and kv heads)."""
        return kv_rules(self.k.shape[1], self.k.shape[0])

    @property
    def kernel_reads(self) -> bool:
        return True


@struct.dataclass
class ContiguousKV(_BufferView):
    """One layer's own buffers k, v [B, K, S, Dh] of a per-layer `KVCache`, as its attention
    layer sees them (the module docstring lists the interface)."""
    k: jax.Array
    v: jax.Array

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    def write(self, new_k: jax.Array, new_v: jax.Array, start: jax.Array) -> "ContiguousKV":
        """Row b's step keys and values new[b] [K, T, Dh] written at slots start[b] + [0, T)."""
        rules = self.rules
        return self.replace(k=write_step(self.k, new_k, start, rules=rules),
                            v=write_step(self.v, new_v, start, rules=rules))

    def read(self, start: jax.Array | int = 0,
             size: int | None = None) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, K, size, Dh] of slots [start, start + size) (default: all, the
        buffers as they lie)."""
        if size is None or size == self.slots:
            return self.k, self.v
        return (jax.lax.dynamic_slice_in_dim(self.k, start, size, axis=2),
                jax.lax.dynamic_slice_in_dim(self.v, start, size, axis=2))

    def kernel_cache(self) -> tuple[jax.Array, jax.Array]:
        """What `attention_kernels.attend_cached` reads: the buffers."""
        return self.k, self.v


@struct.dataclass
class LayerKV(_BufferView):
    """Layer `layer`'s part of a stacked cache k, v [B, K, L * S, Dh] (`slots_minor`: [B, K, Dh,
    L * S], see `KVCache`), as a scanned layer sees it: it writes its step's slots into the
    whole buffer (in place in the scan's carry) and reads its own layer's (the module docstring
    lists the interface)."""
    k: jax.Array
    v: jax.Array
    layer: jax.Array  # int32 scalar
    num_layers: int = struct.field(pytree_node=False, default=1)  # L
    slots_minor: bool = struct.field(pytree_node=False, default=False)

    @property
    def slots(self) -> int:
        """S: a layer's slots."""
        return self.k.shape[3 if self.slots_minor else 2] // self.num_layers

    def write(self, new_k: jax.Array, new_v: jax.Array, start: jax.Array) -> "LayerKV":
        """Row b's step keys and values written at this layer's slots start[b] + [0, T), into the
        whole stacked buffer (`write_step`)."""
        rules, layer, minor = self.rules, (self.layer, self.num_layers), self.slots_minor
        return self.replace(
            k=write_step(self.k, new_k, start, layer=layer, rules=rules, slots_minor=minor),
            v=write_step(self.v, new_v, start, layer=layer, rules=rules, slots_minor=minor))

    def read(self, start: jax.Array | int = 0,
             size: int | None = None) -> tuple[jax.Array, jax.Array]:
        """This layer's keys and values [B, K, size, Dh] of slots [start, start + size) (default:
        all), sliced from the stacked buffers directly: taken whole first, the layer was copied
        out of the buffer in every layer of every step (benchmarks/decode_step_cost.md)."""
        size = self.slots if size is None else size

        first = jnp.asarray(self.layer, jnp.int32) * self.slots + jnp.asarray(start, jnp.int32)
        if self.slots_minor:  # the slice, not the buffer, turned to [B, K, size, Dh]
            take = lambda c: jnp.swapaxes(  # noqa: E731
                jax.lax.dynamic_slice_in_dim(c, first, size, axis=3), 2, 3)
        else:
            take = lambda c: jax.lax.dynamic_slice_in_dim(c, first, size, axis=2)  # noqa: E731
        return take(self.k), take(self.v)

    def kernel_cache(self) -> "LayerKV":
        """What `attention_kernels.attend_cached` reads: the stacked buffers at this layer, in
        place."""
        return self


@struct.dataclass
class StepMask:
    """Row b's queries see its committed slots [0, cache_len[b]) and, of the step's own tokens
    (written at slots cache_len[b] + i), those `intra` allows. Slots past that are never seen."""
    cache_len: jax.Array  # [B] int32
    intra: jax.Array  # bool [B or 1, T, T]: may step token q attend step token k


def causal_mask(batch: int, length: int, valid: jax.Array | None = None) -> jax.Array:
    """[B, T, T] causal mask; `valid` [B, T] hides padding keys."""
    m = jnp.tril(jnp.ones((length, length), bool))[None].repeat(batch, 0)
    if valid is not None:
        m = m & valid[:, None, :]
    return m


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


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q_kernel = param(rngs, (h, dh, d), ("heads", "head_dim", "embed"), pd)
        self.k_kernel = param(rngs, (k, dh, d), ("kv_heads", "head_dim", "embed"), pd)
        self.v_kernel = param(rngs, (k, dh, d), ("kv_heads", "head_dim", "embed"), pd)
        self.o_kernel = param(rngs, (d, h, dh), ("embed", "heads", "head_dim"), pd)
        # the family's part (ModelConfig.model_type): qwen2's q/k/v biases, qwen3's q/k norms
        if cfg.attention_bias:
            self.q_bias = param(rngs, (h, dh), ("heads", "head_dim"), pd, init="zeros")
            self.k_bias = param(rngs, (k, dh), ("kv_heads", "head_dim"), pd, init="zeros")
            self.v_bias = param(rngs, (k, dh), ("kv_heads", "head_dim"), pd, init="zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(dh, cfg.rms_norm_eps, pd, rngs, axis="head_dim")
            self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, pd, rngs, axis="head_dim")

    def __call__(self, x, cos, sin, attn_mask, kv=None, compute: ComputeOptions = DEFAULT_COMPUTE):
        """x [B,T,D]; attn_mask bool [B,T,T] without a cache, a StepMask with kv, a layer view of
        a cache (`ContiguousKV`, `LayerKV` or `PagedKV`). Returns (output, the view written)."""
        cfg = self.cfg
        dt = x.dtype
        # checkpoint names: what a remat policy may keep (models/remat.py); identity otherwise
        q = dense(x, self.q_kernel[...].astype(dt), compute=compute)
        k = dense(x, self.k_kernel[...].astype(dt), compute=compute)
        v = dense(x, self.v_kernel[...].astype(dt), compute=compute)
        if cfg.attention_bias:
            biases = (self.q_bias, self.k_bias, self.v_bias)
            q, k, v = (y + b[...].astype(dt) for y, b in zip((q, k, v), biases))
        q, k = checkpoint_name(q, "q_proj"), checkpoint_name(k, "k_proj")
        v = checkpoint_name(v, "v_proj")
        # Qwen3: each head over head_dim, before RoPE, as transformers' Qwen3Attention
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(apply_rope(q, cos, sin), ("batch", "sequence", "heads", "head_dim"))
        k = apply_rope(k, cos, sin)

        b, t = x.shape[:2]
        g = cfg.num_heads // cfg.num_kv_heads
        # a contiguous cache whose heads the tensor axis cannot split is read split over rows:
        # the queries move there (an all-to-all of the step's activations, not of the cache)
        rules = DEFAULT_RULES if kv is None else kv.rules
        longest = None
        if rules is not DEFAULT_RULES:
            # the chunked read's bound, taken where the rows lie whole: over rows split across
            # tensor it is an all-reduce in every layer (benchmarks/decode_tpu_compile.md)
            longest = jnp.max(attn_mask.cache_len)
            q, k, v = (_to_rows(x, ("batch", "sequence", axis, "head_dim"), rules)
                       for x, axis in ((q, "heads"), (k, "kv_heads"), (v, "kv_heads")))
            attn_mask = StepMask(_to_rows(attn_mask.cache_len, ("batch",), rules),
                                 attn_mask.intra if attn_mask.intra.shape[0] == 1
                                 else _to_rows(attn_mask.intra, ("batch", None, None), rules))
        q = q.reshape(b, t, cfg.num_kv_heads, g, cfg.head_dim)
        own = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))  # [B, K, T, Dh]
        if kv is None:
            out = _attend(q, [own + (attn_mask,)])
        else:
            start = attn_mask.cache_len
            kv = kv.write(own[0], own[1], start)
            # in XLA: a view of admitted rows (their prefill; its rows lie on any shard), and kv
            # heads the mesh cannot split left whole (rows too few to split over tensor): GSPMD
            # splits such a cache like the query heads, and a per-device kernel would gather all
            # of it on every call (benchmarks/paged_kv_pair.md)
            if (compute.attention == "xla" or not kv.kernel_reads
                    or rules is DEFAULT_RULES and not splits_evenly("kv_heads", cfg.num_kv_heads)):
                out = _attend_cached(q, own, attn_mask.intra, kv, start, compute.target(), rules,
                                     longest)
            else:  # the one dispatch point to a shipped kernel (models/attention_kernels.py)
                out = _attend_cached_kernel(q, own, attn_mask.intra, kv.kernel_cache(), start,
                                            compute, rules)
        out = out.reshape(b, t, cfg.num_heads, cfg.head_dim)
        if rules is not DEFAULT_RULES:  # back to the heads the output projection's kernel holds
            out = constrain(constrain(out, ("batch", "sequence", "heads", "head_dim"), rules),
                            ("batch", "sequence", "heads", "head_dim"))
        out = dense(out, self.o_kernel[...].astype(dt), n_in=2, compute=compute)
        out = checkpoint_name(out, "o_proj")
        return out, kv


def _to_rows(x: jax.Array, axes: tuple, rules) -> jax.Array:
    """`x` pinned where the model computes it (`DEFAULT_RULES`), then moved to `rules`' layout:
    pinned on both sides, GSPMD slices it there instead of carrying the row split back into
    the code that made it (whose other readers then gathered it back)."""
    return constrain(constrain(x, axes), axes, rules)


def write_step(cache: jax.Array, new: jax.Array, start: jax.Array, layer: tuple | None = None,
               rules=DEFAULT_RULES, slots_minor: bool = False) -> jax.Array:
    """cache [B, K, S, Dh] with row b's step keys (or values) new[b] [K, T, Dh] written at slots
    start[b] + [0, T); a slot past the buffer end is dropped, never clamped onto valid KV. With
    `layer` (l, L), cache is a stacked [B, K, L * S, Dh] and the step goes to layer l's slots.

    Written per (row, kv head) (vmapped): rows and heads are the scatter's batching dimensions,
    so on a mesh each device writes the rows and heads it holds, where they lie (explicit row
    and head indices made GSPMD all-gather the step's keys, values and indices in every layer).
    A one-token step also writes a second, dropped slot (S + start): XLA turns a scatter of a
    single window (one row, one head, one token on a device) into an update-slice that it
    duplicates into the cache's readers, copying the buffer on every step
    (tests/decoding/test_decode_in_place.py, tests/decoding/test_inference_mesh.py).
    `rules`: where the cache lies (`sharding.kv_rules`). `slots_minor`: the cache is [B, K, Dh,
    S] (`KVCache`), each slot a column.
    """
    b, k, t, _ = new.shape
    new = constrain(new, KV_CACHE_AXES, rules)  # where the cache lies
    slots = start[:, None] + jnp.arange(t, dtype=start.dtype)  # [B, T]
    size = cache.shape[-1 if slots_minor else -2] // (1 if layer is None else layer[1])
    if t == 1:
        slots = jnp.concatenate([slots, start[:, None] + size], axis=1)
        new = jnp.concatenate([new, new], axis=2)
    slots = jnp.broadcast_to(slots[:, None], (b, k, slots.shape[1]))
    if slots_minor:  # [Dh, S] <- [T, Dh] at [T], as columns
        write = lambda c, u, s: c.at[:, s].set(u.T.astype(c.dtype), mode="drop")  # noqa: E731
    else:  # [S, Dh] <- [T, Dh] at [T]
        write = lambda c, u, s: c.at[s].set(u.astype(c.dtype), mode="drop")  # noqa: E731
    # layer l's slot s is l * S + s; one past S is dropped, not the next layer's
    if layer is not None:
        index, n_layers = layer
        slots = jnp.where(slots < size, index * size + slots, n_layers * size)
    return constrain(jax.vmap(jax.vmap(write))(cache, new, slots), KV_CACHE_AXES, rules)


def _attend(q: jax.Array, blocks) -> jax.Array:
    """Softmax attention over key/value blocks as if concatenated: one max, one normaliser.

    q [B, T, K, G, Dh]; blocks: (keys, values [B, K, S_i, Dh], mask broadcastable to [B, T, S_i]).
    Returns [B, T, K, G, Dh]. Queries are grouped [B, K, G*T, Dh] so the softmax runs along the
    product's last axis (ungrouped, XLA:CPU transposed the scores: slower at every width timed).
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
    s = jnp.einsum("bkqd,bksd->bkqs", q, keys, preferred_element_type=jnp.float32)
    s = s * q.shape[-1] ** -0.5
    mask = jnp.broadcast_to(mask[:, None], (mask.shape[0], g, t, keys.shape[2]))
    return jnp.where(mask.reshape(mask.shape[0], 1, g * t, -1), s, _NEG_INF)


def _attend_cached_kernel(q, own, intra, cache, cache_len, compute: ComputeOptions,
                          rules=DEFAULT_RULES) -> jax.Array:
    """`_attend_cached` with the committed span read by `kernels.attention`'s kernel, on each
    device's rows and kv heads as `rules` lay them."""
    t, g = q.shape[1], q.shape[3]
    grouped = _group_queries(q)
    own_scores = _masked_scores(grouped, own[0], intra, t, g)
    out = attention_kernels.attend_cached(compute.attention, grouped, own_scores, own[1], cache,
                                          cache_len, interpret=compute.interpret,
                                          platform=compute.target(), rules=rules)
    return _ungroup_queries(out.astype(q.dtype), t, g)


def cache_chunk(slots: int, rows: int = 1, platform: str | None = None) -> int:
    """Slots per chunk of a KV buffer of `slots` read by `rows` batch rows on one device
    (== slots: read in one pass), on `platform` (None: jax's default backend)."""
    backend = platform or jax.default_backend()
    if backend == "gpu" and rows < GPU_CHUNKED_MIN_ROWS:
        return slots
    shortest = CACHE_CHUNK
    if rows >= CPU_SHORT_CHUNK_ROWS and backend == "cpu":
        shortest = CACHE_CHUNK // 2
    chunks = max(1, min(CACHE_CHUNKS_MAX, slots // shortest))
    return -(-slots // chunks)


def _attend_cached(q: jax.Array, own, intra: jax.Array, cache, cache_len: jax.Array,
                   platform: str | None = None, rules=DEFAULT_RULES,
                   longest: jax.Array | None = None) -> jax.Array:
    """`_attend` over a step's own keys/values and the committed slots of a static buffer, which
    is sized for the longest generation: a long one is read a chunk (`cache_chunk`) at a time up
    to the longest row, with a running max and normaliser (the flash-attention recurrence). A
    masked chunk changes nothing bit for bit, so a row's result ignores the other rows' lengths.

    q [B, T, K, G, Dh]; own: (keys, values) [B, K, T, Dh]; intra bool [B or 1, T, T];
    cache: a layer view (`ContiguousKV`, `LayerKV`, a `PagedKV` read in chunks of whole pages),
    or (keys, values) [B, K, S, Dh]; cache_len int32 [B]; `rules`: how the rows split
    (`sharding.kv_rules`); `longest`: max(cache_len) if the caller has it (default: taken here).
    Returns [B, T, K, G, Dh].
    """
    dt = q.dtype
    if isinstance(cache, tuple):  # bare buffers, as tests and benchmarks pass them
        cache = ContiguousKV(*cache)
    slots, page = cache.slots, cache.page_size
    read = cache.read
    if rules is DEFAULT_RULES and not splits_evenly("kv_heads", q.shape[2]):
        # kv heads the mesh leaves whole while it splits the queries: each read pinned whole, as
        # the cache lies, so GSPMD splits the head out of the slots read, not out of the whole
        # stacked buffer before the chunk loop (a copy of it in every layer of every step,
        # benchmarks/decode_step_cost.md)
        read = lambda start, size: tuple(  # noqa: E731
            constrain(x, KV_CACHE_AXES, rules) for x in cache.read(start, size))
    # the rule is about one device's work: a batch sharded 2 ways reads half the rows each
    size = cache_chunk(slots, rows=rows_per_device(q.shape[0], rules), platform=platform)
    size = min(slots, -(-size // page) * page)
    if size >= slots:  # one pass over the whole (short) buffer
        keys, values = read(0, slots)
        committed = jnp.arange(slots)[None, :] < cache_len[:, None]  # [B, S]
        spans = [(keys.astype(dt), values.astype(dt), committed[:, None, :]), own + (intra,)]
        return _attend(q, spans)
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
        keys, values = read(start, size)
        s = _masked_scores(q, keys.astype(dt), mask[:, None, :], t, g)
        new_top = jnp.maximum(top, jnp.max(s, axis=-1, keepdims=True))
        rescale = jnp.exp(top - new_top)
        p = jnp.exp(s - new_top)
        return (new_top, norm * rescale + jnp.sum(p, axis=-1, keepdims=True),
                acc * rescale + weighted(p, values))

    chunks = ((jnp.max(cache_len) if longest is None else longest) + size - 1) // size
    _, norm, acc = jax.lax.fori_loop(0, chunks, visit, running)
    return _ungroup_queries((acc / norm).astype(dt), t, g)
