"""Model configuration: one frozen dataclass for the Qwen2 and Qwen3 (dense) families, read from /
written to HF config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from types import MappingProxyType
from typing import Any, Mapping

from prove_jax.errors import ProveJaxError
from prove_jax import fieldtypes

# The decoder families (`ModelConfig.model_type`): one decoder, switched by the config. qwen2 has
# q/k/v biases; qwen3 has none and RMSNorms each query and key head before RoPE.
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")
# Families people hold beside them that this decoder does not implement, and why (named in the
# refusal, so that "unsupported" says what is missing rather than only what is there).
UNSUPPORTED_FAMILIES = MappingProxyType({
    "qwen3_moe": "a mixture-of-experts model (Qwen3-30B-A3B, 235B-A22B): only dense MLPs here",
    "qwen2_moe": "a mixture-of-experts model: only dense MLPs here",
    "qwen3_next": "hybrid linear attention and mixture of experts: only dense full attention here",
    "qwen2_vl": "a vision-language model: text-only decoders here",
    "qwen2_5_vl": "a vision-language model: text-only decoders here",
    "qwen3_vl": "a vision-language model: text-only decoders here",
})


DTYPES = ("float32", "bfloat16", "float16")  # what `dtype` / `param_dtype` may name


class ConfigError(ProveJaxError, ValueError):
    """A configuration that this project cannot build a model from."""


# Activations transformers' Qwen2 MLP can name that are SiLU (ACT2FN maps both to nn.SiLU).
SILU_NAMES = ("silu", "swish")


def _check_plain_qwen2(hf: dict[str, Any], num_layers: int) -> None:
    """Refuse HF Qwen2/Qwen3 settings this model does not implement rather than convert them into
    a different model: an activation other than SiLU, or sliding-window attention on any layer.
    The window follows transformers' Qwen2Config and Qwen3Config alike: `sliding_window` counts
    only with `use_sliding_window`, on the layers `layer_types` marks (default: from
    `max_window_layers` on). Official Qwen2.5 and Qwen3 configs have use_sliding_window false.
    """
    act = hf.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ConfigError(f"hidden_act {act!r} is not supported (the MLP here is SiLU-gated)")
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
    if window is None:
        return
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= int(hf.get("max_window_layers", 28)) else "full_attention"
        for i in range(num_layers)]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding:
        listed = ", ".join(map(str, sliding[:8])) + (" ..." if len(sliding) > 8 else "")
        raise ConfigError(f"sliding-window attention (window {window} on layer(s) {listed}) is "
                          f"not supported: every layer here attends to the whole context")


def _default_head_dim(model_type: str, hidden: int, heads: int) -> int:
    """head_dim when config.json leaves it out, as transformers reads it: Qwen3Config's default is
    128 whatever the width; Qwen2's is hidden_size / num_attention_heads."""
    if model_type == "qwen3":
        return 128
    return hidden // heads if heads > 0 else 0


def _field_value(key: str, value: Any, annotation: str, where: str) -> Any:
    """`value` as ModelConfig field `key` holds it (the rule is `fieldtypes.conform`'s), or a
    ConfigError naming the key."""
    try:
        return fieldtypes.conform(value, annotation)
    except fieldtypes.AnnotationMismatch as e:
        raise ConfigError(f"{where} {key} must be {e.wanted}, got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Qwen2 or Qwen3 (dense) model's family, shape, special tokens and numerics (HF names:
    `from_hf_dict`)."""

    vocab_size: int
    """Embedding rows, padded past the tokenizer's ids (151,936 for Qwen2.5 up to 3B)."""
    hidden_size: int
    """D, the residual stream's width."""
    intermediate_size: int
    """F, the MLP's width."""
    num_layers: int
    """Decoder layers (HF num_hidden_layers)."""
    num_heads: int
    """H, query heads (HF num_attention_heads)."""
    num_kv_heads: int
    """K, key/value heads; H is a multiple of it (grouped-query attention)."""
    head_dim: int
    """Dh, the width of one head."""
    rope_theta: float = 1_000_000.0
    """RoPE base frequency."""
    rms_norm_eps: float = 1e-6
    """Added to the mean square in every RMSNorm."""
    tie_word_embeddings: bool = False
    """The LM head is the embedding table (no separate lm_head weight)."""
    max_position_embeddings: int = 32768
    """Longest context the model was trained for."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id; None when unknown."""
    eos_token_ids: tuple[int, ...] = ()
    """Ids that end a generation."""
    pad_token_id: int | None = None
    """Padding id; None when unknown."""
    mask_token_id: int | None = None
    """`<|mask|>`, the MARS mask token; None until it is added to the vocabulary."""
    param_dtype: str = "float32"
    """dtype the weights are stored in (one of DTYPES)."""
    dtype: str = "float32"
    """dtype activations and matmuls run in (one of DTYPES)."""
    model_type: str = "qwen2"
    """The decoder family, HF's name for it (one of SUPPORTED_MODEL_TYPES): "qwen2" adds a bias
    to q/k/v; "qwen3" has no bias and RMSNorms each query and key head before RoPE."""

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id={self.mask_token_id} outside "
                              f"vocab_size={self.vocab_size}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"{name} must be one of {', '.join(DTYPES)}, "
                                  f"got {getattr(self, name)!r}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type must be one of {', '.join(SUPPORTED_MODEL_TYPES)}, "
                              f"got {self.model_type!r}")

    @property
    def attention_bias(self) -> bool:
        """q/k/v projections carry a bias (Qwen2; Qwen3 has none)."""
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Each query and key head is RMSNormed over head_dim before RoPE (Qwen3)."""
        return self.model_type == "qwen3"

    @property
    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d
        attn += q + 2 * kv if self.attention_bias else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else d * v
        return v * d + self.num_layers * per_layer + d + head

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- HF config.json <-> ModelConfig ---------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """An HF Qwen2 or Qwen3 config.json as a ModelConfig; a family or a setting this decoder
        does not implement is refused here, before any weight is read. Every value is checked
        against its field's annotation (`fieldtypes.conform`, as `from_json_dict` does), so a
        null size or a string eos id fails naming the HF key instead of being written into a
        checkpoint that then cannot be read back."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            why = UNSUPPORTED_FAMILIES.get(model_type) if isinstance(model_type, str) else None
            raise ConfigError(
                f"unsupported model_type {model_type!r}{f' ({why})' if why else ''}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        experts = hf.get("num_experts") or hf.get("num_local_experts")
        if experts:
            raise ConfigError(f"HF config has {experts!r} experts (a mixture-of-experts model): "
                              f"only dense MLPs are supported")
        if model_type == "qwen3" and hf.get("attention_bias"):
            raise ConfigError("attention_bias true is not supported for qwen3 (its q/k/v/o "
                              "projections here have no bias, as in every published Qwen3)")
        types = {f.name: f.type for f in dataclasses.fields(cls)}

        def value(field: str, hf_key: str, raw: Any) -> Any:
            return _field_value(hf_key, raw, types[field], "HF config")

        def required(field: str, hf_key: str) -> Any:
            if hf_key not in hf:
                raise ConfigError(f"HF config is missing required key {hf_key!r}")
            return value(field, hf_key, hf[hf_key])

        hidden = required("hidden_size", "hidden_size")
        heads = required("num_heads", "num_attention_heads")
        layers = required("num_layers", "num_hidden_layers")
        vocab = required("vocab_size", "vocab_size")
        inter = required("intermediate_size", "intermediate_size")
        # transformers 5 nests rope settings in rope_parameters; older files have rope_theta on top.
        rope = hf.get("rope_parameters") or {}
        # transformers lets rope_scaling override rope_parameters, and reads the older "type" key
        # (the YaRN snippet of the Qwen2.5 model cards) as rope_type.
        scaling = hf.get("rope_scaling") or rope
        for key, d in (("rope_parameters", rope), ("rope_scaling", scaling)):
            if not isinstance(d, dict):
                raise ConfigError(f"HF config {key} must be an object, got {d!r}")
        theta = value("rope_theta", "rope_theta",
                      rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default'); "
                              f"converting would silently change the model's outputs")
        try:
            _check_plain_qwen2(hf, layers)
        except (TypeError, ValueError, AttributeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"HF config has a malformed activation or sliding-window setting "
                              f"(hidden_act, use_sliding_window, sliding_window, "
                              f"max_window_layers, layer_types): {e}") from None
        eos = hf.get("eos_token_id")
        eos_ids = value("eos_token_ids", "eos_token_id",
                        eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=value("num_kv_heads", "num_key_value_heads",
                               hf.get("num_key_value_heads") or heads),
            head_dim=value("head_dim", "head_dim",
                           hf.get("head_dim") or _default_head_dim(model_type, hidden, heads)),
            rope_theta=theta,
            rms_norm_eps=value("rms_norm_eps", "rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
            # null reads as false, as transformers' `if config.tie_word_embeddings` does
            tie_word_embeddings=value("tie_word_embeddings", "tie_word_embeddings",
                                      hf.get("tie_word_embeddings") or False),
            max_position_embeddings=value("max_position_embeddings", "max_position_embeddings",
                                          hf.get("max_position_embeddings", 32768)),
            bos_token_id=value("bos_token_id", "bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=eos_ids,
            pad_token_id=value("pad_token_id", "pad_token_id", hf.get("pad_token_id")),
            mask_token_id=value("mask_token_id", "mask_token_id", hf.get("mask_token_id")),
            param_dtype=dtype if dtype in ("float32", "bfloat16") else "float32",
            model_type=model_type,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        eos = list(self.eos_token_ids)
        family = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
        if self.model_type == "qwen3":
            family = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                      "attention_bias": False}
        return family | {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": self.pad_token_id,
            "mask_token_id": self.mask_token_id,
            "dtype": self.param_dtype,
        }

    # ---- our own config.json (a superset of HF's) ------------------------------------------

    def to_json_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json_dict(cls, d: dict[str, Any], where: str = "model config") -> "ModelConfig":
        """Our config.json (or an HF one) as a ModelConfig. Every field is checked against its
        annotation here, so a string size or a null eos list fails naming the key, not as a
        TypeError inside the first forward; `where` names the source in the messages (the
        training config passes "model.config")."""
        if "num_hidden_layers" in d:  # an HF config.json
            return cls.from_hf_dict(d)
        types = {f.name: f.type for f in dataclasses.fields(cls)}  # 'int', 'int | None', ...
        unknown = sorted(set(d) - set(types) - {"model_type"})
        if unknown:
            raise ConfigError(f"unknown {where} keys {unknown}; valid keys: {sorted(types)}")
        d = {k: v for k, v in d.items() if k in types}
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"{where} is missing required key(s) {missing}")
        for key, value in d.items():
            d[key] = _field_value(key, value, types[key], where)
        return cls(**d)

    @classmethod
    def load(cls, path: str) -> "ModelConfig":
        """Read `config.json` (ours or HF's) from a file or a directory."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"no config.json at {path}")
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a non-UTF-8 file
                raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path} is not a JSON object")
        return cls.from_json_dict(d)


# Real Qwen2.5 shapes (from the published config.json files). Vocab rows are the padded 151,936
# (151,665 real ids), which is why `<|mask|>` fits without a resize.
_QWEN25_COMMON = MappingProxyType(dict(vocab_size=151_936, rope_theta=1_000_000.0,
                                       rms_norm_eps=1e-6, bos_token_id=151643,
                                       eos_token_ids=(151645, 151643), pad_token_id=151643))
_QWEN25_WIDE_VOCAB = MappingProxyType(_QWEN25_COMMON | {"vocab_size": 152_064})  # 7B and up
_QWEN25_PRESETS = MappingProxyType({
    "qwen2.5-0.5b": ModelConfig(
        hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, tie_word_embeddings=True, **_QWEN25_COMMON),
    "qwen2.5-1.5b": ModelConfig(
        hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
        head_dim=128, tie_word_embeddings=True, **_QWEN25_COMMON),
    "qwen2.5-3b": ModelConfig(
        hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16, num_kv_heads=2,
        head_dim=128, tie_word_embeddings=True, **_QWEN25_COMMON),
    "qwen2.5-7b": ModelConfig(
        hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
        head_dim=128, **_QWEN25_WIDE_VOCAB),
    "qwen2.5-14b": ModelConfig(
        hidden_size=5120, intermediate_size=13824, num_layers=48, num_heads=40, num_kv_heads=8,
        head_dim=128, **_QWEN25_WIDE_VOCAB),
    "qwen2.5-32b": ModelConfig(
        hidden_size=5120, intermediate_size=27648, num_layers=64, num_heads=40, num_kv_heads=8,
        head_dim=128, **_QWEN25_WIDE_VOCAB),
})
# Real Qwen3 (dense) shapes, from the published config.json files: one vocabulary (151,936 rows)
# at every size, head_dim 128 whatever the width, 8 kv heads, tied heads up to 4B, 40,960 positions.
_QWEN3_COMMON = MappingProxyType(_QWEN25_COMMON | dict(model_type="qwen3", head_dim=128,
                                                       num_kv_heads=8,
                                                       max_position_embeddings=40_960))
_QWEN3_PRESETS = MappingProxyType({
    "qwen3-0.6b": ModelConfig(
        hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
        tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-1.7b": ModelConfig(
        hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
        tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-4b": ModelConfig(
        hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
        tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-8b": ModelConfig(
        hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, **_QWEN3_COMMON),
    "qwen3-14b": ModelConfig(
        hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40, **_QWEN3_COMMON),
    "qwen3-32b": ModelConfig(
        hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64, **_QWEN3_COMMON),
})
PRESETS: Mapping[str, ModelConfig] = MappingProxyType({**_QWEN25_PRESETS, **_QWEN3_PRESETS})


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}") from None
