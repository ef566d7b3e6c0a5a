"""A launch's set-up, before the run dir is written: every setting, the tokenizer and the data
checked; the mesh, the optimizer and the train state's layout; the train step compiled.

The model config and tokenizer are settled before any weights are read (a resumed run's from
its own checkpoint metadata and RUN_DIR/tokenizer), so the restore target is known and the step
compiles first.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import optax

from prove_jax import storage
from prove_jax.data.chat import chat_problem
from prove_jax.models.config import ModelConfig
from prove_jax.training.batches import make_data_iterator, require_data
from prove_jax.training.compile_cache import use_compilation_cache
from prove_jax.training.compiled_step import compile_checked
from prove_jax.training.config import TrainConfig, TrainConfigError
from prove_jax.training.errors import TrainError
from prove_jax.training.mesh import config_mesh
from prove_jax.training.metrics import Goodput
from prove_jax.training.model_source import low_precision_master_warning, run_model_config
from prove_jax.training.resume import check_continuation, saved_steps
from prove_jax.training.run_checkpoint import has_checkpoints
from prove_jax.training.run_tokenizer import (check_tokenizer_matches_weights, fill_special_ids,
                                              resolve_tokenizer, with_mask_token)
from prove_jax.training.step import StateLayout, abstract_batch, configured_step


@dataclasses.dataclass
class RunSetup:
    """What a launch settled before writing to its run dir."""
    cfg: TrainConfig  # run_dir made absolute
    resuming: bool  # the run dir has checkpoints
    retuned: list[str]  # optimizer settings changed since the last launch, "key: old -> new"
    saved_steps: int | None  # `steps` of the launch that wrote the checkpoints
    model_cfg: ModelConfig  # the initial weights'
    train_cfg: ModelConfig  # the trained model's (with `<|mask|>` where MARS added it)
    grown: bool  # `<|mask|>` added: the initial weights' embeddings need a row more
    mesh: object
    tokenizer: object
    data_iter: object
    tx: optax.GradientTransformation
    layout: StateLayout
    step_fn: object  # the compiled train step: (state, batch) -> (state, metrics)


def prepare_run(cfg: TrainConfig, log: Callable[[str], None], goodput: Goodput) -> RunSetup:
    """Everything a launch can check or compile before it writes to the run dir (and before it
    reads any weight): a bad setting, tokenizer or data set fails here, leaving the dir as it
    was."""
    run_dir = storage.absolute(cfg.run_dir)
    cfg = dataclasses.replace(cfg, run_dir=run_dir)
    storage.require_bucket(run_dir)  # before orbax or gcsfs could create a mistyped one
    require_data(cfg.data)  # before anything is written to the run dir
    resuming = has_checkpoints(run_dir)
    retuned = check_continuation(run_dir, cfg) if resuming else []
    model_cfg = run_model_config(cfg)  # bad model keys/dtypes fail before BPE training
    if cfg.max_length > model_cfg.max_position_embeddings:  # its position buffers end there
        raise TrainConfigError(f"max_length={cfg.max_length} is longer than the model's context, "
                               f"max_position_embeddings={model_cfg.max_position_embeddings}")
    mesh = config_mesh(cfg, log)
    if (warning := low_precision_master_warning(cfg)) is not None and not resuming:
        log(warning)
    tokenizer, model_cfg, train_cfg, grown = _settle_tokenizer(cfg, model_cfg, resuming)
    # the data is read and checked before the step compiles and before the run dir is written
    data_iter = make_data_iterator(cfg, tokenizer, log, mesh)
    tx, layout, jitted = configured_step(cfg, train_cfg, mesh)
    with goodput.timing("compile"):
        step_fn = compile_step(jitted, layout, mesh, cfg, log)
    return RunSetup(cfg=cfg, resuming=resuming, retuned=retuned,
                    saved_steps=saved_steps(run_dir) if resuming else None, model_cfg=model_cfg,
                    train_cfg=train_cfg, grown=grown, mesh=mesh, tokenizer=tokenizer,
                    data_iter=data_iter, tx=tx, layout=layout, step_fn=step_fn)


def _settle_tokenizer(cfg: TrainConfig, model_cfg: ModelConfig, resuming: bool):
    """(tokenizer, model config, trained model config, grown): the run's tokenizer checked
    against the model and the chat settings, with `<|mask|>` added for MARS."""
    bpe = cfg.tokenizer.bpe_vocab_size
    if bpe and bpe > model_cfg.vocab_size and not resuming:
        raise TrainConfigError(f"tokenizer.bpe_vocab_size={bpe} is larger than the model's "
                               f"vocab_size={model_cfg.vocab_size}")
    tokenizer, tok_where = resolve_tokenizer(cfg)
    if not resuming:
        check_tokenizer_matches_weights(cfg, tokenizer, tok_where, model_cfg)
    if cfg.chat and not getattr(tokenizer, "chat_template", None):
        raise TrainConfigError(f"chat=true but the tokenizer in {tok_where} has no chat template; "
                               f"use a tokenizer with one or set chat=false")
    if cfg.chat and (problem := chat_problem(tokenizer, cfg.enable_thinking)) is not None:
        raise TrainConfigError(f"enable_thinking={str(cfg.enable_thinking).lower()}: {problem} "
                               f"(in {tok_where}); set enable_thinking=null")
    if cfg.model.preset is not None or cfg.model.config is not None:
        model_cfg = fill_special_ids(model_cfg, tokenizer)
    tokenizer, train_cfg, grown = with_mask_token(cfg, tokenizer, model_cfg)
    if len(tokenizer) > train_cfg.vocab_size:
        raise TrainError(f"the tokenizer has {len(tokenizer)} tokens but the model only "
                         f"{train_cfg.vocab_size} embedding rows; use the model's own tokenizer")
    return tokenizer, model_cfg, train_cfg, grown


def compile_step(step_fn, layout: StateLayout, mesh, cfg: TrainConfig, log: Callable[[str], None]):
    """The jitted train step compiled once for the run's shapes, before any weight is loaded;
    refused with the sizes when the devices cannot hold it (state, gradients, activations).
    With `compilation_cache_dir` a relaunch reads it from there instead."""
    use_compilation_cache(cfg.compilation_cache_dir)
    batch = abstract_batch(mesh, cfg.global_batch_size, cfg.max_length, packed=cfg.pack_documents)
    return compile_checked(
        step_fn, (layout.abstract, batch), mesh, name="train step", log=log,
        what=(f"a train step of {cfg.global_batch_size} x {cfg.max_length} tokens (model and "
              f"optimizer state, gradients, activations)"),
        advice=("lower global_batch_size or max_length, raise optimizer.grad_accum, set "
                "model.remat=full (or dots), or use more devices"))
