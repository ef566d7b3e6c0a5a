"""Build a Decoder from checkpoint paths (the one place CLIs, demo and benchmark load models)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax

from prove_jax import storage
from prove_jax.checkpoints.checkpoint import (CheckpointError, load_config, load_model,
                                              load_model_stacked, load_tokenizer)
from prove_jax.decoding.engine import Decoder
from prove_jax.decoding.options import DecodeError, DecodeOptions
from prove_jax.models.sharding import MeshError, inference_mesh, kv_cache_bytes, make_mesh
from prove_jax.checkpoints.commit_head_io import load_commit_head
from prove_jax.checkpoints.vocab import check_shared_vocabulary


def parse_mesh(spec: str | None, configs: Sequence = (), dtype: str = "float32",
               kv_shape: tuple[int, int] | None = None):
    """'4,1,2' -> a (data, fsdp, tensor) mesh. None -> the inference mesh of the models of
    `configs` (proposer first: tensor parallel over its kv heads as far as the weights, and
    with `kv_shape` (rows, slots) the KV cache of that many rows, need to fit,
    `sharding.inference_mesh`), or all devices on data without configs; None for one device."""
    if spec is None:
        if configs:
            kv = 0 if kv_shape is None else kv_cache_bytes(configs, *kv_shape, dtype)
            return inference_mesh(configs, dtype, kv_bytes=kv)
        n = len(jax.devices())
        return None if n == 1 else make_mesh((n, 1, 1))
    try:
        shape = tuple(int(x) for x in spec.split(","))
    except ValueError:
        raise DecodeError(f"--mesh must be three integers like 4,1,2, got {spec!r}") from None
    if len(shape) != 3:
        raise DecodeError(f"--mesh must be data,fsdp,tensor (three integers), got {spec!r}")
    try:
        return make_mesh(shape)
    except ValueError as e:
        raise DecodeError(str(e)) from None


@dataclasses.dataclass
class LoadedModels:
    """A proposer checkpoint's model and tokenizer, an optional verifier (and its commit head),
    and the ids decoding stops and pads with: what every Decoder over these weights shares."""
    proposer: object
    verifier: object | None
    commit_head: object | None
    tokenizer: object | None
    eos_ids: list[int]
    pad_id: int


def load_models(
    model_path: str,
    verifier_path: str | None = None,
    with_head: bool = False,
    dtype: str = "float32",
    mesh=None,
    tokenizer=None,
    stacked: bool = False,
) -> LoadedModels:
    """Read a proposer checkpoint and, with `verifier_path`, its verifier (and the verifier's
    commit head with `with_head`), each restored as `dtype` onto `mesh` (None: one device),
    with `stacked` straight into the stacked layers a scanned decoder runs (`load_model_stacked`:
    no second copy of the weights while they are stacked).
    The pair's shared vocabulary is checked from the configs and tokenizers before any weight
    is read. `tokenizer`: the proposer's, when the caller has already loaded it."""
    if not storage.isdir(model_path):  # a local path or a URL (gs://)
        raise CheckpointError(f"model checkpoint not found: {model_path}")
    if tokenizer is None:
        tokenizer = load_tokenizer(model_path)
    if verifier_path is not None:
        if not storage.isdir(verifier_path):
            raise CheckpointError(f"verifier checkpoint not found: {verifier_path}")
        if tokenizer is not None:
            check_shared_vocabulary(tokenizer, model_path, [(
                "verifier", verifier_path, load_config(verifier_path).vocab_size,
                load_tokenizer(verifier_path))])
    load = load_model_stacked if stacked else load_model
    model = load(model_path, mesh=mesh, dtype=dtype, param_dtype=dtype)
    verifier = head = None
    if verifier_path is not None:
        verifier = load(verifier_path, mesh=mesh, dtype=dtype, param_dtype=dtype)
        if with_head:
            head = load_commit_head(verifier_path, mesh=mesh)
    cfg = model.cfg
    eos = list(cfg.eos_token_ids)
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = [int(tokenizer.eos_token_id)]
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    return LoadedModels(model, verifier, head, tokenizer, eos, pad)


def build_decoder(model_path: str, options: DecodeOptions, verifier_path: str | None = None,
                  dtype: str = "float32", mesh_shape: str | None = None, mesh=None, tokenizer=None,
                  kv_shape: tuple[int, int] | None = None):
    """(Decoder, tokenizer or None) for a proposer checkpoint and an optional verifier;
    `tokenizer`: the checkpoint's, when the caller has already loaded it. The mesh: `mesh`,
    else `mesh_shape` ('data,fsdp,tensor'), else the models' inference mesh (`parse_mesh`),
    sized for the KV cache of `kv_shape` (rows, slots) when the caller knows it."""
    if not storage.isdir(model_path):  # a local path or a URL (gs://)
        raise CheckpointError(f"model checkpoint not found: {model_path}")
    if tokenizer is None:
        tokenizer = load_tokenizer(model_path)
    verify = options.mode == "verify"
    configs = [load_config(model_path)]
    if verify:
        if verifier_path is None or not storage.isdir(verifier_path):
            raise CheckpointError(f"verifier checkpoint not found: {verifier_path}")
        configs.append(load_config(verifier_path))
    if mesh is None:
        try:
            mesh = parse_mesh(mesh_shape, configs, dtype, kv_shape)
        except MeshError as e:
            raise DecodeError(str(e)) from None
    models = load_models(model_path, verifier_path if verify else None,
                         with_head=verify and options.verify.commit_rule == "head", dtype=dtype,
                         mesh=mesh,
                         tokenizer=tokenizer, stacked=options.memory.scan_layers)
    decoder = Decoder(models.proposer, models.eos_ids, options, verifier=models.verifier,
                      commit_head=models.commit_head, mesh=mesh, pad_id=models.pad_id)
    return decoder, models.tokenizer
