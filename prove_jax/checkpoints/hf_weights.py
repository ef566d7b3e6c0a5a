"""The one table between HF Qwen2/Qwen3 tensor names/layouts and our parameter tree.

Each rule: an HF name regex, our path template, the HF shape expected (from the config), and a
numpy transform; a family's own tensors (qwen2's q/k/v biases, qwen3's q/k norms) only in
configs of that family. Both directions use the same rules, so a key or layout fix is made once.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterator

import numpy as np

from prove_jax.errors import ProveJaxError
from prove_jax.models.config import ModelConfig


class WeightError(ProveJaxError, ValueError):
    """A tensor that does not fit the model: unmapped, missing, duplicate or misshapen."""


@dataclasses.dataclass(frozen=True)
class _Rule:
    hf: str  # regex with an optional (?P<i>\d+) layer group
    ours: str  # dotted path template with {i}
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
    applies: Callable[[ModelConfig], bool] = lambda cfg: True  # the families that have the tensor


def _unchanged(x, cfg):
    return x


# Our kernels keep HF's (torch's) [out, in] order, so every transform is a reshape: HF flattens
# the head axes that we keep apart (q/k/v [N*Dh, D] <-> [N, Dh, D], o [D, H*Dh] <-> [D, H, Dh]).
def _split_heads(heads_of):  # HF [N*Dh, ...] -> ours [N, Dh, ...]
    return lambda x, cfg: x.reshape(heads_of(cfg), cfg.head_dim, *x.shape[1:])


def _merge_heads(x, cfg):  # ours [N, Dh, ...] -> HF [N*Dh, ...]
    return x.reshape(-1, *x.shape[2:])


def _split_o_heads(x, cfg):  # HF [D, H*Dh] -> ours [D, H, Dh]
    return x.reshape(cfg.hidden_size, cfg.num_heads, cfg.head_dim)


def _merge_o_heads(x, cfg):  # ours [D, H, Dh] -> HF [D, H*Dh]
    return x.reshape(x.shape[0], -1)


def _query_heads(cfg):
    return cfg.num_heads


def _kv_heads(cfg):
    return cfg.num_kv_heads


def _has_bias(cfg):
    return cfg.attention_bias


def _has_qk_norm(cfg):
    return cfg.qk_norm


_LAYER = r"model\.layers\.(?P<i>\d+)\."  # the prefix of every per-layer tensor name

RULES: tuple[_Rule, ...] = (
    _Rule(r"model\.embed_tokens\.weight", "embed",
          lambda cfg: (cfg.vocab_size, cfg.hidden_size), _unchanged, _unchanged),
    _Rule(r"model\.norm\.weight", "final_norm.weight",
          lambda cfg: (cfg.hidden_size,), _unchanged, _unchanged),
    _Rule(r"lm_head\.weight", "lm_head",
          lambda cfg: (cfg.vocab_size, cfg.hidden_size), _unchanged, _unchanged),
    _Rule(_LAYER + r"input_layernorm\.weight", "layers.{i}.input_norm.weight",
          lambda cfg: (cfg.hidden_size,), _unchanged, _unchanged),
    _Rule(_LAYER + r"post_attention_layernorm\.weight", "layers.{i}.post_attn_norm.weight",
          lambda cfg: (cfg.hidden_size,), _unchanged, _unchanged),
    _Rule(_LAYER + r"self_attn\.q_proj\.weight", "layers.{i}.attn.q_kernel",
          lambda cfg: (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
          _split_heads(_query_heads), _merge_heads),
    _Rule(_LAYER + r"self_attn\.k_proj\.weight", "layers.{i}.attn.k_kernel",
          lambda cfg: (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
          _split_heads(_kv_heads), _merge_heads),
    _Rule(_LAYER + r"self_attn\.v_proj\.weight", "layers.{i}.attn.v_kernel",
          lambda cfg: (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
          _split_heads(_kv_heads), _merge_heads),
    _Rule(_LAYER + r"self_attn\.q_proj\.bias", "layers.{i}.attn.q_bias",
          lambda cfg: (cfg.num_heads * cfg.head_dim,), _split_heads(_query_heads), _merge_heads,
          _has_bias),
    _Rule(_LAYER + r"self_attn\.k_proj\.bias", "layers.{i}.attn.k_bias",
          lambda cfg: (cfg.num_kv_heads * cfg.head_dim,), _split_heads(_kv_heads), _merge_heads,
          _has_bias),
    _Rule(_LAYER + r"self_attn\.v_proj\.bias", "layers.{i}.attn.v_bias",
          lambda cfg: (cfg.num_kv_heads * cfg.head_dim,), _split_heads(_kv_heads), _merge_heads,
          _has_bias),
    # Qwen3: one [Dh] weight per layer, shared by every query (key) head
    _Rule(_LAYER + r"self_attn\.q_norm\.weight", "layers.{i}.attn.q_norm.weight",
          lambda cfg: (cfg.head_dim,), _unchanged, _unchanged, _has_qk_norm),
    _Rule(_LAYER + r"self_attn\.k_norm\.weight", "layers.{i}.attn.k_norm.weight",
          lambda cfg: (cfg.head_dim,), _unchanged, _unchanged, _has_qk_norm),
    _Rule(_LAYER + r"self_attn\.o_proj\.weight", "layers.{i}.attn.o_kernel",
          lambda cfg: (cfg.hidden_size, cfg.num_heads * cfg.head_dim), _split_o_heads,
          _merge_o_heads),
    _Rule(_LAYER + r"mlp\.gate_proj\.weight", "layers.{i}.mlp.gate_kernel",
          lambda cfg: (cfg.intermediate_size, cfg.hidden_size), _unchanged, _unchanged),
    _Rule(_LAYER + r"mlp\.up_proj\.weight", "layers.{i}.mlp.up_kernel",
          lambda cfg: (cfg.intermediate_size, cfg.hidden_size), _unchanged, _unchanged),
    _Rule(_LAYER + r"mlp\.down_proj\.weight", "layers.{i}.mlp.down_kernel",
          lambda cfg: (cfg.hidden_size, cfg.intermediate_size), _unchanged, _unchanged),
)
_COMPILED = [(re.compile(r.hf + r"\Z"), r) for r in RULES]
# HF checkpoints may carry buffers that are not weights.
IGNORED_HF_KEYS = re.compile(r".*rotary_emb\.inv_freq\Z")


def expected_hf_keys(cfg: ModelConfig) -> list[str]:
    """Every HF tensor name a checkpoint for `cfg` must contain."""
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        keys.append("lm_head.weight")
    for rule in RULES:
        if "(?P<i>" in rule.hf and rule.applies(cfg):
            template = rule.hf.replace(_LAYER, "model.layers.{i}.").replace("\\.", ".")
            keys += [template.format(i=i) for i in range(cfg.num_layers)]
    return keys


def check_hf_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> str | None:
    """Our dotted path for HF tensor `name` of `shape`, None for ignored ones; WeightError if it
    does not fit `cfg`. Needs only the header shape, so a converter can check a whole
    checkpoint before reading any tensor data."""
    return _match(name, tuple(shape), cfg)[0]


def _match(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[str | None, _Rule | None]:
    if IGNORED_HF_KEYS.match(name):
        return None, None
    for pattern, rule in _COMPILED:
        m = pattern.match(name)
        if not m:
            continue
        if not rule.applies(cfg):
            raise WeightError(f"unexpected weight {name!r} (shape {shape}): a {cfg.model_type} "
                              f"model has no such tensor; is config.json's model_type right?")
        if rule.ours == "lm_head" and cfg.tie_word_embeddings:
            # tied: the head is the embedding; a copy in the file is equal to it (convert's
            # read_hf_config unties the config when it differs, as transformers does)
            return None, None
        want = rule.hf_shape(cfg)
        if shape != want:
            raise WeightError(f"shape mismatch for {name}: checkpoint has {shape}, "
                              f"config expects {want}")
        i = m.groupdict().get("i")
        if i is not None and int(i) >= cfg.num_layers:
            raise WeightError(f"unexpected key {name}: layer {i} but config has {cfg.num_layers} "
                              "layers")
        return rule.ours.format(i=i), rule
    raise WeightError(f"unmapped weight {name!r} (shape {shape}): not part of a {cfg.model_type} "
                      "model")


def hf_to_ours(name: str, array: np.ndarray, cfg: ModelConfig) -> tuple[str, np.ndarray] | None:
    """Map one HF tensor to (our dotted path, array in our layout); None for ignored buffers."""
    path, rule = _match(name, tuple(array.shape), cfg)
    if path is None:
        return None
    return path, rule.to_ours(array, cfg)


def hf_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The HF shape `cfg` implies for HF tensor `name` (for planning a safetensors header)."""
    for pattern, rule in _COMPILED:
        if pattern.match(name):
            return tuple(rule.hf_shape(cfg))
    raise WeightError(f"unmapped weight {name!r}: not part of a {cfg.model_type} model")


def ours_to_hf(flat_params: dict[str, np.ndarray],
               cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, HF-layout array) for every parameter in our flat dotted-path dict."""
    for name in expected_hf_keys(cfg):
        for pattern, rule in _COMPILED:
            m = pattern.match(name)
            if m:
                path = rule.ours.format(i=m.groupdict().get("i"))
                if path not in flat_params:
                    raise WeightError(f"checkpoint is missing parameter {path} (for HF {name})")
                yield name, rule.to_hf(np.asarray(flat_params[path]), cfg)
                break
