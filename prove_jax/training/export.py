"""The trained model as RUN_DIR/model (`prove-jax generate --model`), with export.json naming
its step, so that a relaunch redoes an export cut short."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from prove_jax import distributed, storage
from prove_jax.checkpoints import checkpoint
from prove_jax.models.config import ModelConfig


def export_model(path: str, graphdef, params: dict, model_cfg: ModelConfig, tokenizer_dir: str,
                 dtype: str | None = None) -> str:
    """RUN_DIR/model: a prove_jax model checkpoint that `checkpoint.load_model` reads.

    Single process: checkpoint.save_model (atomic rename). Several processes: every host writes
    its shards through orbax (itself atomic: a temp folder finalised by the primary host), then
    host 0 adds config and tokenizer files. `dtype` (the run's `export_dtype`) stores the
    weights in that dtype instead of the trained one (bfloat16: half the size, for inference).
    """
    if dtype is not None and dtype != model_cfg.param_dtype:
        params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                              else x, params)  # each shard where it lies
        model_cfg = model_cfg.replace(param_dtype=dtype)
    if jax.process_count() == 1:
        return checkpoint.save_model(path, nnx.merge(graphdef, params), model_cfg, tokenizer_dir)
    with ocp.StandardCheckpointer() as ckptr:  # closing waits for every host's writes
        ckptr.save(storage.join(storage.absolute(path), "params"), params, force=True)
    if distributed.is_main_process():
        checkpoint.copy_tokenizer_files(tokenizer_dir, path)
        storage.write_text(storage.join(path, "config.json"),
                           json.dumps(model_cfg.to_json_dict(), indent=2))
    distributed.barrier("export_done")
    return path


EXPORT_MARKER = "export.json"  # in RUN_DIR/model: {"step": the train step the weights are from}


def exported_step(model_dir: str, dtype: str | None = None) -> int | None:
    """The step recorded with an export, None when there is none (or an older export without
    the record, or, given `dtype`, one whose weights are stored in another dtype: then it is
    redone)."""
    try:
        step = json.loads(storage.read_text(storage.join(model_dir, EXPORT_MARKER))).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    complete = storage.isfile(storage.join(model_dir, "config.json"))
    if complete and dtype is not None:
        try:
            complete = checkpoint.load_config(model_dir).param_dtype == dtype
        except checkpoint.CheckpointError:
            complete = False
    return step if isinstance(step, int) and complete else None


def export_at_step(path: str, step: int, graphdef, params: dict, model_cfg: ModelConfig,
                   tokenizer_dir: str, dtype: str | None = None) -> str:
    """export_model, then the step record; written last, so a cut-short export has none."""
    export_model(path, graphdef, params, model_cfg, tokenizer_dir, dtype)
    if distributed.is_main_process():
        storage.write_text(storage.join(path, EXPORT_MARKER), json.dumps({"step": step}))
    distributed.barrier("export_marked")
    return path
