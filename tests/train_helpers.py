"""Shared pieces of the trainer tests: a tiny YAML config, a real tokenizer, real text on disk."""

from __future__ import annotations

import os

import yaml

from prove_jax.data import pipeline as data_lib
from prove_jax.training.config import load_config
from prove_jax.training.run_tokenizer import resolve_tokenizer
from tests.tokenizers_fixture import make_tokenizer, stdlib_text

TINY_MODEL = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0,
                  max_position_embeddings=256)


def write_tokenizer(tmp_path, vocab_size: int = 300) -> str:
    path = os.path.join(str(tmp_path), "tokenizer")
    if not os.path.isdir(path):
        make_tokenizer(vocab_size).save_pretrained(path)
    return path


def write_text(tmp_path, modules=("json", "textwrap"), name: str = "text.py") -> str:
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as f:
        f.write(stdlib_text(modules))
    return path


def write_config(tmp_path, run_name: str = "run", **fields) -> str:
    """A YAML config for the tiny model (fields override the defaults below)."""
    d = {"model": {"config": dict(TINY_MODEL)},
         "tokenizer": {"path": write_tokenizer(tmp_path)},
         "data": write_text(tmp_path), "run_dir": os.path.join(str(tmp_path), run_name),
         "objective": "mars", "block_size": 4, "max_length": 32, "global_batch_size": 8,
         "steps": 8, "log_every": 1, "save_every": 4, "keep": 3, "mesh": [1, 1, 1],
         "optimizer": {"lr": 3e-3, "warmup_ratio": 0.25, "min_lr_ratio": 0.1}} | fields
    path = os.path.join(str(tmp_path), f"{run_name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(d, f)
    return path


def tiny_config(tmp_path, run_name: str = "run", overrides=(), **fields):
    return load_config(write_config(tmp_path, run_name, **fields), list(overrides))


def first_batch(cfg):
    """The first global batch a one-host run of `cfg` trains on (its tokenizer, data and seed)."""
    tokenizer, _ = resolve_tokenizer(cfg)
    return next(data_lib.make_dataset(
        cfg.data, tokenizer, max_length=cfg.max_length, block_size=cfg.block_size,
        global_batch_size=cfg.global_batch_size, seed=cfg.seed, process_index=0, process_count=1))
