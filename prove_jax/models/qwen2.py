"""Qwen2 / Qwen2.5 and Qwen3 (dense) decoder in flax.nnx: one decoder, the family a switch of the
config (`ModelConfig.model_type`: q/k/v biases for qwen2, per-head q/k RMSNorm for qwen3, both in
`attention.Attention`).

Callers pass token ids, position ids and an explicit mask (`attention.py`): a bool [B, T, T]
mask without a cache, a `StepMask` with a `KVCache`. Weights keep HF's [out, in] order, heads
split out, so conversion is a reshape (`matmul.dense` multiplies them).

Shapes: B batch, T new tokens, D hidden, H query heads, K kv heads, Dh head dim, F mlp width,
V vocab. Weights: q [H, Dh, D], k/v [K, Dh, D], o [D, H, Dh], gate/up [F, D], down [D, F],
embed and lm_head [V, D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from prove_jax.models.attention import Attention, KVCache, rope_cos_sin
from prove_jax.models.paged import PagedKVCache
from prove_jax.models.config import ModelConfig
from prove_jax.models.initializers import param
from prove_jax.models.compute import DEFAULT_COMPUTE, ComputeOptions
from prove_jax.models.matmul import dense
from prove_jax.models.norm import RMSNorm
from prove_jax.models.remat import remat_name, with_remat
from prove_jax.models.sharding import constrain


class Qwen2(nnx.Module):
    """Qwen2ForCausalLM or Qwen3ForCausalLM, as `cfg.model_type` says. Parameter names follow HF's
    module tree so conversion is a flat table."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, remat: str | bool = "none",
                 scan_layers: bool = False):
        """`remat` (a `models.remat` policy name) and `scan_layers` shape only the training
        forward (no cache); they are static, so a changed choice is a new compile."""
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.remat = remat_name(remat)
        self.scan_layers = bool(scan_layers)
        self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)

    def __call__(self, tokens, positions, attn_mask, cache: KVCache | None = None,
                 compute: ComputeOptions = DEFAULT_COMPUTE):
        """tokens, positions [B, T] int32; attn_mask bool [B, T, T] (no cache) or a StepMask.

        Returns (logits [B, T, V] float32, updated cache or None).
        """
        hidden, cache = self.hidden_states(tokens, positions, attn_mask, cache, compute)
        return self.logits(hidden, compute), cache

    def hidden_states(self, tokens, positions, attn_mask,
                      cache: KVCache | PagedKVCache | None = None,
                      compute: ComputeOptions = DEFAULT_COMPUTE):
        """Final-norm hidden states [B, T, D] and the updated cache (a contiguous `KVCache` or a
        `PagedKVCache`, per layer or stacked as the layers are)."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        # Gather the table over fsdp first, as FSDP does for every weight: looked up straight from
        # its [vocab/tensor, embed/fsdp] layout, GSPMD rematerialises the whole [B, T, D]
        # activation.
        table = constrain(self.embed[...], ("vocab", None))
        x = jnp.take(table, tokens, axis=0).astype(dt)
        x = constrain(x, ("batch", "sequence", "embed"))
        # Materialised once per forward: left to fusion, XLA:CPU recomputed cos/sin in every
        # layer.
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        cos, sin = jax.lax.optimization_barrier((cos, sin))
        if cache is None:
            x = self._training_layers(x, cos, sin, attn_mask, compute)
            return self.final_norm(x), None
        if isinstance(self.layers, LayerStack):
            x, cache = self.layers.scan_cached(x, cos, sin, attn_mask, cache, compute)
            return self.final_norm(x), cache
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, attn_mask, cache.layer(i), compute)
            new_k.append(kv.k)
            new_v.append(kv.v)
        x = self.final_norm(x)
        return x, cache.replace(k=tuple(new_k), v=tuple(new_v))

    @property
    def layers_stacked(self) -> bool:
        """The layers are one `LayerStack` (`stack_layers`): a cached forward scans them and
        takes a stacked `KVCache`."""
        return isinstance(self.layers, LayerStack)

    def new_cache(self, batch: int, length: int, compute: ComputeOptions = DEFAULT_COMPUTE,
                  layout_rows: int | None = None) -> KVCache:
        """An empty KV cache of `length` slots for `batch` rows in this model's layer layout
        (a stacked one held as `compute` says for a cache of `layout_rows` rows, default
        `batch`: `ComputeOptions.kv_slots_minor`, `KVCache.zeros`)."""
        return KVCache.zeros(self.cfg, batch, length, stacked=self.layers_stacked,
                             compute=compute, layout_rows=layout_rows)

    def _training_layers(self, x, cos, sin, attn_mask, compute: ComputeOptions):
        """The layers without a cache, each under the remat policy: unrolled, or (scan_layers)
        one `lax.scan` over their parameters stacked along a leading "layers" axis, so XLA
        optimises one layer's program, not num_layers copies (at 32B: 40% less peak memory,
        benchmarks/tpu_compile.md). The stack is built here, per step, from the
        per-layer parameters: checkpoints, conversion and decoding keep one entry per layer,
        and the scan's gradient comes back per layer through the stack's transpose."""
        if isinstance(self.layers, LayerStack):
            raise ValueError("a model with stacked layers (stack_layers) decodes only; "
                             "train the per-layer model")
        graphdef = nnx.graphdef(self.layers[0])

        def layer_fn(state, x, cos, sin, attn_mask):
            y, _ = nnx.merge(graphdef, state)(x, cos, sin, attn_mask, None, compute)
            return y

        if not self.scan_layers:
            layer_fn = with_remat(layer_fn, self.remat)
            for layer in self.layers:
                x = layer_fn(nnx.state(layer), x, cos, sin, attn_mask)
            return x
        layer_fn = with_remat(layer_fn, self.remat, prevent_cse=False)
        states = [nnx.state(layer) for layer in self.layers]
        stacked = jax.tree.map(lambda *v: jnp.stack(v), *states)
        stacked = jax.tree.map(  # each stacked weight sharded as one layer's, "layers" replicated
            lambda v: v.replace(constrain(v.get_value(), ("layers",) + tuple(v.logical_axes))),
            stacked, is_leaf=lambda v: isinstance(v, nnx.Variable))

        def body(x, state):
            return layer_fn(state, x, cos, sin, attn_mask), None

        x, _ = jax.lax.scan(body, x, stacked)
        return x

    def logits(self, hidden: jax.Array, compute: ComputeOptions = DEFAULT_COMPUTE) -> jax.Array:
        """LM head, float32 logits [..., V], accumulated in float32 whatever the compute dtype
        (rounded to bfloat16, logits tie exactly at the top at about 2% of positions)."""
        dt = hidden.dtype
        w = self.embed if self.cfg.tie_word_embeddings else self.lm_head
        return dense(hidden, w[...].astype(dt), compute=compute, out_dtype=jnp.float32)


class LayerStack(nnx.Module):
    """The decoder layers as one `DecoderLayer` whose weights carry a leading "layers" axis: a
    cached forward runs them as one `lax.scan`, so the decode program holds one layer's code
    whatever the depth (benchmarks/decode_compile.md)."""

    def __init__(self, layer: DecoderLayer, num_layers: int):
        self.layer = layer
        self.num_layers = num_layers

    def scan_cached(self, x, cos, sin, attn_mask, cache: KVCache | PagedKVCache,
                    compute: ComputeOptions):
        """x through every layer; the stacked cache (or stacked paged pools) is carried and each
        layer writes only its step's slots in place (a cache passed as the scan's xs/ys would be
        rebuilt every step)."""
        graphdef, weights = nnx.split(self.layer)

        def body(carry, xs):
            x, k, v = carry
            state, index = xs
            kv = cache.scanned_layer(k, v, index, self.num_layers)
            x, kv = nnx.merge(graphdef, state)(x, cos, sin, attn_mask, kv, compute)
            return (x, kv.k, kv.v), None

        index = jnp.arange(self.num_layers, dtype=jnp.int32)
        (x, k, v), _ = jax.lax.scan(body, (x, cache.k, cache.v), (weights, index))
        return x, cache.replace(k=k, v=v)


def _stack(*values):
    return jnp.stack(values)


def stack_layers(model: Qwen2) -> Qwen2:
    """A model sharing `model`'s weights but its layers stacked into one `LayerStack` (new
    arrays: the per-layer ones stay `model`'s). Works on an abstract model (`nnx.eval_shape`).
    Each stacked weight is sharded as one layer's, its "layers" axis whole."""
    graphdef, state = nnx.split(model)
    stacked_model = nnx.merge(graphdef, state)
    layers = list(stacked_model.layers)
    layer_def = nnx.graphdef(layers[0])

    def stack(*variables):
        first = variables[0]
        values = [v.get_value() for v in variables]
        sharding = getattr(values[0], "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            spec = jax.sharding.PartitionSpec(None, *sharding.spec)
            out = jax.sharding.NamedSharding(sharding.mesh, spec)
            value = jax.jit(_stack, out_shardings=out)(*values)
        else:
            value = jnp.stack(values)
        axes = getattr(first, "logical_axes", None)
        named = {} if axes is None else {"logical_axes": ("layers",) + tuple(axes)}
        return first.replace(value, **named)

    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    stacked = jax.tree.map(stack, *[nnx.state(layer) for layer in layers], is_leaf=is_var)
    stacked_model.layers = LayerStack(nnx.merge(layer_def, stacked), len(layers))
    return stacked_model


def unstack_layers(model: Qwen2) -> Qwen2:
    """The inverse of `stack_layers`: a model with one `DecoderLayer` per layer (new arrays)."""
    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, state)
    layer_def, stacked = nnx.split(out.layers.layer)

    def layer(i):
        def take(v):
            axes = getattr(v, "logical_axes", None)
            named = {} if axes is None else {"logical_axes": tuple(axes)[1:]}
            return v.replace(v.get_value()[i], **named)
        is_variable = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
        return nnx.merge(layer_def, jax.tree.map(take, stacked, is_leaf=is_variable))

    out.layers = nnx.List([layer(i) for i in range(out.layers.num_layers)])
    return out


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, attn_mask, kv=None, compute: ComputeOptions = DEFAULT_COMPUTE):
        h, kv = self.attn(self.input_norm(x), cos, sin, attn_mask, kv, compute)
        x = x + h
        x = x + self.mlp(self.post_attn_norm(x), compute)
        return constrain(x, ("batch", "sequence", "embed")), kv


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_kernel = param(rngs, (f, d), ("mlp", "embed"), pd)
        self.up_kernel = param(rngs, (f, d), ("mlp", "embed"), pd)
        self.down_kernel = param(rngs, (d, f), ("embed", "mlp"), pd)

    def __call__(self, x, compute: ComputeOptions = DEFAULT_COMPUTE):
        dt = x.dtype
        gate = dense(x, self.gate_kernel[...].astype(dt), compute=compute)
        gate = checkpoint_name(gate, "gate_proj")
        up = checkpoint_name(dense(x, self.up_kernel[...].astype(dt), compute=compute), "up_proj")
        h = constrain(jax.nn.silu(gate) * up, ("batch", "sequence", "mlp"))
        down = dense(h, self.down_kernel[...].astype(dt), compute=compute)
        return checkpoint_name(down, "down_proj")

