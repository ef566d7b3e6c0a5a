"""The `<|mask|>` token MARS needs: add it to the tokenizer, and grow the model only if it must.

Qwen2.5 checkpoints carry padded embedding rows (151,936 rows for 151,665 ids), so the new
token lands on an existing row and nothing is resized. A tokenizer without spare rows gets the
embedding (and an untied LM head) grown to the next multiple of 64; the new rows start at the
mean of the old ones, a neutral point whose logit is the average logit (no token is favoured).
The id is recorded in `ModelConfig.mask_token_id`, which `checkpoint.save_model` saves.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from prove_jax.errors import ProveJaxError
from prove_jax.models import sharding
from prove_jax.models.config import ModelConfig
from prove_jax.models.qwen2 import Qwen2
from prove_jax.models.params import abstract_model, flat_params, set_flat_params

MASK_TOKEN = "<|mask|>"
VOCAB_MULTIPLE = 64


class VocabError(ProveJaxError, ValueError):
    """A tokenizer and model config that disagree about the mask token."""


def _token_id(tokenizer, token: str) -> int | None:
    found = tokenizer.get_vocab().get(token)
    return None if found is None else int(found)


def ensure_mask_token(tokenizer, cfg: ModelConfig) -> tuple[object, ModelConfig, bool]:
    """Add `<|mask|>` when missing; returns (tokenizer, cfg with mask_token_id, grown).

    The tokenizer is updated in place. `grown` is True when the id does not fit the model's
    rows: cfg.vocab_size is then rounded up and the caller must run `grow_embeddings`.
    """
    mask_id = _token_id(tokenizer, MASK_TOKEN)
    if mask_id is None:
        if cfg.mask_token_id is not None:
            raise VocabError(f"model config says mask_token_id={cfg.mask_token_id} but the "
                             f"tokenizer has no {MASK_TOKEN} token (use the tokenizer saved with "
                             "the checkpoint)")
        tokenizer.add_tokens([MASK_TOKEN], special_tokens=True)
        mask_id = _token_id(tokenizer, MASK_TOKEN)
    elif cfg.mask_token_id is not None and cfg.mask_token_id != mask_id:
        raise VocabError(f"model config says mask_token_id={cfg.mask_token_id} but the tokenizer "
                         f"maps {MASK_TOKEN} to {mask_id}")
    grown = mask_id >= cfg.vocab_size
    vocab_size = -(-(mask_id + 1) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE if grown else cfg.vocab_size
    return tokenizer, cfg.replace(vocab_size=vocab_size, mask_token_id=mask_id), grown


def check_shared_vocabulary(tokenizer, where: str, models) -> None:
    """The ids of `tokenizer` (read from `where`) mean the same to every model of a
    proposer/verifier pair: each of `models`, (name, path, embedding rows, its own tokenizer or
    None), has a row for every id, and a tokenizer of its own maps every token to the same id.

    Rows beyond that may differ: Qwen2.5-32B pads its 151,665 ids to 152,064 rows and Qwen2.5-3B
    to 151,936, the paper's proposer/verifier pair. `<|mask|>`, which only the proposer reads,
    is left out.
    """
    ids = {t: i for t, i in tokenizer.get_vocab().items() if t != MASK_TOKEN}
    top = max(ids.values(), default=-1)
    for name, path, rows, own in models:
        if top >= rows:
            raise VocabError(f"the {name} {path} has {rows} embedding rows, but the tokenizer in "
                             f"{where} has ids up to {top}: the {name} was trained on another "
                             f"vocabulary")
        if own is None:
            continue
        theirs = own.get_vocab()
        for token, i in ids.items():
            if theirs.get(token) != i:
                there = "missing" if theirs.get(token) is None else f"id {theirs[token]}"
                raise VocabError(f"the {name}'s tokenizer ({path}) is not the one in {where}: "
                                 f"{token!r} is {there} there and id {i} here")


def _grow(x: jax.Array, new_size: int, axis: int, logical_axes) -> jax.Array:
    """Append rows (along `axis`) equal to the mean of the existing ones, keeping the sharding."""
    def grow(x):
        mean = jnp.mean(x.astype(jnp.float32), axis=axis, keepdims=True).astype(x.dtype)
        extra = list(x.shape)
        extra[axis] = new_size - x.shape[axis]
        return jnp.concatenate([x, jnp.broadcast_to(mean, extra)], axis=axis)

    if isinstance(x.sharding, NamedSharding):
        shape = list(x.shape)
        shape[axis] = new_size
        mesh = x.sharding.mesh
        out = NamedSharding(mesh, sharding.logical_to_spec(logical_axes, shape, mesh))
        return jax.jit(grow, out_shardings=out)(x)
    return jax.jit(grow)(x)


def grow_embeddings(model: Qwen2, new_cfg: ModelConfig) -> Qwen2:
    """A model for `new_cfg` whose old embedding / head rows are copied exactly.

    Every other parameter is shared with `model` (no copy); only embed and lm_head are rebuilt.
    """
    old_v, new_v = model.cfg.vocab_size, new_cfg.vocab_size
    if new_v < old_v:
        raise VocabError(f"cannot shrink the vocabulary from {old_v} to {new_v} rows")
    if model.cfg.replace(vocab_size=new_v, mask_token_id=new_cfg.mask_token_id) != new_cfg:
        raise VocabError("grow_embeddings may only change vocab_size and mask_token_id")
    flat = dict(flat_params(model))
    flat["embed"] = _grow(flat["embed"], new_v, 0, ("vocab", "embed"))
    if not new_cfg.tie_word_embeddings:
        flat["lm_head"] = _grow(flat["lm_head"], new_v, 0, ("vocab", "embed"))
    graphdef, state = nnx.split(abstract_model(new_cfg, model.remat))
    grown = nnx.merge(graphdef, state)
    set_flat_params(grown, flat)
    return grown


def save_tokenizer(tokenizer, ckpt_dir: str) -> list[str]:
    """Write the (updated) tokenizer files into a checkpoint dir, each file replaced atomically."""
    os.makedirs(ckpt_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-tokenizer-", dir=ckpt_dir)
    try:
        tokenizer.save_pretrained(tmp)
        names = sorted(os.listdir(tmp))
        for name in names:
            os.replace(os.path.join(tmp, name), os.path.join(ckpt_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return names
