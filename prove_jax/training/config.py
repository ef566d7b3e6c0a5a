"""Training configuration: nested dataclasses read from YAML, with `key=value` overrides.

One file describes a run; the command line changes single keys (`steps=10`,
`optimizer.lr=1e-4`). Unknown keys fail with the list of valid ones, so a typo never silently
trains with a default. `${stdlib}` in a path expands to this Python's standard-library folder
(a real text corpus present everywhere, used by the tiny CPU config).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sysconfig
from typing import Any

import yaml

from prove_jax import fieldtypes
from prove_jax.errors import ProveJaxError
from prove_jax.files import nearest_existing
from prove_jax.models.config import DTYPES, ConfigError, ModelConfig
from prove_jax.models.remat import RematError, remat_name


class TrainConfigError(ProveJaxError, ValueError):
    """A training configuration that cannot be used as written."""


@dataclasses.dataclass
class ModelSource:
    """Where the initial weights come from: exactly one of hf_dir / checkpoint / preset / config."""
    hf_dir: str | None = None
    """A Hugging Face safetensors directory, converted on the fly."""
    checkpoint: str | None = None
    """A prove_jax model checkpoint (`checkpoint.save_model`)."""
    preset: str | None = None
    """A name from `models.config.PRESETS`, randomly initialised."""
    config: dict | None = None
    """Inline ModelConfig fields, randomly initialised."""
    dtype: str | None = None
    """Compute dtype override (bfloat16: bf16 matmuls)."""
    param_dtype: str | None = None
    """Master-weight dtype override (float32 recommended)."""
    remat: str | bool = "none"
    """What each decoder layer keeps for the backward pass (models/remat.py): none (everything),
    full (its input only; the layer is recomputed), dots (every projection), attn_proj (q, k, v,
    o). true/false, from configs before the policies, read as full/none."""
    scan_layers: bool = False
    """Run the training forward's layers as one lax.scan: XLA optimises one layer, not
    num_layers copies, and gathers one layer's weights at a time (the 32B step's peak per chip
    drops by 40%, benchmarks/tpu_compile.md). Parameters, checkpoints and decoding stay per
    layer; each step stacks the layer weights (one extra copy)."""
    shape_preset: str | None = None
    """--dry-run only: a preset with the same shapes, used when the weights are not on this
    machine."""


@dataclasses.dataclass
class TokenizerSource:
    """A tokenizer directory, or (for from-scratch runs) a byte-level BPE trained on the data."""
    path: str | None = None
    """A tokenizer directory; None: the model checkpoint's or HF directory's own."""
    bpe_vocab_size: int | None = None
    """Train a byte-level BPE of this many tokens on the training data."""


@dataclasses.dataclass
class OptimizerConfig:
    """AdamW with linear warmup and cosine decay (training/optimizer.py)."""
    lr: float = 1e-4
    """Peak learning rate."""
    warmup_ratio: float = 0.03
    """Fraction of `steps` spent in linear warmup."""
    min_lr_ratio: float = 0.0
    """The cosine decays to lr * min_lr_ratio."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    b1: float = 0.9
    """Adam's first-moment decay."""
    b2: float = 0.999
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""
    clip_norm: float | None = 1.0
    """Global-norm gradient clipping; None disables it."""
    grad_accum: int = 1
    """Micro-batches per step (it must divide global_batch_size)."""


@dataclasses.dataclass
class TrainConfig:
    """One training run: the YAML file's keys, each overridable as `key=value`."""
    model: ModelSource = dataclasses.field(default_factory=ModelSource)
    """Where the initial weights come from."""
    tokenizer: TokenizerSource = dataclasses.field(default_factory=TokenizerSource)
    """The tokenizer, or the BPE to train."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    """Optimizer and schedule."""
    objective: str = "mars"
    """mars (proposer), ar (verifier) or commit_head (the verifier's head:
    training/commit_head_training.py)."""
    proposer: str | None = None
    """commit_head only: the MARS proposer checkpoint whose blocks the head judges."""
    proposer_shape_preset: str | None = None
    """--dry-run of commit_head only: a preset with the proposer's shapes, when its checkpoint is
    not on this machine."""
    block_size: int = 16
    """MARS block size K: tokens proposed per forward."""
    ar_weight: float = 1.0
    """Weight of the clean-stream (AR) loss beside the masked one."""
    data: str | None = None
    """A text file, a folder of text files, or JSONL."""
    chat: bool = False
    """Apply the tokenizer's chat template to prompt/response pairs."""
    enable_thinking: bool | None = None
    """chat only: the template's thinking switch (Qwen3's `enable_thinking`, data/chat.py). null
    keeps the template's default; false trains each response after an empty thinking section
    (Qwen3's non-thinking mode), true after the plain assistant opening (its thinking mode)."""
    pack_documents: bool = False
    """Pack text documents and prompt/response pairs several to a row, each attending only to
    itself (segment ids; positions and MARS blocks restart per document; losses average per
    document). Off (the default) keeps the layout, and so the losses, of runs made before it
    existed: text as one boundary-less stream cut into rows, one pair per row. A packed row
    holds several examples, so global_batch_size counts more examples per step."""
    max_length: int = 512
    """Tokens per training row (a multiple of block_size)."""
    global_batch_size: int = 8
    """Rows per step, over all hosts and micro-batches."""
    steps: int = 100
    """Optimizer steps of the whole run."""
    mesh: list = dataclasses.field(default_factory=lambda: [1, -1, 1])
    """Device mesh [data, fsdp, tensor]; -1 takes the remaining devices."""
    seed: int = 0
    """Seed of the random init and the data shuffle."""
    run_dir: str = "runs/default"
    """Checkpoints, metrics, tokenizer and the exported model; a relaunch resumes from it."""
    log_every: int = 10
    """Steps between metric records."""
    save_every: int = 100
    """Steps between checkpoints (the final step is always saved)."""
    keep: int = 3
    """Checkpoints kept in run_dir/checkpoints."""
    export_every_save: bool = False
    """Also refresh run_dir/model at every save."""
    async_save: bool = True
    """Write checkpoints while training continues."""
    target_chip: str | None = None
    """--dry-run's chip: v5p, v5e, v4, v6e, H100 or H200."""
    compilation_cache_dir: str | None = None
    """JAX's persistent compilation cache: compiled programs are written here and a relaunch
    with the same program (config, mesh, jax version) reads them instead of compiling. Every
    host may share one folder."""
    export_dtype: str | None = None
    """dtype of the exported run_dir/model: float32, or bfloat16 (half the size, for inference;
    training and its checkpoints keep their dtype). null: the trained weights' dtype."""

    def validate(self) -> "TrainConfig":
        _check_types(self)
        if self.objective not in ("mars", "ar", "commit_head"):
            raise TrainConfigError(
                f"objective must be 'mars', 'ar' or 'commit_head', got {self.objective!r}")
        for name in ("block_size", "max_length", "global_batch_size", "steps", "log_every",
                     "save_every", "keep"):
            if getattr(self, name) <= 0:
                raise TrainConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.tokenizer.bpe_vocab_size is not None and self.tokenizer.bpe_vocab_size <= 0:
            raise TrainConfigError(f"tokenizer.bpe_vocab_size must be positive (or null: no BPE), "
                                   f"got {self.tokenizer.bpe_vocab_size}")
        if self.objective == "commit_head":
            # the head judges D_1..D_(K-1) of a K-token block after a context of up to
            # max_length - block_size tokens: a one-token block leaves nothing to learn (loss 0,
            # an untrained head exported), max_length = block_size no room for a context
            if self.block_size < 2:
                raise TrainConfigError(f"objective=commit_head needs block_size >= 2 (got "
                                       f"{self.block_size}): the head judges tokens D_1..D_(K-1) "
                                       f"of each K-token block")
            if self.pack_documents:
                raise TrainConfigError("objective=commit_head cuts one context per row: set "
                                       "pack_documents=false")
            if self.max_length <= self.block_size:
                raise TrainConfigError(f"objective=commit_head needs max_length > block_size "
                                       f"(got {self.max_length} and {self.block_size}): each "
                                       f"row's context is at most max_length - block_size tokens")
        if self.max_length % self.block_size:  # rows are padded to whole blocks (data/pipeline.py)
            raise TrainConfigError(f"max_length={self.max_length} must be a multiple of "
                                   f"block_size={self.block_size}")
        if not 0 <= self.seed < 2 ** 32:  # grain's shuffle takes an unsigned 32-bit seed
            raise TrainConfigError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.enable_thinking is not None and not self.chat:
            raise TrainConfigError(f"enable_thinking={str(self.enable_thinking).lower()} is a chat "
                                   f"template switch: set chat=true too, or enable_thinking=null")
        if not (math.isfinite(self.ar_weight) and self.ar_weight >= 0):
            raise TrainConfigError(f"ar_weight must be a finite number >= 0, "
                                   f"got {self.ar_weight!r}")
        _check_model_source(self.model)
        if self.export_dtype not in (None, "float32", "bfloat16"):
            raise TrainConfigError(f"export_dtype must be float32, bfloat16 or null (the trained "
                                   f"weights' dtype), got {self.export_dtype!r}")
        if self.optimizer.grad_accum <= 0 or self.global_batch_size % self.optimizer.grad_accum:
            raise TrainConfigError(
                f"optimizer.grad_accum={self.optimizer.grad_accum} must divide "
                f"global_batch_size={self.global_batch_size}")
        self.mesh = _check_mesh(self.mesh)
        _check_optimizer(self.optimizer)
        _check_paths(self)
        sources = [k for k in ("hf_dir", "checkpoint", "preset", "config")
                   if getattr(self.model, k) is not None]
        if len(sources) != 1:
            raise TrainConfigError(
                f"set exactly one of model.hf_dir / model.checkpoint / model.preset / "
                f"model.config (got {sources or 'none'})")
        # (commit_head reads the verifier's tokenizer or tokenizer.path, never a BPE)
        if (self.tokenizer.bpe_vocab_size and sources[0] in ("hf_dir", "checkpoint")
                and self.objective != "commit_head"):
            raise TrainConfigError(
                f"tokenizer.bpe_vocab_size trains a new vocabulary, but model.{sources[0]} weights "
                f"read token ids as their own tokenizer assigns them: set "
                f"tokenizer.bpe_vocab_size=null (the model's tokenizer), or build the model from "
                f"model.preset / model.config")
        return self


def _check_mesh(mesh: list) -> list[int]:
    """[data, fsdp, tensor]: three whole numbers, each >= 1 or -1 (the remaining devices)."""
    def size(v):
        try:
            v = fieldtypes.conform(v, "int")  # 2.0 -> 2; a bool, text, null or 1.5 is refused
        except fieldtypes.AnnotationMismatch:
            return None
        return v if v >= 1 or v == -1 else None
    sizes = [size(v) for v in mesh]
    if len(mesh) != 3 or None in sizes:
        raise TrainConfigError(f"mesh must be [data, fsdp, tensor], each a whole number >= 1 or -1 "
                               f"(the remaining devices), got {mesh}")
    return sizes


def _check_paths(cfg: "TrainConfig") -> None:
    """run_dir and data are non-empty paths; run_dir can be a directory (it is one, or its
    nearest existing ancestor is, not a file it would have to be created below) and lies
    outside a data folder (whose files are all read as data)."""
    for name in ("run_dir", "data", "compilation_cache_dir"):
        value = getattr(cfg, name)
        if value is not None and not value.strip():
            raise TrainConfigError(f"{name} must be a path, got {value!r}")
    cache = cfg.compilation_cache_dir
    if cache is not None and os.path.exists(cache) and not os.path.isdir(cache):
        raise TrainConfigError(f"compilation_cache_dir {cache} is a file; it must be a directory")
    run_dir = cfg.run_dir
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise TrainConfigError(f"run_dir {run_dir} is a file; it must be a directory (new or a "
                               f"run to resume)")
    ancestor = nearest_existing(run_dir)
    if not os.path.isdir(ancestor):
        raise TrainConfigError(f"run_dir {run_dir} cannot be created: {ancestor} is a file, not a "
                               f"directory")
    data = cfg.data
    if data is not None and os.path.isdir(data):
        inside = os.path.realpath(data)
        if os.path.commonpath([inside, os.path.realpath(run_dir)]) == inside:
            raise TrainConfigError(
                f"run_dir {run_dir} is inside the data folder {data}: every .jsonl and text file "
                f"below it is read as training data, the run's own files (metrics.jsonl) included "
                f"on a relaunch; put run_dir outside the data folder")


def _check_model_source(src: ModelSource) -> None:
    """What can be told from the config alone: dtype names and inline model.config keys."""
    for name in ("dtype", "param_dtype"):
        value = getattr(src, name)
        if value is not None and value not in DTYPES:
            raise TrainConfigError(f"model.{name} must be one of {', '.join(DTYPES)} or null, "
                                   f"got {value!r}")
    try:
        src.remat = remat_name(src.remat)
    except RematError as e:
        raise TrainConfigError(str(e)) from None
    if src.config is not None:
        inline_model_config(src.config)


def inline_model_config(config: dict):
    """`model.config` as a ModelConfig. YAML 1.1 reads '1e6' as a string, so number-looking
    strings become numbers here; every other check (known keys, each value of its field's type)
    is ModelConfig.from_json_dict's, so a bad value fails at load and not inside the first
    forward."""
    annotations = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    d = {k: _yaml_number(v, annotations[k]) if k in annotations else v for k, v in config.items()}
    try:
        return ModelConfig.from_json_dict(d, where="model.config")
    except ConfigError as e:
        raise TrainConfigError(str(e)) from None


def _check_optimizer(opt: OptimizerConfig) -> None:
    """Values optax would take and then train badly with (a negative lr ascends the loss)."""
    def bad(name, rule):
        return TrainConfigError(f"optimizer.{name} must be {rule}, got {getattr(opt, name)!r}")
    if not (math.isfinite(opt.lr) and opt.lr > 0):
        raise bad("lr", "a positive number")
    for name in ("warmup_ratio", "min_lr_ratio"):
        if not 0 <= getattr(opt, name) <= 1:
            raise bad(name, "in [0, 1]")
    for name in ("b1", "b2"):
        if not 0 <= getattr(opt, name) < 1:
            raise bad(name, "in [0, 1)")
    if not (math.isfinite(opt.weight_decay) and opt.weight_decay >= 0):
        raise bad("weight_decay", ">= 0")
    if not (math.isfinite(opt.eps) and opt.eps > 0):
        raise bad("eps", "a positive number")
    if opt.clip_norm is not None and not (math.isfinite(opt.clip_norm) and opt.clip_norm > 0):
        raise bad("clip_norm", "a positive number or null (no clipping)")


def _check_types(obj, prefix: str = "") -> None:
    """Every leaf value has its field's annotated type, by `fieldtypes.conform`'s rule (`steps=abc`
    is an error, not a crash deep inside training); `2.0` steps is stored as 2."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if _nested_class(type(obj), f.name) is not None:
            _check_types(value, prefix + f.name + ".")
            continue
        try:
            setattr(obj, f.name, fieldtypes.conform(value, f.type))
        except fieldtypes.AnnotationMismatch as e:
            raise TrainConfigError(f"{prefix}{f.name} must be {e.wanted}, got {value!r}") from None


def _field_types(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def valid_keys(cls=TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key a config file or override may set."""
    out = []
    for f in dataclasses.fields(cls):
        sub = _nested_class(cls, f.name)
        if sub is not None:
            out += valid_keys(sub, prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


_NESTED = {(TrainConfig, "model"): ModelSource, (TrainConfig, "tokenizer"): TokenizerSource,
           (TrainConfig, "optimizer"): OptimizerConfig}


def _nested_class(cls, name):
    return _NESTED.get((cls, name))


def _unknown(key: str) -> TrainConfigError:
    return TrainConfigError(f"unknown config key {key!r}; valid keys: {', '.join(valid_keys())}")


def _build(cls, d: dict, prefix: str = ""):
    if not isinstance(d, dict):
        raise TrainConfigError(f"config section {prefix.rstrip('.') or '<root>'} must be a mapping")
    fields = _field_types(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in fields:
            raise _unknown(prefix + key)
        sub = _nested_class(cls, key)
        if sub is not None:
            if isinstance(value, str) and key == "tokenizer":
                value = {"path": value}  # `tokenizer: DIR` shorthand
            kwargs[key] = _build(sub, value or {}, prefix + key + ".")
        else:
            kwargs[key] = _as_field(value, fields[key].type)
    return cls(**kwargs)


def _parse_value(text: str) -> Any:
    """A command-line value as YAML reads it: 10 -> int, null -> None, [1,2] -> list; text
    that is not YAML stays text. (`1e-4` is still a string here: see `_yaml_number`.)"""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _yaml_number(value, annotation: str):
    """YAML 1.1 reads `1e-4` and `1e6` (no dot) as strings. For a field that takes a number,
    such a string is that number, in the YAML file, `model.config` and the command line alike;
    every other value is left to the field's type check."""
    if not isinstance(value, str) or not {"int", "float"} & set(fieldtypes.options(annotation)):
        return value
    try:
        return float(value)
    except ValueError:
        return value


def _is_text(annotation: str) -> bool:
    """A string field ('str', 'str | None'): its values are paths and names, kept as written."""
    return "str" in fieldtypes.options(annotation)


def _as_field(value, annotation: str):
    """A YAML value as its field reads it: a YAML number given to a string field (`run_dir:
    2024`, `objective: 1`) is the text it was, and dotless number text given to a number field
    is that number (`_yaml_number`); every other conversion is `fieldtypes.conform`'s, in
    `validate`."""
    value = _yaml_number(value, annotation)
    if _is_text(annotation) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


def apply_overrides(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """`key=value` strings, dotted keys for nested sections (`optimizer.lr=3e-4`)."""
    for item in overrides:
        if "=" not in item:
            raise TrainConfigError(f"override {item!r} is not key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        value = _parse_value(text)
        parts = key.split(".")
        obj, cls = cfg, TrainConfig
        for part in parts[:-1]:
            sub = _nested_class(cls, part)
            if sub is None:
                raise _unknown(key)
            obj, cls = getattr(obj, part), sub
        leaf = parts[-1]
        if leaf not in _field_types(cls) or _nested_class(cls, leaf) is not None:
            if _nested_class(cls, leaf) is TokenizerSource and isinstance(value, str):
                obj.tokenizer = TokenizerSource(path=value)
                continue
            raise _unknown(key)
        sources = ("hf_dir", "checkpoint", "preset", "config")
        if cls is ModelSource and leaf in sources and value is not None:
            for other in sources:
                setattr(obj, other, None)  # choosing a model source replaces the old one
        annotation = _field_types(cls)[leaf].type
        if _is_text(annotation) and text.strip() not in ("null", "None", "~"):
            value = text  # paths and names stay verbatim ("0123", "1e3", "a: b")
        setattr(obj, leaf, _as_field(value, annotation))
    return cfg


def expand_path(path: str | None) -> str | None:
    if path is None:
        return None
    stdlib = sysconfig.get_paths()["stdlib"]
    return os.path.expanduser(str(path).replace("${stdlib}", stdlib))


def load_config(path: str | None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML config (or start from defaults with path=None) and apply overrides."""
    raw: dict = {}
    if path is not None:
        if not os.path.exists(path):
            raise TrainConfigError(f"config file not found: {path}")
        with open(path) as f:
            try:
                raw = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                first_line = str(e).splitlines()[0]
                raise TrainConfigError(f"{path} is not valid YAML: {first_line}") from None
    cfg = apply_overrides(_build(TrainConfig, raw), list(overrides))
    cfg.data = expand_path(cfg.data)
    cfg.run_dir = expand_path(cfg.run_dir)
    cfg.proposer = expand_path(cfg.proposer)
    cfg.compilation_cache_dir = expand_path(cfg.compilation_cache_dir)
    for section, key in ((cfg.model, "hf_dir"), (cfg.model, "checkpoint"), (cfg.tokenizer, "path")):
        setattr(section, key, expand_path(getattr(section, key)))
    return cfg.validate()


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)
