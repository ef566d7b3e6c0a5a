"""Function-preserving inflation: a model embedded in a larger Qwen2 shape, same outputs.

Why: a decode step's cost depends on the model's shape, its acceptance on what the proposer
learned. The shipped demo proposer is trained but tiny (its weights stay in the CPU's cache);
inflated, it keeps its acceptance at a real shape's cost, bound by weight reads as proposers
are (`prove-jax benchmark --inflate`). Every extra weight is zero, so the logits are the same
up to float rounding.

How each part stays exact (D -> D' hidden, F -> F' MLP, H/K -> H'/K' heads, L -> L' layers):
- hidden: the extra embedding columns are zero, and every weight writing the residual stream
  (o, down) has zero rows there, so the residual's extra dims stay zero. RMSNorm then averages
  x^2 over D' dims instead of D: mean' = (D/D') mean, so with eps' = eps D/D' and the norm
  weights scaled by sqrt(D/D') each norm returns exactly what it did.
- MLP: extra gate/up rows are zero, silu(0) * 0 = 0, and the extra down columns are zero.
- heads: source kv head j is target kv head j; its G query heads are the first G of target
  group j. Every other query head has zero q weights and zero o columns, every other kv head
  zero k/v weights: they compute attention whose output the zero o columns drop.
- head_dim Dh -> Dh': RoPE rotates dim i with dim i + Dh/2 at frequency theta^(-2i/Dh). With
  theta' = theta^(Dh'/Dh), target frequency i is theta'^(-2i/Dh') = theta^(-2i/Dh), the
  source's, so the source's q/k dims i and i + Dh/2 go to target dims i and i + Dh'/2 and the
  rest are zero. The softmax scale 1/sqrt(Dh') is undone by scaling q by sqrt(Dh'/Dh). v uses
  the leading Dh dims, o the matching columns. (The frequencies are recomputed in float32 from
  theta', so this part is exact only up to a rounding of the RoPE phases.)
- layers: the extra layers (after the source's) have zero o and down weights, so they add
  exactly zero to the residual; their other weights are zero too.
The vocabulary and special tokens stay the source's: the tokenizer must keep working.
A qwen3 model (per-head q/k RMSNorm) inflates with its head_dim kept: the norm of a zero head is
zero, so the extra heads stay silent, but over Dh' dims the norm would see other mean squares.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from prove_jax.models.config import ConfigError, ModelConfig
from prove_jax.models.qwen2 import Qwen2
from prove_jax.models.params import abstract_model, flat_params, set_flat_params

SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim")


def inflated_config(src: ModelConfig, shape: ModelConfig) -> ModelConfig:
    """src with `shape`'s sizes (SHAPE_FIELDS), and the eps and RoPE theta that keep its function
    (see the module docstring)."""
    problems = [f"{f} {getattr(shape, f)} < {getattr(src, f)}" for f in SHAPE_FIELDS
                if getattr(shape, f) < getattr(src, f)]
    if src.qk_norm and shape.head_dim != src.head_dim:
        problems.append(f"head_dim {shape.head_dim} != {src.head_dim} (a {src.model_type} model's "
                        f"per-head q/k norm averages over head_dim)")
    if shape.head_dim % 2:
        problems.append(f"head_dim {shape.head_dim} is odd (RoPE rotates dims in pairs)")
    src_group, group = src.num_heads // src.num_kv_heads, shape.num_heads // shape.num_kv_heads
    if group < src_group:
        problems.append(f"query heads per kv head {group} < {src_group}")
    if problems:
        raise ConfigError("cannot inflate the model into this shape: " + "; ".join(problems))
    # the shape's context length too: RoPE has no limit of its own, and long-context timing needs
    # it (past the source's trained length the outputs are its extrapolation)
    return src.replace(
        **{f: getattr(shape, f) for f in SHAPE_FIELDS},
        max_position_embeddings=max(src.max_position_embeddings, shape.max_position_embeddings),
        rms_norm_eps=src.rms_norm_eps * src.hidden_size / shape.hidden_size,
        rope_theta=src.rope_theta ** (shape.head_dim / src.head_dim))


def _embed(a: np.ndarray, shape: tuple[int, ...], index: tuple = ()) -> np.ndarray:
    """zeros(shape) with a written at `index` (one entry per axis: an index array, or None for
    the leading a.shape[axis] entries)."""
    index = tuple(index) + (None,) * (a.ndim - len(index))
    out = np.zeros(shape, a.dtype)
    out[np.ix_(*[np.arange(n) if i is None else i for i, n in zip(index, a.shape)])] = a
    return out


def inflate(model: Qwen2, shape: ModelConfig) -> Qwen2:
    """A model of `inflated_config(model.cfg, shape)` computing what `model` computes."""
    src = model.cfg
    cfg = inflated_config(src, shape)
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    g_src, g = src.num_heads // src.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    # Target index of each source query head: kv group j, slot s -> j * g + s.
    q_heads = np.array([(h // g_src) * g + h % g_src for h in range(src.num_heads)])
    norm_scale = np.float32(np.sqrt(src.hidden_size / d))
    half = src.head_dim // 2  # q/k dims i, i + half -> i, i + dh/2 (see module docstring)
    rope_dims = np.concatenate([np.arange(half), dh // 2 + np.arange(half)])
    q_scale = np.float32(np.sqrt(dh / src.head_dim))

    old = {k: np.asarray(v) for k, v in flat_params(model).items()}
    new = {"embed": _embed(old["embed"], (cfg.vocab_size, d)),
           "final_norm.weight": _embed(old["final_norm.weight"] * norm_scale, (d,))}
    if not cfg.tie_word_embeddings:
        new["lm_head"] = _embed(old["lm_head"], (cfg.vocab_size, d))
    dtype = old["embed"].dtype
    h, kv = cfg.num_heads, cfg.num_kv_heads
    for i in range(src.num_layers):  # the layers past these are identity layers, filled in below
        p = f"layers.{i}."
        for norm in ("input_norm", "post_attn_norm"):
            new[p + norm + ".weight"] = _embed(old[p + norm + ".weight"] * norm_scale, (d,))
        a = p + "attn."
        new[a + "q_kernel"] = _embed(old[a + "q_kernel"] * q_scale, (h, dh, d),
                                     (q_heads, rope_dims))
        # source kv head j is target kv head j
        new[a + "k_kernel"] = _embed(old[a + "k_kernel"], (kv, dh, d), (None, rope_dims))
        new[a + "v_kernel"] = _embed(old[a + "v_kernel"], (kv, dh, d))
        if src.attention_bias:
            new[a + "q_bias"] = _embed(old[a + "q_bias"] * q_scale, (h, dh), (q_heads, rope_dims))
            new[a + "k_bias"] = _embed(old[a + "k_bias"], (kv, dh), (None, rope_dims))
            new[a + "v_bias"] = _embed(old[a + "v_bias"], (kv, dh))
        if src.qk_norm:  # head_dim unchanged (inflated_config): the same weights
            new[a + "q_norm.weight"] = old[a + "q_norm.weight"]
            new[a + "k_norm.weight"] = old[a + "k_norm.weight"]
        new[a + "o_kernel"] = _embed(old[a + "o_kernel"], (d, h, dh), (None, q_heads))
        new[p + "mlp.gate_kernel"] = _embed(old[p + "mlp.gate_kernel"], (f, d))
        new[p + "mlp.up_kernel"] = _embed(old[p + "mlp.up_kernel"], (f, d))
        new[p + "mlp.down_kernel"] = _embed(old[p + "mlp.down_kernel"], (d, f))
    inflated = abstract_model(cfg)
    for name, leaf in flat_params(inflated).items():
        if name not in new:  # an identity layer's: zero weights (norms: anything finite)
            new[name] = (np.ones if name.endswith("norm.weight") else np.zeros)(leaf.shape, dtype)
    # the scaled norms and q weights came out float32 (a bfloat16 array times a float32 factor):
    # every weight in the source dtype, as the config says
    set_flat_params(inflated, {k: jnp.asarray(v, dtype=dtype) for k, v in new.items()})
    return inflated
