"""Model checkpoints: a directory with our `config.json`, orbax `params/`, and tokenizer files.

Writes go to a temporary sibling directory that is renamed into place only when complete, so a
crash never leaves a half-written checkpoint under the final name. Restores go straight into
the target sharding: each host reads the stored chunks that hold its shards, exactly its shards
when the chunks are a mesh's shards (`shard_chunk_shapes`; docs/conversion.md "Loading sharded").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from prove_jax import storage
from prove_jax.checkpoints.abandoned_reads import restore_attempt
from prove_jax.checkpoints.restore_errors import restore_failure
from prove_jax.errors import ProveJaxError
from prove_jax.files import atomic_dir, check_replaceable
from prove_jax.models import sharding
from prove_jax.models.config import ConfigError, ModelConfig
from prove_jax.models.qwen2 import Qwen2, stack_layers
from prove_jax.models.params import abstract_model, abstract_sharded, dotted_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja")


class CheckpointError(ProveJaxError, ValueError):
    """A checkpoint that is missing, incomplete or unreadable."""


def copy_tokenizer_files(src_dir: str | None, dst_dir: str) -> list[str]:
    """The tokenizer files of `src_dir` copied into `dst_dir` (either may be a URL)."""
    if not src_dir or not storage.isdir(src_dir):
        return []
    if storage.is_url(src_dir) or storage.is_url(dst_dir):
        with storage.local_copy(src_dir, TOKENIZER_FILES) as local:
            return storage.upload_dir(local, dst_dir, TOKENIZER_FILES)
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if os.path.exists(src):
            shutil.copy2(src, os.path.join(dst_dir, name))
            copied.append(name)
    return copied


def params_pure_dict(model_or_state) -> dict:
    state = (
        model_or_state
        if isinstance(model_or_state, nnx.State)
        else nnx.state(model_or_state, nnx.Param)
    )
    return nnx.to_pure_dict(state)


def save_model(path: str, model: Qwen2, cfg: ModelConfig | None = None,
               tokenizer_dir: str | None = None, replace_any: bool = False) -> str:
    """Save params + config (+ tokenizer files copied from `tokenizer_dir`) atomically."""
    return save_params(path, params_pure_dict(model), cfg or model.cfg, tokenizer_dir, replace_any)


def save_params(path: str, params: dict, cfg: ModelConfig, tokenizer_dir: str | None = None,
                replace_any: bool = False, chunks: Mapping[str, tuple[int, ...]] | None = None,
                extra_json: Mapping[str, dict] | None = None) -> str:
    """Write a checkpoint from a pure-dict param tree (jax or numpy leaves, the structure of
    `nnx.to_pure_dict(nnx.state(model, nnx.Param))`) atomically: the one writer of the format,
    for `save_model` and the HF converter alike. This process writes it alone (on several hosts
    the others do not take part).

    Synchronous, without orbax's deep copy of numpy leaves and without OCDBT (which buffers
    every array until the commit), to keep the converter's peak memory low (see
    benchmarks/convert.md); `load_model` reads either layout. `path` must be new, empty or an
    earlier checkpoint, unless `replace_any` (the converter's --overwrite).

    `chunks` ({dotted name: shape}, from `shard_chunk_shapes`) stores those numpy leaves in
    chunks of that shape instead of one chunk per array: a restore reads whole chunks, so with
    a mesh's shards as chunks each host reads exactly its own shards. `extra_json` files
    ({name: object}) are written into the checkpoint, inside the same atomic rename.
    """
    if not replace_any:
        check_replaceable(path, "params", "a prove-jax checkpoint", CheckpointError)
    alone = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                               active_processes={jax.process_index()})
    url = storage.is_url(path)
    if url:  # no rename at a URL: emptied, then config.json last (load_config reads it first)
        storage.require_bucket(path)
        storage.remove_tree(path)
    with (contextlib.nullcontext(path) if url else atomic_dir(path)) as tmp, \
            _without_ocdbt_merge_warning():
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(
                use_ocdbt=False, type_handler_registry=_streaming_handlers(chunks),
                multiprocessing_options=alone), multiprocessing_options=alone) as ckptr:
            ckptr.save(storage.join(tmp, "params"), args=ocp.args.PyTreeSave(params))
        for name, content in (extra_json or {}).items():
            storage.write_text(storage.join(tmp, name), json.dumps(content, indent=2))
        copy_tokenizer_files(tokenizer_dir, tmp)
        storage.write_text(
            storage.join(tmp, "config.json"), json.dumps(cfg.to_json_dict(), indent=2)
        )
    return path


def shard_chunk_shapes(cfg: ModelConfig, mesh, rules: Mapping = sharding.DEFAULT_RULES
                       ) -> dict[str, tuple[int, ...]]:
    """{dotted parameter name: the shape of one device's shard} on `mesh` (a Mesh, or an
    AbstractMesh of the sizes of a mesh this machine does not have): the chunks `save_params`
    stores so that `load_model(mesh=...)` onto that mesh reads each shard as one chunk."""
    _, placed = abstract_sharded(abstract_model(cfg), mesh, rules)
    return {name: tuple(leaf.sharding.shard_shape(leaf.shape))
            for name, leaf in _dotted_leaves(placed).items()}


@contextlib.contextmanager
def _without_ocdbt_merge_warning():
    """Orbax warns "Skipping merge of OCDBT checkpoints: No per-process OCDBT checkpoint subdirs
    found" on every save without OCDBT, which is what `save_model` chose: a warning that names a
    temporary path and reads like a failure. Only that message is dropped."""
    absl = logging.getLogger("absl")
    drop = lambda record: "Skipping merge of OCDBT checkpoints" not in record.getMessage()
    absl.addFilter(drop)
    try:
        yield
    finally:
        absl.removeFilter(drop)


def _streaming_handlers(chunks: Mapping[str, tuple[int, ...]] | None = None):
    """Orbax handlers for a synchronous save: numpy leaves written in place (no deepcopy; the
    copy only protects callers that mutate arrays during an async save), in `chunks`."""
    handlers = ocp.type_handlers
    return handlers.create_type_handler_registry(
        (np.ndarray, _ChunkedNumpyHandler(chunks or {})),
        (jax.Array, handlers.get_type_handler(jax.Array)))


class _ChunkedNumpyHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's numpy handler, storing each array named in `chunks` in chunks of that shape.

    Orbax stores a numpy array as one chunk (its `SaveArgs.chunk_byte_size` splits the largest
    dimension first, whatever the mesh), and a read decodes every chunk it touches: one host's
    slice of a one-chunk array costs the whole array in host memory. A jax.Array is stored in
    chunks of its shards; this gives a numpy tree the shards of the mesh it will be loaded on.
    """

    def __init__(self, chunks: Mapping[str, tuple[int, ...]]):
        super().__init__(deepcopy_host_arrays=False)
        self._chunks = dict(chunks)

    async def _background_serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        writes = []
        for value, info, arg in zip(values, infos, args):
            await info.await_path_creation()
            chunk = self._chunks.get(info.name, value.shape)
            tspec = ocp.type_handlers.get_json_tspec_write(
                info, use_ocdbt=bool(info.is_ocdbt_checkpoint), global_shape=value.shape,
                local_shape=tuple(chunk), dtype=value.dtype, arg=arg)
            writes.append(self._open_and_write(value, tspec, info.ts_context))
        await asyncio.gather(*writes)


def load_config(path: str) -> ModelConfig:
    if not storage.isdir(path):
        raise CheckpointError(f"checkpoint directory not found: {path}")
    try:
        if storage.is_url(path):
            with storage.local_copy(path, ("config.json",)) as local:
                return ModelConfig.load(local)
        return ModelConfig.load(path)
    except ConfigError as e:
        raise CheckpointError(f"bad checkpoint {path}: {e}") from None


def load_model(path: str, mesh=None, rules: Mapping = sharding.DEFAULT_RULES,
               dtype: str | None = None, param_dtype: str | None = None,
               remat: bool = False) -> Qwen2:
    """Restore a model; with a mesh each array is read directly into its target sharding.

    `dtype` / `param_dtype` override the compute / storage dtype recorded in the checkpoint
    (e.g. bfloat16 storage restored as float32 for CPU).
    """
    cfg = load_config(path)
    overrides = {k: v for k, v in (("dtype", dtype), ("param_dtype", param_dtype)) if v}
    cfg = cfg.replace(**overrides)
    params_dir = storage.join(storage.absolute(path), "params")
    if not storage.isdir(params_dir):
        if any(name.endswith(".safetensors") for name in storage.listdir(path)):
            raise CheckpointError(
                f"{path} is a Hugging Face model directory, not a prove-jax checkpoint; convert it "
                f"first: prove-jax convert hf-to-flax --hf-dir {path} --out CKPT"
            )
        raise CheckpointError(f"checkpoint {path} has no params/ directory (incomplete or not a "
                              f"prove-jax checkpoint)")
    graphdef, target = abstract_sharded(abstract_model(cfg, remat), mesh, rules)
    _check_stored_shapes(params_dir, target)
    try:
        with ocp.StandardCheckpointer() as ckptr, restore_attempt(params_dir):
            restored = ckptr.restore(params_dir, target)
    except Exception as e:  # orbax raises many types; name the checkpoint and the cause
        raise CheckpointError(restore_failure(params_dir, e)) from None
    return nnx.merge(graphdef, restored)


@functools.partial(jax.jit, donate_argnums=0)
def _put_layer(stacked: jax.Array, layer: jax.Array, index: jax.Array) -> jax.Array:
    """stacked [L, ...] (donated: updated in place) with layer `index`'s weight written."""
    return jax.lax.dynamic_update_index_in_dim(stacked, layer.astype(stacked.dtype), index, 0)


def load_model_stacked(path: str, mesh=None, rules: Mapping = sharding.DEFAULT_RULES,
                       dtype: str | None = None, param_dtype: str | None = None) -> Qwen2:
    """`load_model` with its layers stacked into one `LayerStack`, as a scanned decoder runs
    them (`stack_layers`), restored straight into the stacked arrays: each layer is read
    (placed on the mesh as one layer's weights are), written into the stacked weights in place
    and dropped before the next is read, so the load holds the weights and one layer at most.
    Stacking a restored model copies every weight while the per-layer ones live (2x the weights
    at the peak: a lossless 32B on v6e-8 held ~29.8 of 31.25 GiB per chip, docs/decoding.md)."""
    cfg = load_config(path)
    cfg = cfg.replace(**{k: v for k, v in (("dtype", dtype), ("param_dtype", param_dtype)) if v})
    params_dir = storage.join(storage.absolute(path), "params")
    if not storage.isdir(params_dir):
        load_model(path, mesh, rules, dtype, param_dtype)  # raises its error about the directory
    _, target = abstract_sharded(abstract_model(cfg), mesh, rules)
    _check_stored_shapes(params_dir, target)
    graphdef, stacked = abstract_sharded(
        nnx.eval_shape(lambda: stack_layers(Qwen2(cfg, nnx.Rngs(0)))), mesh, rules
    )
    per_layer = target.pop("layers")

    def restore(ckptr, item):
        return ckptr.restore(
            params_dir,
            args=ocp.args.PyTreeRestore(
                item=item,
                restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                partial_restore=True,
            ),
        )

    try:
        with ocp.PyTreeCheckpointer() as ckptr, restore_attempt(params_dir):
            params = restore(ckptr, target)  # all but the layers
            layers = jax.tree.map(
                lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), stacked["layers"]["layer"]
            )
            for i in range(cfg.num_layers):
                one = restore(ckptr, {"layers": {i: per_layer[i]}})["layers"][i]
                layers = jax.tree.map(lambda buf, x: _put_layer(buf, x, np.int32(i)), layers, one)
                jax.tree.map(lambda x: x.delete(), one)
    except Exception as e:  # orbax raises many types; name the checkpoint and the cause
        raise CheckpointError(restore_failure(params_dir, e)) from None
    return nnx.merge(graphdef, {**params, "layers": {"layer": layers}})


def _dotted_leaves(tree) -> dict[str, object]:
    return {dotted_path(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_stored_shapes(params_dir: str, target) -> None:
    """Name the parameter whose stored shape differs from the model's, before orbax's restore
    fails with a message that names neither. An unreadable metadata file is left to the restore."""
    try:  # a failed metadata read leaves abandoned reads too: quieted like a failed restore
        with ocp.StandardCheckpointer() as ckptr, restore_attempt(params_dir):
            stored = _dotted_leaves(ckptr.metadata(params_dir).item_metadata)
            if not stored:  # orbax logs and returns nothing when the layout is damaged
                raise CheckpointError(f"checkpoint {params_dir}: its parameter metadata cannot be "
                                      f"read (an incomplete or corrupt checkpoint)")
    except CheckpointError:
        raise
    except Exception:
        return
    wanted = _dotted_leaves(target)
    for name, want in wanted.items():
        if name not in stored:
            raise CheckpointError(f"checkpoint {params_dir} has no parameter {name}")
    unexpected = sorted(set(stored) - set(wanted))
    if unexpected:
        hint = " (tie_word_embeddings?)" if unexpected == ["lm_head"] else ""
        what = "parameter" if len(unexpected) == 1 else f"{len(unexpected)} parameters"
        raise CheckpointError(f"checkpoint {params_dir} has {what} {', '.join(unexpected[:5])}"
                              f"{' ...' if len(unexpected) > 5 else ''} that the config does not "
                              f"expect{hint}")
    for name, want in wanted.items():
        have = tuple(getattr(stored[name], "shape", ()) or ())
        if have != tuple(want.shape):
            hint = ""
            if sorted(have) == sorted(want.shape) and name.endswith(("kernel", "lm_head")):
                hint = (
                    "; it holds the [in, out] kernels of prove-jax before kernels followed HF's "
                    "[out, in] order: convert it again (flax-to-hf with the old version, then "
                    "hf-to-flax)"
                )
            raise CheckpointError(f"checkpoint {params_dir}: parameter {name} has shape {have}, "
                                  f"the config implies {tuple(want.shape)}{hint}")


def load_tokenizer(path: str):
    """The HF tokenizer saved with a checkpoint, or None when there is none."""
    if not storage.exists(storage.join(path, "tokenizer.json")) and not storage.exists(
            storage.join(path, "vocab.json")):
        return None
    from transformers import AutoTokenizer  # slow to import: only a checkpoint with a vocabulary
    with storage.local_copy(path, TOKENIZER_FILES) as local:  # transformers reads local files
        return AutoTokenizer.from_pretrained(local)
