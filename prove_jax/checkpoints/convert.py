"""Convert Qwen2 and Qwen3 (dense) checkpoints between HF safetensors and our orbax format,
tensor by tensor (the CLI: prove_jax/cli/convert.py; docs/conversion.md). The family comes from
config.json's model_type; one the model lacks is refused with the config, before any header.

One tensor is in flight at a time, so peak memory is about one copy of the model (see
benchmarks/convert.md). Every check that needs only headers (keys, shapes, truncation) runs
before any tensor data is read, and outputs appear under their final name only when complete.
A conversion for a mesh stores each array in chunks of its shards there, and one made with a
source record (training's `model.hf_dir`) is reused until the HF files or the mesh change.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Iterator

import numpy as np
from jax.sharding import AbstractMesh, AxisType

from prove_jax import storage
from prove_jax.checkpoints import safetensors_io
from prove_jax.checkpoints.checkpoint import (copy_tokenizer_files, load_config, load_model,
                                              save_params, shard_chunk_shapes)
from prove_jax.checkpoints.hf_weights import (WeightError, check_hf_tensor, expected_hf_keys,
                                              hf_shape, hf_to_ours, ours_to_hf)
from prove_jax.files import nearest_existing, read_json
from prove_jax.models.config import ConfigError, ModelConfig
from prove_jax.models.params import abstract_model, flat_params
from prove_jax.models.sharding import MESH_AXES

DTYPES = ("float32", "bfloat16")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def _np_dtype(name: str) -> np.dtype:
    return safetensors_io.DTYPES["BF16"] if name == "bfloat16" else np.dtype(name)


class _Progress:
    """Tensor count / bytes on stderr, at most once every `every` seconds, plus a final line."""

    def __init__(self, what: str, total_tensors: int, total_bytes: int, enabled: bool,
                 every: float = 2.0):
        self.what, self.total_tensors, self.total_bytes = what, total_tensors, total_bytes
        self.enabled, self.every = enabled, every
        self.done = self.bytes = 0
        self.start = self.last = time.monotonic()

    def step(self, nbytes: int) -> None:
        self.done += 1
        self.bytes += nbytes
        now = time.monotonic()
        if self.enabled and (now - self.last >= self.every or self.done == self.total_tensors):
            self.last = now
            print(f"{self.what}: {self.done}/{self.total_tensors} tensors, {self.bytes / 1e9:.2f}/"
                  f"{self.total_bytes / 1e9:.2f} GB, {now - self.start:.1f}s", file=sys.stderr,
                  flush=True)


def _check_out_dir(out: str, overwrite: bool) -> None:
    """Refuse an output that exists (unless --overwrite) or cannot be created, before converting:
    the output is written under a temporary sibling name, which an OSError would name instead."""
    if storage.exists(out) and (not storage.isdir(out) or storage.listdir(out)) and not overwrite:
        raise ConfigError(f"output {out} already exists and is not empty (pass --overwrite to "
                          "replace it)")
    if storage.is_url(out):  # a bucket prefix: nothing to create beforehand
        return
    parent = nearest_existing(out)  # atomic_dir creates the missing ones
    if not os.path.isdir(parent):
        raise ConfigError(f"cannot create output {out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot create output {out}: {parent} is not writable")


def nest(flat: dict[str, object]) -> dict:
    """Dotted paths -> the nested pure dict of `nnx.to_pure_dict(nnx.state(model, nnx.Param))`.

    Digit segments become int keys, as nnx.List indices are ints in the pure dict.
    """
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


# ---- HF -> ours --------------------------------------------------------------------------------

def read_hf_config(hf_dir: str) -> ModelConfig:
    """ModelConfig from an HF dir; eos ids from generation_config.json are added (Qwen2.5-Instruct
    lists <|im_end|> in config.json but both <|im_end|> and <|endoftext|> there), and its pad and
    bos ids fill those config.json leaves out (Qwen2.5 names its pad token only there)."""
    path = os.path.join(hf_dir, "config.json")
    if os.path.isdir(os.path.join(hf_dir, "params")):
        raise ConfigError(f"{hf_dir} is a prove-jax checkpoint (it has params/), not a Hugging "
                          f"Face model directory; flax-to-hf converts in that direction")
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json in {hf_dir}")
    cfg = ModelConfig.from_hf_dict(_read_json(path))
    gen_path = os.path.join(hf_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = _read_json(gen_path)
        eos = gen.get("eos_token_id")
        eos = [] if eos is None else (eos if isinstance(eos, list) else [eos])
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
            raise ConfigError(f"{gen_path}: eos_token_id must be an id or a list of ids, got "
                              f"{gen['eos_token_id']!r}")
        changes = {"eos_token_ids": tuple(dict.fromkeys(list(cfg.eos_token_ids) + eos))}
        for key in ("pad_token_id", "bos_token_id"):
            value = gen.get(key)
            if getattr(cfg, key) is None and value is not None:
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ConfigError(f"{gen_path}: {key} must be an id, got {value!r}")
                changes[key] = value
        cfg = cfg.replace(**changes)
    return _untie_if_the_head_differs(hf_dir, cfg)


def _untie_if_the_head_differs(hf_dir: str, cfg: ModelConfig) -> ModelConfig:
    """A tied config whose safetensors hold both the embedding and an lm_head.weight that
    differs from it is loaded untied by transformers (it warns and keeps the file's head), so
    it converts untied here too, with a one-line notice; an equal copy is dropped as before.
    Damaged files are left to the conversion, which names what is wrong with them."""
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if not cfg.tie_word_embeddings:
        return cfg
    try:
        infos = safetensors_io.model_index(hf_dir)
        if embed not in infos or head not in infos:
            return cfg
        if infos[embed].shape == infos[head].shape and np.array_equal(
                safetensors_io.read_tensor(infos[embed]), safetensors_io.read_tensor(infos[head])):
            return cfg
    except safetensors_io.SafetensorsError:
        return cfg
    print(f"note: {hf_dir}: config.json ties the word embeddings, but {head} differs from {embed}; "
          f"converting untied (with the file's head), as transformers loads it", file=sys.stderr,
          flush=True)
    return cfg.replace(tie_word_embeddings=False)


def _read_json(path: str) -> dict:
    try:
        d = read_json(path)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a non-UTF-8 file
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return d


def plan_hf_to_ours(infos: dict[str, safetensors_io.TensorInfo],
                    cfg: ModelConfig) -> list[safetensors_io.TensorInfo]:
    """The tensors to convert, after checking every name and shape against `cfg` (headers only)."""
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if cfg.tie_word_embeddings and embed not in infos and head in infos:
        # safetensors' save_model stores a shared tensor once, under the name that sorts first:
        # for a tied Qwen2/Qwen3 that is lm_head.weight, which transformers loads as the
        # embedding too.
        infos = dict(infos)
        infos[embed] = dataclasses.replace(infos.pop(head), name=embed)
    wanted = []
    for name, info in infos.items():
        if check_hf_tensor(name, info.shape, cfg) is not None:
            # integers or bools, e.g. a quantized export's packed values (bfloat16 is kind "V")
            if info.dtype.kind in "iub":
                raise WeightError(f"weight {name} is stored as {info.dtype.name}, not floating "
                                  f"point (a quantized checkpoint?); convert the float weights")
            wanted.append(info)
    missing = [k for k in expected_hf_keys(cfg) if k not in infos]
    if missing:
        raise WeightError(f"checkpoint is missing {len(missing)} weight(s) the config needs: "
                          f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return wanted


def convert_hf_to_ours(hf_dir: str, cfg: ModelConfig, progress: bool = False) -> dict:
    """Read an HF safetensors checkpoint into our nested pure-dict param tree (numpy leaves)."""
    if not os.path.isdir(hf_dir):
        raise safetensors_io.SafetensorsError(f"HF model directory not found: {hf_dir}")
    plan = plan_hf_to_ours(safetensors_io.model_index(hf_dir), cfg)
    target = _np_dtype(cfg.param_dtype)
    report = _Progress("hf-to-flax", len(plan), sum(i.nbytes for i in plan), progress)
    flat: dict[str, np.ndarray] = {}
    for info, array in safetensors_io.iter_tensors(plan):
        path, ours = hf_to_ours(info.name, array, cfg)
        del array  # the raw HF buffer; `ours` is a transposed copy (or a view for 1-D tensors)
        flat[path] = np.ascontiguousarray(ours.astype(target, copy=False))
        report.step(info.nbytes)
    _check_against_model(flat, cfg)
    return nest(flat)


def _check_against_model(flat: dict[str, np.ndarray], cfg: ModelConfig) -> None:
    """Our tree must be exactly the model's parameter set (guards the table, shapes included)."""
    want = {k: tuple(v.shape) for k, v in flat_params(abstract_model(cfg)).items()}
    missing = sorted(set(want) - set(flat))
    extra = sorted(set(flat) - set(want))
    if missing or extra:
        raise WeightError(f"converted params do not match the model: missing {missing[:5]}, extra "
                          f"{extra[:5]}")
    for k, shape in want.items():
        if flat[k].shape != shape:
            raise WeightError(f"shape mismatch for {k}: converted {flat[k].shape}, model expects "
                              f"{shape}")


def hf_to_flax(hf_dir: str, out: str, dtype: str | None = None, compute_dtype: str | None = None,
               overwrite: bool = False, progress: bool = False, mesh=None,
               record_source: bool = False) -> ModelConfig:
    """HF dir (config.json + safetensors [+ tokenizer]) -> our checkpoint dir. Returns its config.

    `dtype` is the stored parameter dtype (default: the HF config's if float32 or bfloat16, else
    float32: float16 sources are stored as float32), `compute_dtype` the matmul
    dtype recorded in our config (default float32; `load_model(dtype=...)` can override it).
    With `mesh` (a Mesh, an AbstractMesh or [data, fsdp, tensor] sizes) each array is stored in
    chunks of its shards on that mesh, so that a load onto it reads each host's shards only;
    without, one chunk per array. `record_source` writes SOURCE_RECORD (see `conversion_stale`).
    """
    if not os.path.isdir(hf_dir):
        raise safetensors_io.SafetensorsError(f"HF model directory not found: {hf_dir}")
    _check_out_dir(out, overwrite)
    cfg = read_hf_config(hf_dir)
    changes = {k: v for k, v in (("param_dtype", dtype), ("dtype", compute_dtype)) if v}
    for v in changes.values():
        if v not in DTYPES:
            raise ConfigError(f"unsupported dtype {v!r}; supported: {', '.join(DTYPES)}")
    cfg = cfg.replace(**changes)
    mesh = None if mesh is None else chunk_mesh(mesh)
    chunks = None if mesh is None else shard_chunk_shapes(cfg, mesh)
    record = {SOURCE_RECORD: source_record(hf_dir, mesh)} if record_source else None
    params = convert_hf_to_ours(hf_dir, cfg, progress)
    if progress:
        print(f"hf-to-flax: writing orbax checkpoint to {out}", file=sys.stderr, flush=True)
    save_params(out, params, cfg, tokenizer_dir=hf_dir, replace_any=overwrite, chunks=chunks,
                extra_json=record)
    return cfg


def chunk_mesh(mesh):
    """`mesh` as something `shard_chunk_shapes` lays shards out on: a Mesh or AbstractMesh as
    it is, [data, fsdp, tensor] sizes as an AbstractMesh (no devices needed)."""
    if hasattr(mesh, "shape") and hasattr(mesh, "axis_names"):
        return mesh
    sizes = tuple(mesh)
    if len(sizes) != len(MESH_AXES) or not all(isinstance(n, int) and n >= 1 for n in sizes):
        raise ConfigError(f"mesh must be {len(MESH_AXES)} sizes (data, fsdp, tensor), each a whole "
                          f"number >= 1, got {list(sizes)}")
    return AbstractMesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


# ---- convert once, reuse ----------------------------------------------------------------------

SOURCE_RECORD = "source.json"  # in a checkpoint converted with record_source: what it came from
_RECORD_FORMAT = 1  # raised when a conversion of the same files would now come out differently


def source_record(hf_dir: str, mesh=None) -> dict:
    """What a conversion of `hf_dir` depends on: the directory, the size and modification time of
    its config, generation config, index and safetensors files (reading no tensor), and the
    sizes of the mesh whose shards it is stored in (None: one chunk per array)."""
    names = sorted(n for n in storage.listdir(hf_dir) if n.endswith(".safetensors") or n in (
        "config.json", "generation_config.json", safetensors_io.INDEX_FILE))
    files = {name: storage.fingerprint(storage.join(hf_dir, name)) for name in names}
    sizes = None if mesh is None else dict(chunk_mesh(mesh).shape)
    where = hf_dir if storage.is_url(hf_dir) else os.path.realpath(hf_dir)  # may be gs://
    return {"format": _RECORD_FORMAT, "hf_dir": where, "files": files, "mesh": sizes}


def conversion_stale(hf_dir: str, out: str, mesh=None) -> str | None:
    """Why `out` is not an up-to-date conversion of `hf_dir` stored in the shards of `mesh`
    (None when it is): missing, made without a record, from another directory, from files that
    changed since (a file's size or modification time), or for another mesh. Nothing but
    `out`'s record and `hf_dir`'s file listing is read."""
    try:  # out may be a URL (a gs:// run_dir)
        recorded = read_json(storage.join(out, SOURCE_RECORD))
    except (FileNotFoundError, storage.StorageError):
        return "not converted yet" if not storage.exists(out) else f"{out} has no {SOURCE_RECORD}"
    except (OSError, ValueError) as e:
        return f"{out}/{SOURCE_RECORD} is unreadable ({e})"
    now = source_record(hf_dir, mesh)
    if not isinstance(recorded, dict) or recorded.get("format") != now["format"]:
        return "converted by an earlier version"
    if recorded.get("hf_dir") != now["hf_dir"]:
        return f"converted from {recorded.get('hf_dir')}"
    old = recorded.get("files") if isinstance(recorded.get("files"), dict) else {}
    changed = sorted(n for n in set(old) | set(now["files"]) if old.get(n) != now["files"].get(n))
    if changed:
        return f"changed since: {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}"
    if recorded.get("mesh") != now["mesh"]:
        return f"stored in the shards of mesh {recorded.get('mesh')}, not {now['mesh']}"
    return None


# ---- ours -> HF --------------------------------------------------------------------------------

def plan_shards(entries: list[tuple[str, np.dtype, tuple[int, ...]]], max_bytes: int) -> list[list]:
    """Greedy split into files of at most `max_bytes` of tensor data (a bigger tensor gets its
    own)."""
    shards, current, size = [], [], 0
    for entry in entries:
        n = int(np.prod(entry[2])) * np.dtype(entry[1]).itemsize
        if current and size + n > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += n
    return shards + [current] if current else shards


def flax_to_hf(ckpt: str, out: str, dtype: str | None = None,
               max_shard_size: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
               progress: bool = False) -> list[str]:
    """Our checkpoint -> HF dir that `AutoModelForCausalLM.from_pretrained` loads. Returns the
    safetensors file names written."""
    cfg = load_config(ckpt)
    out_dtype = dtype or cfg.param_dtype
    if out_dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {out_dtype!r}; supported: {', '.join(DTYPES)}")
    if max_shard_size <= 0:
        raise ConfigError(f"--max-shard-size must be positive, got {max_shard_size}")
    _check_out_dir(out, overwrite)
    # host views, no copy
    flat = {k: np.asarray(v) for k, v in flat_params(load_model(ckpt)).items()}
    target = _np_dtype(out_dtype)
    entries = [(name, target, hf_shape(name, cfg)) for name in expected_hf_keys(cfg)]
    shards = plan_shards(entries, max_shard_size)
    names = ([safetensors_io.SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = sum(int(np.prod(s)) * target.itemsize for _, _, s in entries)
    report = _Progress("flax-to-hf", len(entries), total, progress)

    def hf_arrays() -> Iterator[tuple[str, np.ndarray]]:
        for name, array in ours_to_hf(flat, cfg):
            array = array.astype(target, copy=False)
            report.step(array.nbytes)
            yield name, array

    arrays = hf_arrays()
    hf_cfg = cfg.replace(param_dtype=out_dtype)
    with storage.staged_dir(out) as tmp:  # locally a rename into place, at a URL an upload
        for name, shard in zip(names, shards):
            safetensors_io.write_file(os.path.join(tmp, name), shard, arrays)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {e[0]: n for n, shard in zip(names, shards) for e in shard}}
            _write_json(os.path.join(tmp, safetensors_io.INDEX_FILE), index)
        _write_json(os.path.join(tmp, "config.json"), hf_cfg.to_hf_dict())
        copy_tokenizer_files(ckpt, tmp)
        _write_generation_config(os.path.join(tmp, "generation_config.json"), hf_cfg)
    return names


def _write_json(path: str, d: dict) -> None:
    with open(path, "w") as f:
        json.dump(d, f, indent=2)


def _write_generation_config(path: str, cfg: ModelConfig) -> None:
    """Keep a copied generation_config.json's settings; our special ids win where we have them
    (Qwen2.5-Instruct names its pad token only there, so an id we lack is kept, not dropped)."""
    gen = _read_json(path) if os.path.exists(path) else {}
    eos = list(cfg.eos_token_ids)
    ours = {"bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    gen.update({k: v for k, v in ours.items() if v is not None})
    _write_json(path, gen)
