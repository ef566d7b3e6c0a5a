"""A run's batches: the data checked before anything is written, and this host's rows of each
global batch (the grain pipeline, data/pipeline.py)."""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import NamedSharding

from prove_jax import storage
from prove_jax.data import pipeline as data_lib
from prove_jax.training.config import TrainConfig, TrainConfigError
from prove_jax.training.errors import TrainError
from prove_jax.training.step import BATCH_SPEC


def require_data(path: str | None) -> None:
    if path is None:
        raise TrainConfigError("no training data: set data=PATH (text file, folder or JSONL)")
    if not storage.exists(path):
        raise TrainError(f"data not found: {path}")


def data_block_size(cfg: TrainConfig) -> int:
    """The block the data pads each row's end to with trained EOS: MARS's (its mask stream
    predicts whole blocks, the last one included). Other objectives get 1, no padding: an AR
    loss over made-up EOS-after-EOS targets would depend on block_size, and the commit head's
    contexts (cut at trained tokens) would end inside such padding."""
    return cfg.block_size if cfg.objective == "mars" else 1


def make_data_iterator(cfg: TrainConfig, tokenizer, log: Callable[[str], None], mesh=None):
    """This host's batches; given the run's `mesh`, exactly the rows of each global batch that
    its devices hold under the batch sharding (else the process's contiguous share)."""
    require_data(cfg.data)
    rows = None if mesh is None else data_lib.host_rows(
        NamedSharding(mesh, BATCH_SPEC), cfg.global_batch_size, cfg.max_length)
    it = data_lib.make_dataset(
        cfg.data, tokenizer, max_length=cfg.max_length, block_size=data_block_size(cfg),
        global_batch_size=cfg.global_batch_size, seed=cfg.seed, shuffle=True, num_epochs=None,
        process_index=jax.process_index(), process_count=jax.process_count(), chat=cfg.chat,
        enable_thinking=cfg.enable_thinking,
        pack_documents=cfg.pack_documents, rows=rows)
    stats = getattr(it, "stats", None)
    if stats is not None:
        packed = f" ({stats.documents} documents packed)" if cfg.pack_documents else ""
        log(f"data: {stats.examples} examples -> {stats.sequences} sequences of {cfg.max_length} "
            f"tokens{packed}, {stats.trained_tokens} trained tokens, {stats.steps_per_epoch} "
            f"steps/epoch, {100 * stats.padding_fraction:.1f}% padding "
            f"(+{100 * stats.fill_fraction:.1f}% block-end EOS)")
        if stats.truncated:
            log(f"warning: {stats.truncated} sequence(s) longer than max_length={cfg.max_length} "
                f"were truncated")
        if stats.dropped:
            log(f"warning: {stats.dropped} sequence(s) dropped "
                f"(no trained token within max_length)")
        if stats.steps_per_epoch == 0:
            log(f"warning: {stats.sequences} sequence(s) fill less than one global batch of "
                f"{cfg.global_batch_size}: each batch repeats them (more data, or a smaller "
                f"global_batch_size)")
    return it



def next_global_batch(data_iter, mesh) -> dict:
    """The next global batch, each host contributing its own rows, sharded over data x fsdp."""
    return data_lib.to_global_batch(next(data_iter), mesh, BATCH_SPEC)
