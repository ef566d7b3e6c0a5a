"""Held-out language-model quality of a checkpoint: next-token NLL, perplexity, top-1 accuracy.

ProVe-lossless reproduces the proposer's greedy output exactly, so any change to the proposer
(MARS fine-tuning, self-distillation) must be checked for what it does to the model itself:

    prove-jax evaluate --model CKPT [--model CKPT2 ...] \\
        --data runs/demo/corpus/heldout.jsonl [--max-length 256] [--max-rows 256] [--mesh 1,4,2]

`--data` is anything the training loader reads (text, a folder, JSONL). Every trained token of
every row counts once (all of plain text, the response of prompt/response records; a
token-weighted mean, unlike the per-sequence training loss). A proposer too
large for one device is read straight into the shards of `--mesh data,fsdp,tensor` (the rows
of each batch split over data x fsdp, the model as training splits it); on several hosts the
same command runs on each (`--coordinator/--num-processes/--process-id` off TPU) and process 0
alone prints.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from prove_jax.models.attention import causal_mask
from prove_jax.models.compute import DEFAULT_COMPUTE, ComputeOptions
from prove_jax.training.objectives import next_token_targets, token_nll
from prove_jax.models.sharding import batch_shards
from prove_jax.training.step import BATCH_SPEC


def heldout_sums(graphdef, compute: ComputeOptions, state, batch: dict):
    """(summed NLL, summed top-1 hits, trained tokens) of one batch, the model rebuilt from
    (graphdef, state) inside the trace and run with `compute` (resolved on the host)."""
    m = nnx.merge(graphdef, state)
    ids = batch["input_ids"]
    b, length = ids.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (b, length))
    logits, _ = m(ids, positions, causal_mask(b, length, batch["valid"]), compute=compute)
    labels, w = next_token_targets(batch)
    hit = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    return (token_nll(logits, labels) * w).sum(), (hit * w).sum(), w.sum()


def heldout_metrics(model, rows, batch_size: int = 16, mesh=None) -> dict:
    """Token-weighted NLL / perplexity / top-1 accuracy of `model` over TokenizedRows; with a
    mesh (the model already sharded on it) each batch's rows are split over data x fsdp."""
    graphdef, state = nnx.split(model)
    place = lambda batch: batch  # noqa: E731
    out_shardings = None
    if mesh is not None:
        shards = batch_shards(mesh)
        batch_size = -(-batch_size // shards) * shards
        rows_sharding = NamedSharding(mesh, BATCH_SPEC)
        place = lambda batch: jax.device_put(batch, rows_sharding)  # noqa: E731
        out_shardings = NamedSharding(mesh, PartitionSpec())  # every host reads the sums

    # resolved here, on the host: the trace reads fields only
    compute = DEFAULT_COMPUTE.resolve()
    sums = jax.jit(functools.partial(heldout_sums, graphdef, compute), out_shardings=out_shardings)

    n = rows.input_ids.shape[0]
    nll = hits = count = 0.0
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        for start in range(0, n, batch_size):
            sl = slice(start, start + batch_size)
            batch = {
                "input_ids": rows.input_ids[sl],
                "loss_mask": rows.loss_mask[sl],
                "valid": rows.valid[sl],
            }
            pad = batch_size - batch["input_ids"].shape[0]  # one shape for every batch: one compile
            batch = {k: np.pad(v, ((0, pad), (0, 0))) for k, v in batch.items()}
            s = sums(state, place(batch))
            nll, hits, count = nll + float(s[0]), hits + float(s[1]), count + float(s[2])
    mean = nll / max(count, 1.0)
    return {"nll": mean, "perplexity": float(np.exp(mean)), "top1_accuracy": hits / max(count, 1.0),
            "tokens": int(count), "rows": int(n)}
