"""Where a run's model comes from: its config (settled before any weight is read) and the
initial weights of a fresh run (a preset's random init, a prove-jax checkpoint, or model.hf_dir
converted once into RUN_DIR/converted)."""

from __future__ import annotations

import json
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from prove_jax import distributed, storage
from prove_jax.checkpoints import checkpoint, convert
from prove_jax.models import params as params_lib
from prove_jax.models.config import ModelConfig, preset
from prove_jax.training.config import TrainConfig, inline_model_config
from prove_jax.training.errors import TrainError
from prove_jax.training.host_log import log_main
from prove_jax.training.run_checkpoint import saved_run_meta

MASTER_PARAM_DTYPE = "float32"  # trained weights' dtype when model.param_dtype is not set


def low_precision_master_warning(cfg: TrainConfig) -> str | None:
    """The warning a run with explicitly low-precision master weights logs (None: float32)."""
    chosen = cfg.model.param_dtype
    if chosen is None or chosen == "float32":
        return None
    return (f"warning: model.param_dtype={chosen}: weights and optimizer state train in {chosen}, "
            f"where updates much smaller than a weight round away (at lr {cfg.optimizer.lr:g} most "
            f"weights may never change); unset it for float32 master weights")


def with_run_dtypes(model_cfg: ModelConfig, src) -> ModelConfig:
    """`model_cfg` with this run's dtypes: `model.dtype` if set, and master weights in
    `model.param_dtype` or float32 (a bfloat16 checkpoint's storage dtype would otherwise make
    bfloat16 weights and Adam state, where small updates round away)."""
    return model_cfg.replace(param_dtype=src.param_dtype or MASTER_PARAM_DTYPE,
                             **({"dtype": src.dtype} if src.dtype else {}))


def source_model_config(cfg: TrainConfig) -> ModelConfig:
    """The model config of the initial weights, without reading any weights."""
    src = cfg.model
    if src.hf_dir is not None:
        if not storage.isdir(src.hf_dir):
            raise TrainError(f"model.hf_dir not found: {src.hf_dir}")
        with storage.local_copy(src.hf_dir, HF_CONFIG_FILES) as local:  # its configs only
            model_cfg = convert.read_hf_config(local)
    elif src.checkpoint is not None:
        model_cfg = checkpoint.load_config(src.checkpoint)
    elif src.preset is not None:
        model_cfg = preset(src.preset)
    else:
        model_cfg = inline_model_config(src.config)
    return with_run_dtypes(model_cfg, src)


def run_model_config(cfg: TrainConfig) -> ModelConfig:
    """The model config of this launch: a resumed run's is the one saved with its checkpoints
    (the train state restored is the run's own, so the initial weights' directory is not read
    and need not be there any more); a fresh run's is `source_model_config`'s."""
    saved = saved_run_meta(cfg.run_dir)  # None without checkpoints
    if saved is None or not isinstance(saved.get("model_config"), dict):
        return source_model_config(cfg)
    src = cfg.model
    overrides = {k: v for k, v in (("dtype", src.dtype), ("param_dtype", src.param_dtype)) if v}
    saved_cfg = ModelConfig.from_json_dict(saved["model_config"],
                                           where=f"the model config saved in {cfg.run_dir}")
    return saved_cfg.replace(**overrides)


# ---- weights ------------------------------------------------------------------------------

HF_CONFIG_FILES = ("config.json", "generation_config.json")  # what settles an HF model's config
CONVERTED_DIR = "converted"  # RUN_DIR/converted: model.hf_dir as our checkpoint, converted once


def load_initial_model(cfg: TrainConfig, model_cfg: ModelConfig, mesh):
    """The starting weights of a fresh run, each array read straight into its sharding: every
    host reads its own shards (model.hf_dir through its one conversion, `convert_hf_once`)."""
    src = cfg.model
    if src.hf_dir is not None:
        path = convert_hf_once(cfg, mesh)
        log_main(f"loading model.hf_dir's weights from {path}")
    elif src.checkpoint is not None:
        path = src.checkpoint
        log_main(f"loading model checkpoint {path}")
    else:
        return params_lib.create_model(model_cfg, seed=cfg.seed, mesh=mesh, remat=src.remat)
    try:
        model = checkpoint.load_model(path, mesh=mesh, dtype=src.dtype,
                                      param_dtype=model_cfg.param_dtype, remat=src.remat)
    except checkpoint.CheckpointError as e:
        if src.hf_dir is None:
            raise
        raise checkpoint.CheckpointError(f"{e}; delete {path} to convert model.hf_dir "
                                         f"again") from None
    if model.cfg != model_cfg:  # settled from the same files before any weight was read
        raise TrainError(f"the weights in {path} are of another model than this run's config "
                         f"(was {src.hf_dir or path} changed during the launch?)")
    return model


def convert_hf_once(cfg: TrainConfig, mesh) -> str:
    """RUN_DIR/converted: model.hf_dir as a prove-jax checkpoint stored in chunks of this run's
    shards, so that every host then reads only its own shards (no host holds the whole model
    but host 0 while converting). Host 0 converts, the others wait; a relaunch reuses it while
    the HF files and the mesh are unchanged (`convert.conversion_stale`)."""
    hf_dir, out = cfg.model.hf_dir, storage.join(cfg.run_dir, CONVERTED_DIR)

    def convert_unless_current():
        why = convert.conversion_stale(hf_dir, out, mesh)
        if why is None:
            log_main(f"reusing {out}, converted from {hf_dir} by an earlier launch")
            return
        again = f" again ({why})" if storage.exists(out) else ""
        log_main(f"converting {hf_dir} into {out}{again}, on host 0 alone; every host then reads "
                 f"its own shards from there")
        if not storage.is_url(hf_dir):
            convert.hf_to_flax(hf_dir, out, overwrite=True, progress=True, mesh=mesh,
                               record_source=True)
            return
        # the safetensors reader takes local files: host 0 downloads the model once, converts
        # it, and records the bucket's files as the source (their generations, not a temp dir)
        with storage.local_copy(hf_dir) as local:
            convert.hf_to_flax(local, out, overwrite=True, progress=True, mesh=mesh)
        storage.write_text(storage.join(out, convert.SOURCE_RECORD),
                           json.dumps(convert.source_record(hf_dir, mesh), indent=2))

    on_main_host_first(convert_unless_current, f"convert model.hf_dir {hf_dir}")
    return out


def on_main_host_first(fn: Callable[[], None], what: str) -> None:
    """`fn()` on host 0 while the other hosts wait. When it raises there, every host stops: host 0
    with its error, the others with a line pointing at host 0's log (instead of a collective
    timing out later)."""
    error = None
    if distributed.is_main_process():
        try:
            fn()
        except BaseException as e:  # passed on below, after the other hosts heard of it
            error = e
    if jax.process_count() > 1:
        ok = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
        if not ok and error is None:
            raise TrainError(f"host 0 could not {what}; its log says why")
    if error is not None:
        raise error


